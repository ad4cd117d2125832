"""Run Megatron-LM's own ``pretrain_gpt.py`` on a machine without a GPU (gloo ranks, CPU tensors).

For trying the real ``--lazy-ckpt`` path on a laptop or in CI, never for training::

    torchrun --nproc-per-node 2 -m datastates_megatron.megatron.cpu_launch \\
        $MEGATRON_LM_DIR/pretrain_gpt.py --distributed-backend gloo --transformer-impl local \\
        --no-gradient-accumulation-fusion --no-persist-layer-norm ... --lazy-ckpt --save DIR

Before the script runs, in this process only and without editing Megatron-LM:

* the CUDA->CPU shim of :mod:`datastates_megatron.megatron.cuda_on_cpu` is installed and
  ``torch.cuda.is_available()`` answers True (Megatron asserts it);
* ``megatron.legacy.fused_kernels.load`` (core_v0.16) is a no-op (it builds CUDA extensions);
* without ``triton``, the one module on the training path that imports it at import time is
  replaced by a stand-in whose functions raise;

With ``DSM_TRAINING_RECORD=PREFIX`` each rank also writes an exact per-iteration record
(:mod:`.training_record`), which the end-to-end tests compare across runs.

With a real GPU present none of that is patched, so the same command line (and the tests built on
it) runs on CUDA too. In both cases ``python3`` and ``python3-config`` on ``PATH`` are this
interpreter's, so that Megatron's ``compile_helpers`` (``make`` in ``megatron/core/datasets``) builds
the dataset helpers for it (some GPU images have no ``python3-config``).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import runpy
import shlex
import shutil
import sys
import sysconfig
import tempfile
import types

from . import training_record

__all__ = ["main", "prepare", "stub_triton_modules"]

_USAGE = "usage: python -m datastates_megatron.megatron.cpu_launch PRETRAIN_SCRIPT [ARGS...]"


# The modules on pretrain_gpt's import path that import triton unguarded (core_v0.16: the first;
# core_v0.19: both); their kernels run only with options that need a GPU (--batch-invariant-mode,
# MoE paged stashing).
_TRITON_MODULES = (
    "megatron.core.transformer.custom_layers.batch_invariant_kernels",
    "megatron.core.transformer.moe.ops.paged_stash",
)


class _TritonFreeStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves :data:`_TRITON_MODULES` as modules whose every name is a function that raises: a
    global ``triton`` stub would mislead torch itself, which probes for triton."""

    def find_spec(self, name, path=None, target=None):
        if name in _TRITON_MODULES:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name, "stand-in: triton is not installed (cpu_launch)")
        mod.__getattr__ = functools.partial(_needs_triton, spec.name)  # type: ignore[attr-defined]
        return mod

    def exec_module(self, module):
        return None


def _needs_triton(module: str, name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise RuntimeError(f"{module}.{name} needs triton, which is not installed")

    return unavailable


def stub_triton_modules() -> None:
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        sys.meta_path.insert(0, _TritonFreeStub())


def _python_on_path() -> str:
    """A directory (ours, made here) with ``python3`` and ``python3-config`` for this interpreter,
    put first on ``PATH``; returned so the caller can remove it at exit."""
    tools = tempfile.mkdtemp(prefix="dsm-cpu-launch-")
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


def prepare(script_dir: str) -> bool:
    """Make ``script_dir``'s Megatron-LM importable and, without a GPU, runnable on CPU.

    Returns True when the CPU shim was installed (False: a GPU is present, nothing patched).
    """
    sys.path.insert(0, script_dir)  # as `python script.py` does; before anything imports megatron
    import torch

    if torch.cuda.is_available():
        return False
    stub_triton_modules()
    from . import cuda_on_cpu

    cuda_on_cpu.install()
    torch.cuda.is_available = lambda: True  # Megatron's initialize asserts it
    try:  # core_v0.16 builds CUDA kernels at start-up; core_v0.19 has no megatron.legacy
        from megatron.legacy import fused_kernels
    except ModuleNotFoundError:
        pass
    else:
        fused_kernels.load = lambda args: None
    return True


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE, file=sys.stderr)
        raise SystemExit(0 if argv else 2)
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        print(f"{_USAGE}\nerror: {argv[0]} is not a file", file=sys.stderr)
        raise SystemExit(2)
    prepare(os.path.dirname(script))
    tools = _python_on_path()  # with a GPU too: some images have no python3-config
    if os.environ.get(training_record.ENV):
        training_record.install(os.environ[training_record.ENV])
    sys.argv = [script, *argv[1:]]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        shutil.rmtree(tools, ignore_errors=True)


if __name__ == "__main__":
    main()
