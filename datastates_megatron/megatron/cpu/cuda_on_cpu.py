"""Let megatron-core run on a CPU-only machine (``cpu.launch``: the CPU runs of Megatron-LM and the
offline torch_dist export's ranks; and the CPU demo/test harness).

.. warning::
   It monkey-patches ``torch.cuda`` and parts of ``megatron.core`` process-wide: install it only in
   a process of its own that exists to run on CPU (never from the engine or a training job's
   checkpointer), and never in a process that has a real GPU (it refuses to: :func:`install` is a
   no-op when ``torch.cuda.is_available()`` is True).

Megatron-core assumes CUDA in a few places that matter for a tiny GPT trained
with the DistributedOptimizer over gloo:

* buffers/tensors are allocated with ``device='cuda'`` or
  ``device=torch.cuda.current_device()`` (an ``int``, i.e. ``cuda:0``), moved with
  ``.cuda()`` / ``.to('cuda')``;
* ``torch.cuda`` streams, events, ``synchronize``, ``current_device``,
  ``set_device``, ``device_count`` are called unconditionally;
* the DistributedOptimizer dispatches on ``param.type()`` being
  ``'torch.cuda.FloatTensor'`` / ``'torch.cuda.BFloat16Tensor'`` /
  ``'torch.cuda.HalfTensor'``;
* the tensor-parallel RNG tracker reads/writes the CUDA generator.

:func:`install` applies, once:

1. ``torch.cuda`` stand-ins (``current_device`` -> 0, ``device_count`` -> 1,
   no-op ``set_device``/``synchronize``/``empty_cache``, dummy ``Stream``/
   ``Event``/``stream()``/``current_stream()``, zero memory statistics);
2. a process-wide ``TorchFunctionMode`` (pushed on the *calling thread's* mode
   stack; torch function modes are thread-local) that rewrites CUDA device
   arguments (``'cuda'``, ``'cuda:N'``, ``torch.device('cuda')``, a bare ``int``)
   to ``'cpu'``, turns ``Tensor.cuda()`` / ``Tensor.pin_memory()`` into
   identity and ``pin_memory=True`` into False (CPU-only torch has no pinned
   allocator), and makes ``Tensor.type()`` (no argument) report ``torch.cuda.*``.
   Code on *other* threads does not see these rewrites;
3. the CUDA RNG getters/setters (``torch.cuda.{get,set}_rng_state``,
   ``manual_seed[_all]``, ``torch.cuda.random.*`` and megatron's
   ``tensor_parallel.random._{get,set}_cuda_rng_state``) mapped to the CPU
   default generator. (So the "CUDA" RNG stream *is* the CPU stream; megatron's
   tracker ``fork()`` warns that "CPU RNG state changed within GPU RNG context" —
   expected here, and that one message is filtered.)
4. ``torch.compile`` off (``TORCH_COMPILE_DISABLE=1``; megatron's
   ``jit_fuser`` decorates some fusions with ``torch.compile`` at import time):
   everything runs eagerly, which is faster for tiny models and avoids needing
   a C++ toolchain for inductor.

Nothing is done at import time.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import logging
import os
import sys
import threading
import types
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["install", "is_installed"]

_LOCK = threading.Lock()
_INSTALLED = False
_MODE: "_CudaToCpuMode | None" = None


# --------------------------------------------------------------------------- #
# 1. torch.cuda stand-ins
# --------------------------------------------------------------------------- #
class _FakeStream:
    """Stand-in for ``torch.cuda.Stream``: every operation completes immediately."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_FakeEvent":
        event = event if event is not None else _FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_FakeStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _FakeStream)

    def __hash__(self) -> int:
        return 0


_DEFAULT_STREAM = _FakeStream()


class _FakeEvent:
    """Stand-in for ``torch.cuda.Event``; ``elapsed_time`` measures wall-clock ms."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **_: Any
    ) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        import time

        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: "_FakeEvent") -> float:
        if self._t is None or end_event._t is None:
            return 0.0
        return (end_event._t - self._t) * 1000.0


def _noop_fn(name: str):
    """A distinct no-op per patched name (torch._dynamo's trace rules reject one
    function object registered under several ``torch.cuda`` names)."""

    def fn(*_: Any, **__: Any) -> None:
        return None

    fn.__name__ = fn.__qualname__ = f"_cpu_shim_{name}"
    return fn


def _zero_fn(name: str):
    def fn(*_: Any, **__: Any) -> int:
        return 0

    fn.__name__ = fn.__qualname__ = f"_cpu_shim_{name}"
    return fn


@contextlib.contextmanager
def _stream_ctx(stream: Any = None):
    yield stream


class _FakeDeviceCtx:
    def __init__(self, device: Any = None) -> None:
        pass

    def __enter__(self) -> "_FakeDeviceCtx":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _FakeNvtx:
    """``torch.cuda.nvtx`` stand-in."""

    @staticmethod
    def range_push(msg: str) -> int:
        return 0

    @staticmethod
    def range_pop() -> int:
        return 0

    @staticmethod
    def mark(msg: str) -> None:
        return None

    @staticmethod
    @contextlib.contextmanager
    def range(msg: str, *args: Any, **kwargs: Any):
        yield


def _patch_torch_cuda() -> None:
    c = torch.cuda
    c.current_device = lambda: 0
    c.device_count = lambda: 1
    c.set_device = _noop_fn("set_device")
    c.synchronize = _noop_fn("synchronize")
    c.empty_cache = _noop_fn("empty_cache")
    c.Stream = _FakeStream  # type: ignore[misc]
    c.ExternalStream = _FakeStream  # type: ignore[misc]
    c.Event = _FakeEvent  # type: ignore[misc]
    c.current_stream = lambda device=None: _DEFAULT_STREAM
    c.default_stream = lambda device=None: _DEFAULT_STREAM
    c.set_stream = _noop_fn("set_stream")
    c.stream = _stream_ctx
    c.device = _FakeDeviceCtx  # type: ignore[misc]
    c.nvtx = _FakeNvtx  # type: ignore[assignment]
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(c, name, _zero_fn(name))
    c.memory_stats = lambda device=None: {}
    c.reset_peak_memory_stats = _noop_fn("reset_peak_memory_stats")
    c.get_device_capability = lambda device=None: (0, 0)
    # Megatron-LM reads ``.major`` to decide on CUDA_DEVICE_MAX_CONNECTIONS advice at TP/CP > 1
    c.get_device_properties = lambda device=None: types.SimpleNamespace(
        name="cpu", major=0, minor=0, total_memory=0, multi_processor_count=1
    )
    # A CUDA build of torch on a machine without a GPU still names CUDA as its accelerator; with
    # is_available patched, torch itself (DataLoader's pin-memory thread) would then initialise it.
    torch.accelerator.current_accelerator = lambda check_available=False: None
    torch.accelerator.is_available = lambda: False
    c.get_device_name = lambda device=None: "cpu (datastates cuda_on_cpu shim)"


# --------------------------------------------------------------------------- #
# 3. CUDA RNG -> CPU default generator
# --------------------------------------------------------------------------- #
def _cpu_get_rng_state(device: Any = "cuda", *_: Any, **__: Any) -> torch.Tensor:
    return torch.default_generator.get_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = "cuda", *_: Any, **__: Any) -> None:
    torch.default_generator.set_state(new_state)


def _cpu_get_rng_state_all() -> list[torch.Tensor]:
    return [torch.default_generator.get_state()]


def _cpu_set_rng_state_all(states: list[torch.Tensor]) -> None:
    if states:
        torch.default_generator.set_state(states[0])


def _cpu_manual_seed(seed: int) -> None:
    # NOT torch.manual_seed: that calls torch.cuda.manual_seed_all (recursion).
    torch.default_generator.manual_seed(int(seed))


def _megatron_get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.default_generator.get_state()


def _megatron_set_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.default_generator.set_state(new_state)


class _DropForkWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _patch_rng() -> None:
    for mod in (torch.cuda, torch.cuda.random):
        mod.get_rng_state = _cpu_get_rng_state
        mod.set_rng_state = _cpu_set_rng_state
        mod.get_rng_state_all = _cpu_get_rng_state_all
        mod.set_rng_state_all = _cpu_set_rng_state_all
        mod.manual_seed = _cpu_manual_seed
        mod.manual_seed_all = _cpu_manual_seed
    try:
        from megatron.core.tensor_parallel import random as mrandom
    except ImportError:  # megatron-core absent: nothing more to patch
        return
    mrandom._get_cuda_rng_state = _megatron_get_cuda_rng_state
    mrandom._set_cuda_rng_state = _megatron_set_cuda_rng_state
    logging.getLogger(mrandom.__name__).addFilter(_DropForkWarning())


# --------------------------------------------------------------------------- #
# 2. TorchFunctionMode: cuda devices -> cpu, Tensor.type() -> torch.cuda.*
# --------------------------------------------------------------------------- #
def _is_cuda_device(d: Any) -> bool:
    if isinstance(d, bool):
        return False
    if isinstance(d, int):  # torch's bare-int device means cuda:<int>
        return True
    if isinstance(d, str):
        return d.startswith("cuda")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return False


_TENSOR_CUDA = torch.Tensor.cuda
_TENSOR_TO = torch.Tensor.to
_TENSOR_TYPE = torch.Tensor.type
_TENSOR_PIN = torch.Tensor.pin_memory
_TENSOR_IS_PINNED = torch.Tensor.is_pinned


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests to CPU for every torch call on this thread."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _TENSOR_CUDA:
            return args[0]
        if func is _TENSOR_PIN:
            return args[0]
        if func is _TENSOR_IS_PINNED:
            return False
        if func is _TENSOR_TYPE and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch.") :]
            return name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if func is _TENSOR_TO and len(args) >= 2 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _push_mode() -> None:
    global _MODE
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()  # never exited: stays on this thread's torch-function mode stack


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``fix(module)`` the moment module ``name`` has executed, before anything imports from it."""

    def __init__(self, name: str, fix) -> None:
        self.name, self.fix = name, fix

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    self.fix(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


def _after_import(name: str, fix) -> None:
    module = sys.modules.get(name)
    if module is not None:
        fix(module)
    else:
        sys.meta_path.insert(0, _AfterImport(name, fix))


def _no_te_general_gemm(moe_utils: types.ModuleType) -> None:
    """megatron-core 0.16.1's ``moe_utils`` binds ``te_general_gemm`` only when Transformer Engine
    imports, then tests it for ``None``: without TE every MoE router forward is a ``NameError``."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _disable_compile() -> None:
    """Before megatron is imported: torch.compile off (read by torch._dynamo's config when it is
    first imported) and megatron's jit_fuser off as soon as it exists."""
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].config.disable = True
    # megatron's jit_fuser (torch.compile) off the moment megatron.core.jit is executed, before the
    # modules that decorate with it at import time: otherwise each process imports torch._dynamo
    # and inductor for seconds, to compile nothing (compile is disabled)
    _after_import("megatron.core.jit", lambda mjit: mjit.disable_jit_fuser())


# --------------------------------------------------------------------------- #
def is_installed() -> bool:
    """True once :func:`install` has patched this process."""
    return _INSTALLED


def install() -> bool:
    """Apply the CPU shim (idempotent). Returns True if the shim is (now) active.

    Does nothing and returns False when a real GPU is available. Call it on the
    thread that will build and train the model (the device-rewriting
    ``TorchFunctionMode`` is thread-local), *before* building megatron objects.
    """
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return True
        if torch.cuda.is_available():
            return False
        _disable_compile()
        _patch_torch_cuda()
        _patch_rng()
        _after_import("megatron.core.transformer.moe.moe_utils", _no_te_general_gemm)
        _push_mode()
        _INSTALLED = True
        return True
