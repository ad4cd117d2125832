"""Megatron-LM integration: the glue module, and the patch applied to a real Megatron-LM checkout.

Part 1 (always runs) drives :mod:`datastates_megatron.megatron.megatron_lm.checkpointing` the way the patched
Megatron-LM does, with a recording stand-in for LazyCheckpointer (injected as the
``datastates_megatron.megatron.checkpointing.checkpointer`` module) so the glue's decisions are visible.

Part 2 needs ``MEGATRON_LM_DIRS`` or ``MEGATRON_LM_DIR`` = checkouts of tested versions
(datastates_megatron/megatron/megatron_lm/versions.py; scripts/megatron_lm_tree.sh unpacks them) and Megatron's CPU import dependencies
(``pip install six regex pyyaml pydantic psutil``; triton is stood in for, as ``cpu_launch`` does). It copies ``megatron/`` to a temporary
directory, applies/re-applies/reverts ``scripts/apply_patches.sh`` and, in subprocesses, parses
``--lazy-ckpt ...`` with Megatron's own ``parse_args`` and checks that the patched
``save_checkpoint`` / ``load_checkpoint`` / ``maybe_finalize_async_save`` reach the glue.
"""

from __future__ import annotations

import argparse
import enum
import filecmp
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from datastates_megatron.engine.errors import FormatVersionError, LayoutMismatchError, NoCheckpointError
from datastates_megatron.engine.format.tagged_json import encode_objects
from datastates_megatron.megatron.megatron_lm import checkpointing as megatron_lm
from datastates_megatron.megatron.megatron_lm.args import LazyCkptArgsError, add_lazy_ckpt_args
from tests.integration.megatron_lm_driver import APPLY, apply_patches, copy_megatron, drive, result
from tests.integration.megatron_lm_source import parameters

REPO = Path(__file__).resolve().parents[2]
PATCHED_FILES = (
    "megatron/training/arguments.py",
    "megatron/training/checkpointing.py",
    "megatron/training/async_utils.py",
)


# --------------------------------------------------------------------------- #
# part 1: the glue, with a recording checkpointer
# --------------------------------------------------------------------------- #
class RecordingCheckpointer:
    """Stand-in with LazyCheckpointer's API: records calls, "commits" on poll/wait, loads from memory."""

    instances: list["RecordingCheckpointer"] = []
    store: dict[int, object] = {}  # shared by instances: what a fresh process would find on disk

    def __init__(self, model, optimizer, config, opt_param_scheduler=None, vocab_size=None):
        self.model, self.optimizer, self.config, self.scheduler = model, optimizer, config, opt_param_scheduler
        self.vocab_size = vocab_size
        self.calls: list[tuple] = []
        self.pending: list[int] = []
        self.closed = False
        self.on_commit: list = []  # LazyCheckpointer's telemetry callbacks (the glue adds one)
        RecordingCheckpointer.instances.append(self)

    skipped = (0, 0)  # LazyCheckpointer.skipped: (saves skipped, checkpoints abandoned); nothing is skipped here
    cache_reused = False  # LazyCheckpointer.cache_reused: no earlier attempt's arena here

    def save(self, iteration, extra_state=None, *, final=False):
        encode_objects({"extra_state": extra_state})  # what LazyCheckpointer.save stores: no pickle
        self.calls.append(("save", iteration))
        self.finals = [*getattr(self, "finals", []), iteration] if final else getattr(self, "finals", [])
        self.pending.append(iteration)
        RecordingCheckpointer.store[iteration] = extra_state

    def poll(self):
        self.calls.append(("poll",))
        done, self.pending = self.pending, []
        return done

    def wait(self, persist=True, promote_newest=False):
        self.calls.append(("wait", persist, promote_newest))

    def load(self, iteration=None, *, optimizer=True, rng=True):
        self.calls.append(("load", iteration) if optimizer and rng else ("load", iteration, optimizer, rng))
        if not RecordingCheckpointer.store or (iteration is not None and iteration not in RecordingCheckpointer.store):
            raise NoCheckpointError(f"no lazy checkpoint under {self.config.effective_load_dir}")
        it = max(RecordingCheckpointer.store) if iteration is None else iteration
        return it, RecordingCheckpointer.store[it]

    def close(self, *, keep_cache=False):
        self.calls.append(("close",))
        self.closed = True


@pytest.fixture
def recording(monkeypatch):
    fake = types.ModuleType("datastates_megatron.megatron.checkpointing.checkpointer")
    fake.LazyCheckpointer = RecordingCheckpointer
    monkeypatch.setitem(sys.modules, "datastates_megatron.megatron.checkpointing.checkpointer", fake)
    RecordingCheckpointer.instances = []
    RecordingCheckpointer.store = {}
    monkeypatch.setattr(megatron_lm, "_session", None)
    yield RecordingCheckpointer
    megatron_lm.finalize_at_exit()


def _args(tmp_path, *argv, **megatron):
    p = argparse.ArgumentParser()
    p.add_argument("--save")
    p.add_argument("--load")
    add_lazy_ckpt_args(p)
    args = p.parse_args(["--lazy-ckpt", "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), *argv])
    fields = dict(
        consumed_train_samples=0,
        skipped_train_samples=0,
        consumed_valid_samples=0,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        pretrained_checkpoint=None,
        ckpt_step=None,
        exit_on_missing_checkpoint=False,
        dataloader_save=None,
    )
    fields.update(megatron)
    for k, v in fields.items():
        setattr(args, k, v)
    return args


class _Backend(enum.Enum):  # like megatron.core.transformer.enums.AttnBackend
    auto = 5


def _objects():
    return [torch.nn.Linear(4, 4)], object(), object()


def test_save_then_load_restores_megatron_fields(tmp_path, recording):
    model, opt, sched = _objects()
    args = _args(tmp_path, consumed_train_samples=640, skipped_train_samples=8, consumed_valid_samples=32)
    megatron_lm.save_checkpoint(10, model, opt, sched, 1.5e12, None, args=args)
    (ckpt,) = recording.instances
    assert ckpt.calls == [("save", 10)] and ckpt.model is model and ckpt.optimizer is opt
    assert ckpt.scheduler is sched and ckpt.config.save_dir == args.save
    meg = recording.store[10][megatron_lm.EXTRA_STATE_KEY]
    assert meg["iteration"] == 10 and meg["num_floating_point_operations_so_far"] == 1.5e12
    assert meg["consumed_train_samples"] == 640 and meg["args"]["hidden_size"] == 64
    assert megatron_lm.get_checkpointer() is ckpt

    resumed = _args(tmp_path)
    assert megatron_lm.load_checkpoint(model, opt, sched, args=resumed) == (10, 1.5e12)
    assert (resumed.consumed_train_samples, resumed.skipped_train_samples, resumed.consumed_valid_samples) == (
        640,
        8,
        32,
    )


@pytest.mark.parametrize(
    "flag, optimizer, rng",
    [("--finetune", False, False), ("--no-load-optim", False, True), ("--no-load-rng", True, False)],
)
def test_partial_load_flags_load_what_megatron_lm_loads(tmp_path, recording, flag, optimizer, rng):
    """As Megatron-LM: --finetune loads the model only, from iteration 0 and no consumed samples (the
    saving run's arguments unchecked, its FLOPs counter kept); --no-load-optim leaves out the optimizer
    and scheduler, --no-load-rng the RNG."""
    model, opt, sched = _objects()
    saving = _args(tmp_path, consumed_train_samples=640)
    megatron_lm.save_checkpoint(10, model, opt, sched, 1.5e12, None, args=saving)
    megatron_lm.finalize_at_exit()
    attr = flag[2:].replace("-", "_")
    resumed = (
        _args(tmp_path, hidden_size=128, **{attr: True}) if flag == "--finetune" else _args(tmp_path, **{attr: True})
    )
    got = megatron_lm.load_checkpoint(model, opt, sched, args=resumed)
    ckpt = recording.instances[-1]
    assert ckpt.calls == [("load", None, optimizer, rng)], ckpt.calls
    if flag == "--finetune":
        assert got == (0, 1.5e12) and resumed.consumed_train_samples == 0
    else:
        assert got == (10, 1.5e12) and resumed.consumed_train_samples == 640


def test_the_config_is_built_once_at_start_up(tmp_path, recording, monkeypatch):
    """The session's start validates the flags and builds its LazyCkptConfig in one step."""
    from datastates_megatron.megatron.checkpointing.config import LazyCkptConfig

    built = []
    original = LazyCkptConfig.__post_init__
    monkeypatch.setattr(LazyCkptConfig, "__post_init__", lambda self: built.append(self) or original(self))
    model, opt, sched = _objects()
    megatron_lm.save_checkpoint(1, model, opt, sched, 0, args=_args(tmp_path, "--lazy-ckpt-keep-last", "3"))
    (ckpt,) = recording.instances
    assert built == [ckpt.config] and ckpt.config.keep_last == 3


def test_finalize_lifecycle(tmp_path, recording):
    model, opt, sched = _objects()
    assert megatron_lm.maybe_finalize(blocking=False) == []  # nothing started yet
    args = _args(tmp_path)
    megatron_lm.save_checkpoint(5, model, opt, sched, 0, args=args)
    megatron_lm.save_checkpoint(6, model, opt, sched, 0, args=args)
    assert megatron_lm.maybe_finalize(blocking=False) == [5, 6]
    megatron_lm.save_checkpoint(7, model, opt, sched, 0, args=args)
    assert megatron_lm.maybe_finalize(blocking=True) == [7]
    (ckpt,) = recording.instances
    assert ("wait", True, False) in ckpt.calls and not ckpt.closed
    megatron_lm.maybe_finalize(blocking=True, terminate=True)
    assert ckpt.closed and ckpt.calls[-2:] == [("wait", True, True), ("close",)]  # last one promoted
    assert megatron_lm.get_checkpointer() is None
    megatron_lm.finalize_at_exit()  # idempotent
    assert ckpt.calls.count(("close",)) == 1
    # Megatron's pretrain() may save once more after train() finalized: a new checkpointer.
    megatron_lm.save_checkpoint(8, model, opt, sched, 0, args=args)
    assert len(recording.instances) == 2


def test_other_objects_than_the_first_call_are_refused(tmp_path, recording):
    model, opt, sched = _objects()
    args = _args(tmp_path)
    megatron_lm.save_checkpoint(1, model, opt, sched, 0, args=args)
    megatron_lm.save_checkpoint(2, list(model), opt, sched, 0, args=args)  # same chunks, new list: fine
    with pytest.raises(megatron_lm.MegatronIntegrationError, match="optimizer=None"):
        megatron_lm.load_checkpoint(model, None, None, args=args)


def test_no_checkpoint_starts_from_scratch(tmp_path, recording):
    model, opt, sched = _objects()
    assert megatron_lm.load_checkpoint(model, opt, sched, args=_args(tmp_path)) == (0, 0)


def test_no_checkpoint_with_exit_on_missing_checkpoint_exits(tmp_path, recording):
    model, opt, sched = _objects()
    with pytest.raises(SystemExit):
        megatron_lm.load_checkpoint(model, opt, sched, args=_args(tmp_path, exit_on_missing_checkpoint=True))


def test_ckpt_step_loads_that_iteration_and_a_missing_one_raises(tmp_path, recording):
    model, opt, sched = _objects()
    args = _args(tmp_path)
    for it in (10, 20):
        megatron_lm.save_checkpoint(it, model, opt, sched, it * 1.0, args=args)
    assert megatron_lm.load_checkpoint(model, opt, sched, args=_args(tmp_path, ckpt_step=10)) == (10, 10.0)
    assert recording.instances[0].calls[-1] == ("load", 10)
    with pytest.raises(NoCheckpointError):
        megatron_lm.load_checkpoint(model, opt, sched, args=_args(tmp_path, ckpt_step=15))


def test_without_load_dir_nothing_is_loaded(tmp_path, recording):
    model, opt, sched = _objects()
    args = _args(tmp_path)
    args.load = None
    assert megatron_lm.load_checkpoint(model, opt, sched, args=args) == (0, 0)
    assert recording.instances == []


def test_non_persistent_saves_need_a_node_local_tier_and_release_saves_are_refused(tmp_path, recording):
    model, opt, sched = _objects()
    args = _args(tmp_path)
    with pytest.raises(LazyCkptArgsError, match="--non-persistent-local-ckpt-dir"):
        megatron_lm.save_checkpoint(1, model, opt, sched, 0, non_persistent_ckpt=True, args=args)
    with pytest.raises(LazyCkptArgsError, match="release"):
        megatron_lm.save_checkpoint(1, model, opt, sched, 0, release=True, args=args)
    assert recording.instances == []


def test_megatrons_converter_arguments_and_an_rng_namespace_are_refused_not_dropped(tmp_path, recording):
    model, opt, sched = _objects()
    args = _args(tmp_path)
    with pytest.raises(
        LazyCkptArgsError, match=r"iteration 1: .*converter arguments \(pipeline_rank=0, tensor_rank=1\)"
    ):
        megatron_lm.save_checkpoint(1, model, opt, sched, 0, pipeline_rank=0, tensor_rank=1, args=args)
    with pytest.raises(LazyCkptArgsError, match="iteration 1: rng_state_key_prefix='grid1/'"):
        megatron_lm.save_checkpoint(1, model, opt, sched, 0, rng_state_key_prefix="grid1/", args=args)
    with pytest.raises(LazyCkptArgsError, match=f"--load {tmp_path / 'ckpt'}: rng_state_key_prefix='grid1/'"):
        megatron_lm.load_checkpoint(model, opt, sched, rng_state_key_prefix="grid1/", args=args)
    assert recording.instances == []
    # their defaults (what a stock single-grid run passes) are fine
    megatron_lm.save_checkpoint(
        1, model, opt, sched, 0, None, pipeline_rank=None, preprocess_common_state_dict_fn=len, args=args
    )
    assert recording.instances[0].calls[-1] == ("save", 1)


def test_a_non_persistent_save_goes_to_the_node_local_tier(tmp_path, recording):
    model, opt, sched = _objects()
    args = _args(tmp_path, "--lazy-ckpt-local-dir", str(tmp_path / "local"))
    megatron_lm.save_checkpoint(3, model, opt, sched, 0, non_persistent_ckpt=True, args=args)
    (ckpt,) = recording.instances
    assert ckpt.calls == [("save", 3)] and ckpt.config.local_dir == str(tmp_path / "local")


def test_no_streaming_with_a_too_small_cache_fails_when_the_checkpointer_starts(tmp_path, recording):
    model = [torch.nn.Linear(100, 100)]  # 40000-byte weight
    args = _args(tmp_path, "--lazy-ckpt-no-streaming", "--lazy-ckpt-host-cache-gb", "0.00003")  # 32212 bytes
    with pytest.raises(LazyCkptArgsError, match="--lazy-ckpt-no-streaming needs the host cache.*40000 bytes"):
        megatron_lm.save_checkpoint(1, model, object(), None, 0, args=args)
    args = _args(tmp_path, "--lazy-ckpt-host-cache-gb", "0.00001")  # below the engine's minimum cache
    with pytest.raises(LazyCkptArgsError, match="--lazy-ckpt-host-cache-gb"):
        megatron_lm.save_checkpoint(1, model, object(), None, 0, args=args)
    assert megatron_lm.largest_tensor_bytes(model) == 40000


def test_extra_state_layout_mismatch(tmp_path):
    saved = megatron_lm.build_extra_state(_args(tmp_path, num_layers=3), 30, 7)
    with pytest.raises(LayoutMismatchError, match="num_layers: checkpoint 3, run 2"):
        megatron_lm.apply_extra_state(_args(tmp_path), 30, saved)
    # another TP, PP or VPP size was resharded by the load: the extra state applies
    saved = megatron_lm.build_extra_state(_args(tmp_path, tensor_model_parallel_size=2), 30, 7)
    megatron_lm.apply_extra_state(_args(tmp_path, pipeline_model_parallel_size=2), 30, saved)
    saved = megatron_lm.build_extra_state(_args(tmp_path, virtual_pipeline_model_parallel_size=2), 30, 7)
    megatron_lm.apply_extra_state(_args(tmp_path, virtual_pipeline_model_parallel_size=None), 30, saved)


def test_extra_state_from_a_newer_version(tmp_path):
    saved = megatron_lm.build_extra_state(_args(tmp_path), 30, 7)
    saved[megatron_lm.EXTRA_STATE_KEY]["version"] = megatron_lm.EXTRA_STATE_VERSION + 1
    with pytest.raises(FormatVersionError):
        megatron_lm.apply_extra_state(_args(tmp_path), 30, saved)


def test_extra_state_without_megatron_fields(tmp_path, caplog):
    args = _args(tmp_path, consumed_train_samples=5)
    assert megatron_lm.apply_extra_state(args, 3, None) == 0
    assert args.consumed_train_samples == 5 and "carries no Megatron-LM state" in caplog.text


def test_enum_args_are_stored_by_name(tmp_path, recording):
    """Megatron's args.exit_signal is a signal.Signals (an IntEnum): the first save crashed on it."""
    model, opt, sched = _objects()
    args = _args(tmp_path, exit_signal=signal.SIGTERM, attention_backend=_Backend.auto, enum_list=[signal.SIGUSR1, 3])
    megatron_lm.save_checkpoint(2, model, opt, sched, 0, args=args)
    saved_args = recording.store[2][megatron_lm.EXTRA_STATE_KEY]["args"]
    assert saved_args["exit_signal"] == "SIGTERM" and saved_args["attention_backend"] == "auto"
    assert saved_args["enum_list"] == ["SIGUSR1", 3]


def test_extra_state_keeps_only_json_args(tmp_path):
    args = _args(
        tmp_path,
        params_dtype=torch.bfloat16,
        iterations_to_skip=[3, 4],
        lr=float("nan"),
        _private=1,
        init_method=lambda x: x,
    )
    saved_args = megatron_lm.build_extra_state(args, 1, torch.tensor(2.0))[megatron_lm.EXTRA_STATE_KEY]
    assert saved_args["num_floating_point_operations_so_far"] == 2.0
    saved_args = saved_args["args"]
    assert saved_args["iterations_to_skip"] == [3, 4] and saved_args["lazy_ckpt"] is True
    assert not {"params_dtype", "lr", "_private", "init_method"} & set(saved_args)


# --------------------------------------------------------------------------- #
# part 2: the patch on a real Megatron-LM checkout
# --------------------------------------------------------------------------- #
# Every tree to test: MEGATRON_LM_DIRS (os.pathsep-separated; scripts/test.sh sets both shipped
# tags), else MEGATRON_LM_DIR.
MEGATRON_LM_DIRS = [
    d for d in (os.environ.get("MEGATRON_LM_DIRS") or os.environ.get("MEGATRON_LM_DIR") or "").split(os.pathsep) if d
]
needs_checkout = pytest.mark.skipif(
    not MEGATRON_LM_DIRS,
    reason="MEGATRON_LM_DIR is not set: point it at a Megatron-LM checkout of core_v0.16.1 or "
    "core_v0.19.0 (e.g. `git archive core_v0.16.1 | tar -x -C /tmp/mlm-0.16.1`)",
)


@pytest.fixture(
    scope="module", params=MEGATRON_LM_DIRS or [None], ids=lambda d: os.path.basename(d.rstrip("/")) if d else "none"
)
def megatron_copy(request, tmp_path_factory):
    """``(pristine, patched)``: ``megatron/`` of one Megatron-LM tree (patched or not) copied twice to
    a temporary directory, one copy reverted to the original, the other then patched."""
    src = Path(request.param)
    base = tmp_path_factory.mktemp("megatron-lm")
    pristine, dst = base / "pristine", base / "patched"
    for copy in (pristine, dst):
        copy_megatron(src, copy)
    first = apply_patches(dst)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("applied:"), first.stdout
    return pristine, dst


@pytest.fixture(scope="module")
def driven(megatron_copy, tmp_path_factory):
    """Every driver mode against the patched copy: one process for those that import the package,
    one for ``without-package`` (it must import Megatron with the package hidden)."""
    _, dst = megatron_copy
    tmp = tmp_path_factory.mktemp("driver")
    lib = tmp_path_factory.mktemp("launch-args")
    jobs = {"parse": [], "mapped": [], "validate": [json.dumps(_launch_args(lib))], "route": [], "glue": []}
    return {**drive(dst, tmp / "with", jobs), **drive(dst, tmp / "without", {"without-package": []})}


@needs_checkout
def test_apply_is_idempotent_and_checkable(megatron_copy):
    _, dst = megatron_copy
    again = apply_patches(dst)
    assert again.returncode == 0 and again.stdout.startswith("already applied:"), again.stdout
    check = apply_patches(dst, "--check")
    assert check.returncode == 0 and check.stdout.startswith("already applied:"), check.stdout
    for rel in PATCHED_FILES:
        assert "datastates_megatron" in (dst / rel).read_text(), rel


@needs_checkout
def test_parse_args_takes_the_lazy_ckpt_flags(driven):
    out, tmp_path = result(driven, "parse")
    assert out["lazy_ckpt"] is True and out["default_lazy_ckpt"] is False
    assert (out["save_interval"], out["train_iters"]) == (100, 1000)
    assert out["config"] == dict(
        save_dir=f"{tmp_path}/s",
        load_dir=f"{tmp_path}/l",
        host_cache_gb=8.0,
        flush_threads=3,
        max_inflight=1,
        keep_last=4,
        keep_every=1000,
        verify_on_load=False,
        on_error="warn",
        streaming=False,
        direct_io=True,
        timeout_s=60.0,
        local_dir=f"{tmp_path}/local",
        persist_interval=5,
        local_keep_last=3,
        local_fallback="all",
        recycle_files="local",
        source_writes="auto",
        mapped_writes=True,
        replicas=None,
        replication_jump=None,
        promote_slots=2,
        promote_mbps=0.0,
        when_behind="skip",
        allow_vocab_change=False,
        host_copy=False,  # auto, without --inprocess-restart
    )
    errors = out["errors"]
    assert "--lazy-ckpt requires --save" in errors["no_save"]
    assert "--lazy-ckpt cannot be combined with --async-save" in errors["async_save"]
    assert "--lazy-ckpt cannot be combined with --no-save-optim" in errors["no_save_optim"]
    assert "--non-persistent-save-interval" in errors["non_persistent"]
    assert "--lazy-ckpt-flush-threads must be >= 1" in errors["bad_threads"]


def _launch_args(tmp_path: Path) -> list[str]:
    """MEGATRON_ARGS as datastates_megatron/launch/lib.sh builds them for a GPU job (dsm_megatron_args), tiny sizes."""
    env = dict(
        os.environ,
        NUM_LAYERS="2",
        HIDDEN_SIZE="64",
        FFN_HIDDEN_SIZE="256",
        NUM_ATTENTION_HEADS="4",
        NUM_QUERY_GROUPS="2",
        SEQ_LENGTH="64",
        VOCAB_SIZE="512",
        TP="1",
        PP="1",
        MICRO_BATCH_SIZE="1",
        GLOBAL_BATCH_SIZE="8",
        TRAIN_ITERS="10",
        SAVE_INTERVAL="2",
        LAZY_CKPT_HOST_CACHE_GB="1",
        LAZY_CKPT_FLUSH_THREADS="2",
        SAVE_DIR=str(tmp_path / "save"),
        MEGATRON_LM_DIR=str(tmp_path),
        LAZY_CKPT_LOCAL_DIR=str(tmp_path / "local"),
        DSM_REPO_DIR=str(REPO),
        SLURM_JOB_NUM_NODES="1",
    )
    (tmp_path / "pretrain_gpt.py").touch()  # lib.sh checks that it exists
    script = f'source {REPO}/datastates_megatron/launch/lib.sh >/dev/null; dsm_megatron_args 1 >/dev/null; printf "%s\\0" "${{MEGATRON_ARGS[@]}}"'
    res = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.rstrip("\0").split("\0")


@needs_checkout
def test_megatrons_validated_args_never_fail_a_save(driven, tmp_path):
    """args.exit_signal (signal.Signals, an IntEnum) crashed the first save on an H200: the whole
    namespace that parse_args + validate_args produce for datastates_megatron/launch/lib.sh's flags must be storable."""
    argv = _launch_args(tmp_path)
    assert "--exit-signal-handler" in argv and "--lazy-ckpt" in argv
    out, _ = result(driven, "validate")
    assert "exit_signal" in out["enums"]
    assert out["exit_signal"] == "SIGTERM"
    assert out["saved"] == {"lazy_ckpt": True, "bf16": True, "num_layers": 2, "exit_signal_handler": True}


@needs_checkout
def test_megatrons_local_checkpoint_flags_map_onto_the_node_local_tier(driven):
    """--non-persistent-save-interval 10 --non-persistent-ckpt-type local --non-persistent-local-ckpt-dir:
    local every 10 (Megatron's loop), persisted every --save-interval 100; Megatron's validate_args
    passes without nvidia-resiliency-ext; --ckpt-format and --ckpt-fully-parallel-load named once."""
    out, tmp_path = result(driven, "mapped")
    assert out["config"] == [f"{tmp_path}/local", 100, 1, 4]
    assert out["megatron"] == [10, None, False]
    assert len(out["warnings"]) == 1, out["warnings"]
    assert out["warnings"][0].startswith("--ckpt-format, --ckpt-fully-parallel-load: ignored with --lazy-ckpt")


@needs_checkout
def test_patched_megatron_routes_to_the_glue(driven, megatron_copy):
    out, _ = result(driven, "route")
    _, dst = megatron_copy
    assert out["load_returned"] == [100, 12.5]
    assert (
        out["calls"]
        == [  # every parameter by name after the positional ones (call_params says what each does)
            ["save", 100, True, True, True, 12.5, sorted(parameters(dst, "save_checkpoint")[6:])],
            ["load", True, True, True, sorted(parameters(dst, "load_checkpoint")[3:])],
            ["finalize", False, False],
            ["finalize", True, True],
        ]
    )


@needs_checkout
def test_glue_behind_the_patch_restores_megatron_state(driven):
    out, tmp_path = result(driven, "glue")
    assert out["empty_load"] == [0, 0]
    assert out["load_returned"] == [100, 12.5]
    assert out["consumed"] == [1600, 64]
    assert out["microbatches_before"] == 2 and out["microbatches_after"] == 8  # ramp-up resumed
    assert out["loaded_iteration"] == 100 and out["checkpoint_version"] == 3.0
    assert out["checkpointer_after_exit"] is True
    calls = out["calls"]
    assert calls[0] == ["init", True, True, True, f"{tmp_path}/s"]
    assert ["save", 100] in calls and ["poll", [100]] in calls
    assert calls[-2:] == [["wait", True, True], ["close"]]
    assert [c[0] for c in calls].count("init") == 1


@needs_checkout
def test_patched_megatron_works_without_the_package(driven):
    out, _ = result(driven, "without-package")
    assert out == {"has_lazy_ckpt": False, "lazy_flag_rejected": True}


@needs_checkout
def test_an_untested_release_of_a_tested_series_is_patched_only_when_allowed(megatron_copy, tmp_path):
    pristine, _ = megatron_copy
    copy = tmp_path / "next"
    shutil.copytree(pristine, copy)
    info = copy / "megatron" / "core" / "package_info.py"
    text = info.read_text()
    patch = int(re.search(r"^PATCH = (\d+)", text, re.M).group(1))
    info.write_text(re.sub(r"^PATCH = \d+", f"PATCH = {patch + 1}", text, count=1, flags=re.M))
    refused = apply_patches(copy)
    assert refused.returncode == 2 and " is not tested; tested versions: " in refused.stderr, refused.stderr
    assert "anyway: --allow-untested)" in refused.stderr and len(refused.stderr.splitlines()) == 1
    check = subprocess.run(
        ["bash", str(APPLY), str(copy), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, DSM_ALLOW_UNTESTED_MEGATRON="1"),
    )
    assert check.returncode == 0 and check.stdout.startswith("applies cleanly:"), check.stdout + check.stderr
    applied = apply_patches(copy, "--allow-untested")
    assert applied.returncode == 0 and applied.stdout.startswith("applied:"), applied.stdout + applied.stderr


@needs_checkout
def test_revert_restores_the_original_files(megatron_copy):
    src, dst = megatron_copy
    rev = apply_patches(dst, "--revert")
    assert rev.returncode == 0 and rev.stdout.startswith("reverted:"), rev.stdout + rev.stderr
    for rel in PATCHED_FILES:
        assert filecmp.cmp(src / rel, dst / rel, shallow=False), rel
    again = apply_patches(dst, "--revert")
    assert again.returncode == 0 and again.stdout.startswith("not applied:"), again.stdout
    check = apply_patches(dst, "--check")
    assert check.returncode == 0 and check.stdout.startswith("applies cleanly:"), check.stdout
    reapply = apply_patches(dst)  # leave it patched for any test that runs after
    assert reapply.returncode == 0, reapply.stderr


def test_unsupported_version_is_named_without_a_checkout(tmp_path):
    fake = tmp_path / "megatron" / "core"
    fake.mkdir(parents=True)
    (fake / "package_info.py").write_text("MAJOR = 0\nMINOR = 12\nPATCH = 0\n")
    res = apply_patches(tmp_path)
    assert res.returncode == 2 and "Megatron-LM 0.12.0 is not tested; tested versions: " in res.stderr
    assert (
        "-m datastates_megatron.megatron.megatron_lm.run` (the runtime hook)" in res.stderr
    )  # the way in without a patch
    assert len(res.stderr.splitlines()) == 1


def test_a_directory_that_is_not_megatron_is_refused(tmp_path):
    res = apply_patches(tmp_path)
    assert res.returncode == 2 and "package_info.py not found" in res.stderr
