"""Which dependencies are missing, and the one line that says how to install them.

``pip install --no-deps`` (the way into a cluster's environment, to keep its torch) installs none of
ours: without this check the first import of numba, deep in the engine, is a raw traceback.  The check
only *finds* the modules (``importlib.util.find_spec``: no import, a few path look-ups), so importing
the package stays light.  Stdlib only.
"""

from __future__ import annotations

import importlib.util
import re
import sys

__all__ = ["RUNTIME", "MissingDependencyError", "missing", "require", "check_runtime"]

DIST = "datastates-megatron"
# import names of [project].dependencies in pyproject.toml (tests/unit/test_deps.py keeps them equal)
RUNTIME = ("torch", "numpy", "numba", "tqdm")
_DIST_OF = {"megatron.core": "megatron-core"}  # import name -> distribution, where they differ


class MissingDependencyError(ImportError):
    """A dependency is not installed.  Its message is the whole story: what is missing, what needs it,
    and the pip command (the CLI prints it as its one line)."""


def missing(modules: tuple[str, ...] | list[str]) -> list[str]:
    """The modules of ``modules`` that cannot be found (not imported: only looked up)."""
    out = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a missing parent package; a module set to None in sys.modules
            found = False
        if not found:
            out.append(name)
    return out


def _requirement(dist: str) -> str:
    """``dist`` as our metadata requires it (``numba>=0.60``), or its bare name (a source checkout)."""
    import importlib.metadata  # here only: importing it costs more than the whole check

    try:
        requires = importlib.metadata.requires(DIST) or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    key = re.sub(r"[-_.]+", "-", dist).lower()
    for req in requires:
        spec = req.split(";")[0].strip()
        name = re.split(r"[\s\[<>=!~(]", spec, maxsplit=1)[0]
        if re.sub(r"[-_.]+", "-", name).lower() == key:
            return spec
    return dist


def require(modules: tuple[str, ...] | list[str], needed_by: str, extra: str | None = None) -> None:
    """Raise :class:`MissingDependencyError` when a module of ``modules`` cannot be found.
    ``extra``: the optional-dependency group that installs them all (``megatron``)."""
    lost = missing(modules)
    if not lost:
        return
    dists = [_DIST_OF.get(m, m) for m in lost]
    pip = " ".join(f"'{r}'" if re.search(r"[<>=!~\[]", r) else r for r in map(_requirement, dists))
    also = f" (or pip install '{DIST}[{extra}]')" if extra else ""
    raise MissingDependencyError(
        f"{needed_by} needs {', '.join(dists)}, which {'is' if len(dists) == 1 else 'are'} not installed "
        f"in {sys.executable}: pip install {pip}{also}"
    )


def check_runtime() -> None:
    """Raise :class:`MissingDependencyError` when a runtime dependency is missing; before raising,
    make an uncaught one print as its one line (no traceback) -- the ``datastates-ckpt`` console script
    imports this package before its ``main`` could catch anything."""
    try:
        require(RUNTIME, DIST)
    except MissingDependencyError:
        _one_line_when_uncaught()
        raise


def _one_line_when_uncaught() -> None:
    previous = sys.excepthook

    def hook(kind, value, tb):
        if isinstance(value, MissingDependencyError):
            sys.stderr.write(f"error: {value}\n")
            return
        previous(kind, value, tb)

    sys.excepthook = hook
