"""Run a Megatron-LM training script with ``--lazy-ckpt`` routed to datastates_megatron, unpatched.

::

    torchrun --nproc-per-node 8 -m datastates_megatron.megatron.megatron_lm.run \\
        $MEGATRON_LM_DIR/pretrain_gpt.py ... --lazy-ckpt --save DIR --load DIR

In this process, before the script runs as ``__main__`` (as ``python SCRIPT ARGS`` would run it):

* the script's directory is put first on ``sys.path``;
* :func:`.hook.install` routes Megatron-LM's ``save_checkpoint``, ``load_checkpoint``,
  ``maybe_finalize_async_save`` and ``parse_args`` to the glue, after checking the version against
  the table of tested ones (:mod:`.versions`; ``DSM_ALLOW_UNTESTED_MEGATRON=1`` overrides) and their
  signatures (a refusal exits with status 2 and one line naming the version, and the function or
  the tested versions); a tree that carries our source patch is left as it is; in either tree, an
  in-process restart's abort reaches the glue (:func:`.hook.install_abort`);
* ``python3`` and ``python3-config`` on ``PATH`` are this interpreter's, so that Megatron's
  ``compile_helpers`` (``make`` in ``megatron/core/datasets``) builds the dataset helpers for it
  (some GPU images have no ``python3-config``);
* with ``DSM_TRAINING_RECORD=PREFIX`` each rank also writes an exact per-iteration record
  (:mod:`..cpu.training_record`), which the end-to-end tests compare across runs;
* with ``DSM_FAULT_AT=KIND:ITERATION`` the forward pass of that iteration fails once in this process
  (:mod:`..cpu.fault_injection`: the in-process restart tests).

:mod:`..cpu.launch` is this runner with a CUDA->CPU shim installed first.
"""

from __future__ import annotations

import os
import runpy
import shlex
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable

from ..cpu import fault_injection, training_record

__all__ = ["main", "run_script"]


def _python_on_path() -> str:
    """A directory (ours, made here) with ``python3`` and ``python3-config`` for this interpreter,
    put first on ``PATH``; returned so the caller can remove it at exit."""
    tools = tempfile.mkdtemp(prefix="dsm-run-")
    scripts = {  # a script, not a symlink: a venv's interpreter finds its site-packages by its path
        "python3": f'exec {shlex.quote(sys.executable)} "$@"',
        "python3-config": f"echo {shlex.quote(sysconfig.get_config_var('EXT_SUFFIX'))}",
    }
    for name, body in scripts.items():
        path = os.path.join(tools, name)
        with open(path, "x") as f:
            f.write(f"#!/bin/sh\n{body}\n")
        os.chmod(path, 0o755)
    os.environ["PATH"] = tools + os.pathsep + os.environ.get("PATH", "")
    return tools


def run_script(script: str, args: list[str], *, prepare: Callable[[], object] | None = None) -> None:
    """Run ``script`` as ``__main__`` with ``args``, hooked (see the module docstring).

    ``prepare`` runs after the script's directory is on ``sys.path`` and before Megatron-LM is
    first imported (the CPU launcher installs its shim there).
    """
    from . import hook

    script = os.path.abspath(script)
    sys.path.insert(0, os.path.dirname(script))  # as `python script.py` does
    if prepare is not None:
        prepare()
    try:
        hook.install()
        hook.install_abort()
    except hook.HookError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    tools = _python_on_path()
    if os.environ.get(training_record.ENV):
        training_record.install(os.environ[training_record.ENV])
    if os.environ.get(fault_injection.ENV):
        fault_injection.install(os.environ[fault_injection.ENV])
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        shutil.rmtree(tools, ignore_errors=True)


def main(
    argv: list[str] | None = None,
    *,
    prog: str = "datastates_megatron.megatron.megatron_lm.run",
    prepare: Callable[[], object] | None = None,
) -> None:
    """``python -m PROG PRETRAIN_SCRIPT [ARGS...]``; exit status 2 on a usage error."""
    usage = f"usage: python -m {prog} PRETRAIN_SCRIPT [ARGS...]"
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage, file=sys.stderr)
        raise SystemExit(0 if argv else 2)
    if not os.path.isfile(argv[0]):
        print(f"{usage}\nerror: {argv[0]} is not a file", file=sys.stderr)
        raise SystemExit(2)
    run_script(argv[0], argv[1:], prepare=prepare)


if __name__ == "__main__":
    main()
