"""Run Megatron-LM's own ``pretrain_gpt.py`` on a machine without a GPU (gloo ranks, CPU tensors).

For trying the real ``--lazy-ckpt`` path on a laptop or in CI, never for training::

    torchrun --nproc-per-node 2 -m datastates_megatron.megatron.cpu.launch \\
        $MEGATRON_LM_DIR/pretrain_gpt.py --distributed-backend gloo --transformer-impl local \\
        --no-gradient-accumulation-fusion --no-persist-layer-norm ... --lazy-ckpt --save DIR

This is :mod:`..megatron_lm.run` (the runtime hook: a patched or unpatched Megatron-LM tree both work) with,
before Megatron-LM is first imported, in this process only and without editing Megatron-LM:

* the CUDA->CPU shim of :mod:`datastates_megatron.megatron.cpu.cuda_on_cpu` is installed and
  ``torch.cuda.is_available()`` answers True (Megatron asserts it);
* ``megatron.legacy.fused_kernels.load`` (core_v0.16) is a no-op (it builds CUDA extensions);
* without ``triton``, each ``megatron.*`` module that imports it at its top level (found by its
  source; two on core_v0.19's training path, four on main's) is replaced by a stand-in whose
  functions raise;
* ``multiprocessing`` children started by *spawn* (Megatron's ``torch_dist`` writer starts a
  ``Manager``) import this module as their main module instead of re-running the script's imports,
  which would need triton again without the stand-in;
* ``torch.distributed.isend`` of a CPU tensor sends a copy (:mod:`.gloo_sends`: Megatron-LM frees
  a pipeline output while gloo may still be sending it);
* with ``--inprocess-restart`` on the command line and nvidia-resiliency-ext installed, NVRx's
  finalize and abort steps are adapted to CPU ranks (:mod:`.inprocess_cpu`: a plain finalize thread,
  gloo connections shut down on an abort so that a rank blocked in a collective is released);
* on Python < 3.12, ``typing.override`` is ``typing_extensions.override``: core_v0.19 declares
  Python >= 3.12, and this decorator is the one thing it needs from 3.12 to run here.

With a real GPU present only the last one applies, so the same command line (and the tests built
on it) runs on CUDA too.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
import types
import typing

from ..megatron_lm import run

__all__ = ["imports_triton", "main", "prepare", "stub_triton_modules", "spawn_children_import_the_launcher"]

_MODULE = "datastates_megatron.megatron.cpu.launch"  # this module's name also when run with -m


# A module that imports triton unguarded, at its top level (core_v0.16: batch-invariant kernels;
# core_v0.19 adds MoE paged stashing; main adds SSM kernels). Their kernels run only with options that
# need a GPU; recognised by their source, so a new release's new triton modules need no list here.
_TOP_LEVEL_TRITON = re.compile(rb"^(?:import triton\b|from triton(?:\.[\w.]+)? import )", re.MULTILINE)


def imports_triton(source_path: str) -> bool:
    """True when the file imports triton at its top level (not under ``try:``/``if``: indented)."""
    try:
        with open(source_path, "rb") as f:
            return _TOP_LEVEL_TRITON.search(f.read()) is not None
    except OSError:
        return False


class _TritonFreeStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves each ``megatron.*`` module that imports triton at its top level as a module whose every
    name is a function that raises: a global ``triton`` stub would mislead torch itself, which
    probes for triton. Other modules are left to the next finders."""

    def find_spec(self, name, path=None, target=None):
        if not name.startswith("megatron."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not spec.has_location or not str(spec.origin).endswith(".py"):
            return None
        if not imports_triton(spec.origin):
            return None
        return importlib.machinery.ModuleSpec(name, self, origin=spec.origin)

    def create_module(self, spec):
        mod = types.ModuleType(spec.name, "stand-in: triton is not installed (cpu.launch)")
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
    if importlib.util.find_spec("triton") is None and not any(isinstance(f, _TritonFreeStub) for f in sys.meta_path):
        sys.meta_path.insert(0, _TritonFreeStub())


def spawn_children_import_the_launcher() -> None:
    """Spawned children re-import ``__main__`` by path: for ``run_path`` that is the training
    script, whose imports reach the triton modules before any stand-in exists in the child."""
    import multiprocessing.spawn as spawn

    if getattr(spawn.get_preparation_data, "_dsm_launcher", False):
        return
    original = spawn.get_preparation_data

    def get_preparation_data(name):
        data = original(name)
        if data.pop("init_main_from_path", None) is not None:
            data["init_main_from_name"] = _MODULE
        return data

    get_preparation_data._dsm_launcher = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data


def prepare() -> bool:
    """Make Megatron-LM runnable here: without a GPU, on CPU (call before Megatron is imported).

    Returns True when the CPU shim was installed (False: a GPU is present, only ``typing.override``
    may have been added).
    """
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
    import torch

    if torch.cuda.is_available():
        return False
    stub_triton_modules()
    spawn_children_import_the_launcher()
    from . import cuda_on_cpu, gloo_sends

    cuda_on_cpu.install()
    gloo_sends.install()
    if "--inprocess-restart" in sys.argv:
        from . import inprocess_cpu

        inprocess_cpu.install()  # without NVRx: nothing (Megatron-LM then warns and runs unwrapped)
    torch.cuda.is_available = lambda: True  # Megatron's initialize asserts it
    try:  # core_v0.16 builds CUDA kernels at start-up; core_v0.19 has no megatron.legacy
        from megatron.legacy import fused_kernels
    except ModuleNotFoundError:
        pass
    else:
        fused_kernels.load = lambda args: None
    return True


def main(argv: list[str] | None = None) -> None:
    run.main(argv, prog="datastates_megatron.megatron.cpu.launch", prepare=prepare)


if __name__ == "__main__":
    main()
