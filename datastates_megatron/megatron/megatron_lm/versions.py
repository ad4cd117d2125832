"""The one table of Megatron-LM versions this package is tested with.

It drives the source patch (:mod:`.patching`: which patch file a tree gets), the runtime hook
(:mod:`.hook`: which versions it routes without an override), the README's compatibility matrix (a
test renders :func:`matrix_markdown` and compares it with the README) and the ``[megatron]`` extra's
bound in ``pyproject.toml`` (a test compares it with :func:`megatron_core_bound`). A row is added
only with the CI run that tests it (``.ci/run`` unpacks every row's ``source``).

A version is read from ``megatron/core/package_info.py`` (``MAJOR.MINOR.PATCH``; ``__version__`` of
a main checkout carries a git suffix). A version of a tested ``MAJOR.MINOR`` series that is not
itself tested gets that series' patch only with the override (``DSM_ALLOW_UNTESTED_MEGATRON=1``, or
``datastates-ckpt patch --allow-untested``); any other version is refused with one line naming the
tested ones.

Imports nothing beyond the standard library (the patch command runs without torch).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "TESTED",
    "TestedVersion",
    "UntestedVersionError",
    "allow_untested",
    "megatron_core_bound",
    "matrix_markdown",
    "read_version",
    "resolve",
    "tested",
    "tested_names",
]

ALLOW_UNTESTED_ENV = "DSM_ALLOW_UNTESTED_MEGATRON"


@dataclass(frozen=True)
class TestedVersion:
    """One Megatron-LM tree CI tests end to end (patched, and unpatched through the runtime hook)."""

    version: str  # what megatron/core/package_info.py says (MAJOR.MINOR.PATCH)
    source: str  # the tree: a tag, or main-DATE for a snapshot of main
    commit: str
    patch: str  # file under datastates_megatron/megatron/megatron_lm/patches/
    torch: str  # torch CI runs it with (scripts/setup.sh)
    python: str  # Python CI runs it with
    end_to_end: bool = False  # CI also runs the patched pretrain_gpt.py save -> kill -9 -> resume, bit-exact
    note: str = ""

    @property
    def series(self) -> str:
        return ".".join(self.version.split(".")[:2])


TESTED: tuple[TestedVersion, ...] = (
    TestedVersion(
        "0.16.1",
        "core_v0.16.1",
        "55ac7082517c3878ae653c07c09c534b8aed49f6",
        "megatron-lm-core_v0.16.1.patch",
        torch="2.13.0",
        python="3.11",
        end_to_end=True,
    ),
    TestedVersion(
        "0.19.1",
        "core_v0.19.0",
        "5be9626709af2722333bf54797c954c09edeada3",
        "megatron-lm-core_v0.19.0.patch",
        torch="2.13.0",
        python="3.11",
        note="the tag's own version bump says 0.19.1; needs Python >= 3.12 (`typing.override`, which "
        "`cpu.launch` adds on 3.11)",
    ),
    TestedVersion(
        "0.20.0",
        "main-2026-08-22",
        "d98e8a64ddf34856e74b24714e3bedb2f5a39553",
        "megatron-lm-main-2026-08-22.patch",
        torch="2.13.0",
        python="3.11",
        end_to_end=True,
        note="a snapshot of main; its pyproject says Python >= 3.12 (as core_v0.19)",
    ),
)


class UntestedVersionError(ValueError):
    """The Megatron-LM version is not in :data:`TESTED` (the message names the tested ones)."""


def tested_names() -> str:
    return ", ".join(f"{t.version} ({t.source})" for t in TESTED)


def allow_untested() -> bool:
    return os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0")


_FIELD = re.compile(r"^(MAJOR|MINOR|PATCH)\s*=\s*(\d+)", re.MULTILINE)


def read_version(package_info: Path) -> str:
    """``MAJOR.MINOR.PATCH`` of a ``megatron/core/package_info.py`` (ValueError if it has none)."""
    fields = dict(_FIELD.findall(package_info.read_text()))
    if set(fields) != {"MAJOR", "MINOR", "PATCH"}:
        raise ValueError(f"{package_info}: no MAJOR/MINOR/PATCH")
    return f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}"


def tested(version: str) -> TestedVersion | None:
    return next((r for r in TESTED if r.version == version), None)


def resolve(version: str, *, allow: bool | None = None, override: str = f"{ALLOW_UNTESTED_ENV}=1") -> TestedVersion:
    """The row whose patch ``version`` gets: its own, or with the override that of its ``MAJOR.MINOR``
    series (no patch exists for another series). ``override`` is how the refusal names the override."""
    row = tested(version)
    if row is not None:
        return row
    allow = allow_untested() if allow is None else allow
    series = [r for r in TESTED if r.series == ".".join(version.split(".")[:2])]
    if allow and series:
        return series[-1]
    how = f" (to use the {series[-1].source} patch anyway: {override})" if series else ""
    raise UntestedVersionError(f"Megatron-LM {version} is not tested; tested versions: {tested_names()}{how}")


def megatron_core_bound() -> str:
    """The ``megatron-core`` requirement of the ``[megatron]`` extra: the tested series, and no later one."""
    versions = sorted({tuple(int(x) for x in r.series.split(".")) for r in TESTED})
    (lo_major, lo_minor), (hi_major, hi_minor) = versions[0], versions[-1]
    return f"megatron-core>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}"


def matrix_markdown() -> str:
    """The README's compatibility matrix (what CI runs), as a markdown table."""
    lines = [
        "| Megatron-LM | `package_info` | megatron-core | torch | Python | patch | CI runs | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in TESTED:
        ci = "patch, flags, routing; unpatched `pretrain_gpt.py` saves and resumes through the runtime hook"
        if r.end_to_end:
            ci += "; patched `pretrain_gpt.py` save, `kill -9`, resume: bit-exact"
        lines.append(
            f"| `{r.source}` (`{r.commit[:10]}`) | {r.version} | {r.version} (the tree's own) | {r.torch} "
            f"| {r.python} | `{r.patch}` | {ci} | {r.note} |"
        )
    return "\n".join(lines) + "\n"
