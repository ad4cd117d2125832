"""Route an unpatched Megatron-LM's checkpointing to :mod:`.checkpointing` at run time (no source patch).

:func:`install` does in this process what the source patch (``patches/megatron-lm-*.patch``) does
in Megatron-LM's source, by replacing module attributes:

* ``megatron.training.checkpointing.save_checkpoint`` / ``load_checkpoint`` and
  ``megatron.training.async_utils.maybe_finalize_async_save`` become wrappers that call
  :func:`.megatron_lm.save_checkpoint` / ``load_checkpoint`` / ``maybe_finalize`` when ``--lazy-ckpt``
  is on, and Megatron's own function otherwise (also when the glue itself falls back to Megatron's
  loader, which it does with ``lazy_ckpt`` switched off);
* ``megatron.training.arguments.parse_args`` becomes a wrapper that adds the ``--lazy-ckpt*`` flags
  through ``extra_args_provider`` (before the caller's own provider, as the patch does) and runs
  :func:`.args.validate_lazy_ckpt_args` on the result when ``--lazy-ckpt`` is on.

The names other modules imported before :func:`install` (``from megatron.training.checkpointing
import save_checkpoint`` in ``megatron.training.training``, ``parse_args`` in
``megatron.training.initialize``, ...) are rebound too: every ``megatron.*`` module attribute that
is one of the original functions is replaced by its wrapper. Modules imported later, or that import
at call time, get the wrapper from the defining module.

Before anything is replaced, the Megatron-LM version (``MAJOR.MINOR.PATCH`` of
``megatron.core.package_info``) must be one of :data:`.versions.TESTED` (or ``DSM_ALLOW_UNTESTED_MEGATRON=1``
is set), and each function's parameters are checked against the glue's (by :func:`inspect.signature`):
the glue's positional parameters must exist, and Megatron's function may have no required parameter
the glue does not know. Otherwise :class:`HookError` names the version and the function. Every
parameter of Megatron's function that the glue takes is passed on (:mod:`.call_params` says what the
glue does with each); one it does not take (an untested, newer release) is refused at call time when
it is given a value other than its default, never dropped. A tree that is already patched (its
functions import ``datastates_megatron``) is left alone, so nothing is routed twice; a partly
patched one is refused.

:func:`install_abort` (patched or not) makes Megatron-LM's in-process restart tell the glue that an
attempt is aborted: ``megatron.training.async_utils.reset_persistent_async_worker``, which Megatron's
``AbortCheckpoint`` (``--inprocess-restart``) calls in the wrapper's abort step, first calls
:func:`.checkpointing.abort`.

Not thread-safe: call it once, on the main thread, before the training script runs.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

from . import checkpointing as megatron_lm, versions
from .args import add_lazy_ckpt_args, validate_lazy_ckpt_args

__all__ = ["HookError", "ROUTED", "install", "install_abort", "megatron_lm_version"]

logger = logging.getLogger(__name__)

# (Megatron-LM module, function) -> (the glue function whose parameters it must have, how many of
# them the patch passes positionally: the hook calls the glue exactly as the patch does)
ROUTED: dict[tuple[str, str], tuple[str, int]] = {
    ("megatron.training.checkpointing", "save_checkpoint"): ("save_checkpoint", 6),
    ("megatron.training.checkpointing", "load_checkpoint"): ("load_checkpoint", 3),
    ("megatron.training.async_utils", "maybe_finalize_async_save"): ("maybe_finalize", 0),
    ("megatron.training.arguments", "parse_args"): ("", 0),  # wrapped here, not forwarded
}
_PARSE_ARGS_PARAMS = ("extra_args_provider", "ignore_unknown_args")
_MARK = "__datastates_megatron_hook__"  # set on our wrappers
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class HookError(megatron_lm.MegatronIntegrationError):
    """This Megatron-LM cannot be routed at run time (the message names the version and function)."""


def megatron_lm_version() -> str:
    try:
        from megatron.core.package_info import __version__
    except ImportError:
        return "(unknown version)"
    return str(__version__)


def _version_triple() -> str:
    """``MAJOR.MINOR.PATCH`` (a main checkout's ``__version__`` carries a git suffix)."""
    try:
        from megatron.core import package_info
    except ImportError:
        return "(unknown version)"
    fields = [getattr(package_info, f, None) for f in ("MAJOR", "MINOR", "PATCH")]
    if all(isinstance(f, int) for f in fields):
        return ".".join(map(str, fields))
    return str(getattr(package_info, "__version__", "(unknown version)")).split("+")[0]


def _check_version() -> None:
    """Refuse a Megatron-LM by the patch's own rule (:func:`.versions.resolve`): a tested version is
    routed; with the override, so is an untested one of a tested ``MAJOR.MINOR`` series; a version of
    any other series never is."""
    version = _version_triple()
    if versions.tested(version) is not None:
        return
    try:
        row = versions.resolve(version, allow=True)  # is there a series for the override to use?
    except versions.UntestedVersionError:
        row = None
    if row is not None and versions.allow_untested():
        logger.warning(
            "Megatron-LM %s is not tested with the datastates_megatron runtime hook (%s=1 set: routed as "
            "its series' %s); tested: %s",
            version,
            versions.ALLOW_UNTESTED_ENV,
            row.version,
            versions.tested_names(),
        )
        return
    how = (
        f" (to route it anyway: {versions.ALLOW_UNTESTED_ENV}=1)"
        if row is not None
        else f" (no tested version of its {'.'.join(version.split('.')[:2])} series: it cannot be routed)"
    )
    raise HookError(
        f"Megatron-LM {version} is not tested with the datastates_megatron runtime hook; tested versions: "
        f"{versions.tested_names()}{how}"
    )


def _glue_params(glue_name: str, kinds=_NAMED) -> tuple[str, ...]:
    """The parameters the glue function takes from Megatron's call (not ``args``): all of them, or
    with ``kinds=(POSITIONAL_OR_KEYWORD,)`` those Megatron's function must have (the keyword-only
    ones are taken where it has them: older releases lack some)."""
    if not glue_name:
        return _PARSE_ARGS_PARAMS
    sig = inspect.signature(getattr(megatron_lm, glue_name))
    return tuple(p.name for p in sig.parameters.values() if p.kind in kinds and p.name != "args")


def _check_signature(where: str, fn: Callable, wanted: tuple[str, ...], taken: tuple[str, ...]) -> inspect.Signature:
    """``wanted``: what Megatron's function must have; ``taken``: every parameter the glue takes."""
    sig = inspect.signature(fn)
    named = {p.name for p in sig.parameters.values() if p.kind in _NAMED}
    missing = [n for n in wanted if n not in named]
    unknown = [  # an optional one the glue does not take is refused at call time when given
        p.name
        for p in sig.parameters.values()
        if p.default is inspect.Parameter.empty and p.kind in _NAMED and p.name not in taken
    ]
    if missing or unknown:
        what = "; ".join(
            ([f"no parameter {', '.join(missing)}"] if missing else [])
            + ([f"new required parameter {', '.join(unknown)}"] if unknown else [])
        )
        raise HookError(
            f"Megatron-LM {megatron_lm_version()}: {where}{sig} does not match what the "
            f"datastates_megatron runtime hook routes ({what}); apply the source patch instead "
            "(datastates-ckpt patch MEGATRON_DIR, or scripts/apply_patches.sh)"
        )
    return sig


def _is_patched(fn: Callable) -> bool:
    """True when ``fn`` imports datastates_megatron (what our source patch adds to each function)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return code is not None and any(n.startswith("datastates_megatron") for n in code.co_names)


def _lazy_ckpt(get_args: Callable[[], Any]) -> bool:
    return bool(getattr(get_args(), "lazy_ckpt", False))


def _forwarding(original: Callable, sig: inspect.Signature, glue_name: str, params, positional, get_args) -> Callable:
    """Call the glue with every parameter of Megatron's function: the first ``positional`` ones by
    position (as the patch does), the rest by name. A parameter the glue does not take (a newer
    Megatron-LM, run with the override) is refused when it is given a value other than its default."""
    where = f"{original.__module__}.{original.__name__}"
    theirs = [p for p in sig.parameters.values() if p.kind in _NAMED]
    passed = [p.name for p in theirs if p.name in params]
    unknown = {p.name: p.default for p in theirs if p.name not in params}

    @functools.wraps(original)
    def routed(*args: Any, **kwargs: Any) -> Any:
        if not _lazy_ckpt(get_args):
            return original(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        given = [n for n, default in unknown.items() if _differs(bound.arguments[n], default)]
        if given:
            raise HookError(
                f"Megatron-LM {megatron_lm_version()}: {where} was called with {', '.join(given)}, which "
                "--lazy-ckpt does not handle; run without --lazy-ckpt or with a tested Megatron-LM "
                f"({versions.tested_names()})"
            )
        glue = getattr(megatron_lm, glue_name)  # looked up per call, as the patch's import is
        head = [bound.arguments[n] for n in params[:positional]]
        return glue(*head, **{n: bound.arguments[n] for n in passed if n not in params[:positional]})

    return routed


def _differs(value: Any, default: Any) -> bool:
    """True unless ``value`` is the default (the same object, or an equal plain value: ``''``, ``0``)."""
    if value is default:
        return False
    plain = (type(None), bool, int, float, str)
    return not (type(value) is type(default) and isinstance(value, plain) and value == default)


def _parse_args(original: Callable, sig: inspect.Signature) -> Callable:
    @functools.wraps(original)
    def parse_args(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        theirs = bound.arguments["extra_args_provider"]

        def provider(parser):
            parser = add_lazy_ckpt_args(parser)
            return parser if theirs is None else theirs(parser)

        bound.arguments["extra_args_provider"] = provider
        parsed = original(*bound.args, **bound.kwargs)
        if getattr(parsed, "lazy_ckpt", False):
            validate_lazy_ckpt_args(parsed)
        return parsed

    return parse_args


def _rebind(original: Callable, wrapper: Callable) -> list[str]:
    """Replace ``original`` by ``wrapper`` wherever a loaded ``megatron.*`` module holds it."""
    sites = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "megatron" or name.startswith("megatron.")):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, wrapper)
                sites.append(f"{name}.{attr}")
    return sites


def install() -> str:
    """Route Megatron-LM's checkpointing and argument parsing to datastates_megatron.

    Returns ``"hooked"`` (routed now), ``"already"`` (routed by an earlier call) or ``"patched"``
    (the tree carries our source patch: nothing done). Raises :class:`HookError` on a signature
    mismatch or a partly patched tree, before anything is replaced. Megatron-LM must be importable.
    """
    found = {}
    for module_name, fn_name in ROUTED:
        module = importlib.import_module(module_name)
        found[(module_name, fn_name)] = getattr(module, fn_name)
    if all(getattr(fn, _MARK, False) for fn in found.values()):
        return "already"
    patched = [f"{m}.{f}" for (m, f), fn in found.items() if _is_patched(fn)]
    if patched:
        if len(patched) == len(found):
            logger.info("Megatron-LM %s carries the datastates_megatron patch: no runtime hook", megatron_lm_version())
            return "patched"
        raise HookError(
            f"Megatron-LM {megatron_lm_version()} is partly patched ({', '.join(patched)} only): "
            "re-apply or revert the patch with datastates-ckpt patch (or scripts/apply_patches.sh)"
        )
    _check_version()
    checked = {}  # every signature first: nothing is replaced unless all four match
    for (module_name, fn_name), (glue_name, positional) in ROUTED.items():
        params = _glue_params(glue_name)
        original = found[(module_name, fn_name)]
        required = _glue_params(glue_name, (inspect.Parameter.POSITIONAL_OR_KEYWORD,))
        sig = _check_signature(f"{module_name}.{fn_name}", original, required, params)
        checked[original] = (glue_name, params, positional, sig)
    from megatron.training.global_vars import get_args

    wrappers = {}
    for original, (glue_name, params, positional, sig) in checked.items():
        if glue_name:
            wrappers[original] = _forwarding(original, sig, glue_name, params, positional, get_args)
        else:
            wrappers[original] = _parse_args(original, sig)
    for original, wrapper in wrappers.items():
        setattr(wrapper, _MARK, True)
        sites = _rebind(original, wrapper)
        logger.debug("datastates_megatron runtime hook: %s", ", ".join(sites))
    logger.info("Megatron-LM %s: checkpointing routed by the datastates_megatron runtime hook", megatron_lm_version())
    return "hooked"


def install_abort() -> bool:
    """Make ``reset_persistent_async_worker`` (Megatron's ``AbortCheckpoint``) call
    :func:`.checkpointing.abort` first, wherever a loaded ``megatron.*`` module holds it; idempotent.
    Returns False when this Megatron-LM has no such function (no in-process restart to hook)."""
    async_utils = importlib.import_module("megatron.training.async_utils")
    original = getattr(async_utils, "reset_persistent_async_worker", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def reset_persistent_async_worker(*args: Any, **kwargs: Any) -> Any:
        megatron_lm.abort()
        return original(*args, **kwargs)

    setattr(reset_persistent_async_worker, _MARK, True)
    _rebind(original, reset_persistent_async_worker)
    return True
