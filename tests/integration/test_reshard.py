"""Restoring at another data-parallel size, and exporting, with real megatron-core on CPU gloo ranks;
plus the engine's checksummed partial reads (no megatron needed).

One chain of runs (the demo GPT, a fixed global batch split over the DP ranks):
DP=2 fp32 (small buckets) --ckpt 3--> DP=1 (one bucket) --ckpt 4--> DP=2, and DP=4 bf16 --ckpt 3--> DP=2.
Right after each load every parameter, main param and Adam state must equal, element for element,
what the saving run held (dumped with megatron-core's own accessors), and the following losses must
match the saving run's own continuation — which is what resuming at the original DP gives, to the
bit (test_lazy_checkpointer) — to within float tolerance (reductions run in another order).
"""

import importlib.util
import os

import pytest
import torch

from datastates_megatron.engine import CorruptCheckpointError, EngineOptions
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.names import INDEX_NAME
from datastates_megatron.engine.format.manifest import read_manifest
from datastates_megatron.engine.names import iter_dir
from datastates_megatron.engine.load.load_plan import ElementRange, LoadPlan, ReadItem
from datastates_megatron.engine.load.reader import CheckpointReader
from tests.distributed.ranks import describe, run_ranks

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")

WORKER = "tests.workers.reshard_worker"
TOTAL = ["--total", "6"]


def _ok(results):
    assert all(r["returncode"] == 0 and r["result"] is not None for r in results), describe(results)
    return [r["result"] for r in results]


def _losses(result):
    return {int(k): v for k, v in result["losses"].items()}


def _close(resumed, reference, tol):
    assert resumed and all(abs(resumed[i] - reference[i]) <= tol * abs(reference[i]) for i in resumed), (
        resumed,
        reference,
    )


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    """DP=2 fp32 with small buckets: checkpoint of iteration 3 and its reference."""
    d = tmp_path_factory.mktemp("dp2")
    out = _ok(
        run_ranks(
            WORKER,
            2,
            [
                "run",
                *TOTAL,
                "--bucket-size",
                "20000",
                "--save",
                str(d / "ckpt"),
                "--save-at",
                "3",
                "--ref-out",
                str(d / "ref"),
            ],
            timeout=240,
        )
    )
    return d, _losses(out[0])


@needs_megatron
def test_dp2_to_dp1_to_dp2(dp2, tmp_path):
    d, losses2 = dp2
    # 2 -> 1: exact state right after load, then the same training up to float tolerance
    (one,) = _ok(
        run_ranks(
            WORKER,
            1,
            [
                "run",
                *TOTAL,
                "--load",
                str(d / "ckpt"),
                "--load-at",
                "3",
                "--ref-in",
                str(d / "ref"),
                "--save",
                str(tmp_path / "ckpt1"),
                "--save-at",
                "4",
                "--ref-out",
                str(tmp_path / "ref1"),
            ],
            timeout=240,
        )
    )
    assert one["mismatches"] == [], one["mismatches"]
    _close(_losses(one), losses2, 1e-5)
    # 1 -> 2 (from the DP=1 run's own checkpoint of iteration 4; small buckets again)
    two = _ok(
        run_ranks(
            WORKER,
            2,
            [
                "run",
                *TOTAL,
                "--bucket-size",
                "20000",
                "--load",
                str(tmp_path / "ckpt1"),
                "--load-at",
                "4",
                "--ref-in",
                str(tmp_path / "ref1"),
            ],
            timeout=240,
        )
    )
    for r in two:
        assert r["mismatches"] == [], r["mismatches"]
        assert sorted(_losses(r)) == [5, 6]
        _close(_losses(r), _losses(one), 1e-5)


@needs_megatron
def test_dp4_to_dp2_bf16(tmp_path):
    four = _ok(
        run_ranks(
            WORKER,
            4,
            [
                "run",
                *TOTAL,
                "--bf16",
                "--save",
                str(tmp_path / "ckpt"),
                "--save-at",
                "3",
                "--ref-out",
                str(tmp_path / "ref"),
            ],
            timeout=240,
        )
    )
    assert os.path.isfile(os.path.join(iter_dir(str(tmp_path / "ckpt"), 3), INDEX_NAME))  # its global index
    runs = run_ranks(
        WORKER,
        2,
        [
            "run",
            *TOTAL,
            "--bf16",
            "--bucket-size",
            "20000",
            "--load",
            str(tmp_path / "ckpt"),
            "--load-at",
            "3",
            "--ref-in",
            str(tmp_path / "ref"),
        ],
        timeout=240,
    )
    two = _ok(runs)
    # planned from that index (with their other bucket size the new shards overlap most old files here;
    # tests/unit/test_global_index.py and tests/distributed/test_many_ranks.py count the files opened)
    assert not any("reading every rank file's metadata instead" in r["stderr"] for r in runs), describe(runs)
    for r in two:
        assert r["mismatches"] == [], r["mismatches"]
        _close(_losses(r), _losses(four[0]), 1e-3)  # bf16 params: a last-bit flip moves the loss a little more


@needs_megatron
def test_model_only_load_at_another_dp_size(dp2):
    """``load(optimizer=False, rng=False)`` (``--finetune``, ``--no-load-optim``): every parameter of
    the DP=2 run at DP=1, the fresh optimizer and scheduler left as they were."""
    d, _ = dp2
    args = ["run", "--total", "3", "--model-only", "--load", str(d / "ckpt"), "--load-at", "3"]
    (one,) = _ok(run_ranks(WORKER, 1, [*args, "--ref-in", str(d / "ref")], timeout=240))
    assert "error" not in one, one
    assert one["mismatches"] == [] and one["optimizer_states"] == 0 and one["scheduler_steps"] == 0, one


@needs_megatron
def test_model_only_load_of_a_bf16_model_refreshes_its_main_params(tmp_path):
    """bf16 DP=2 -> DP=1, model only: the fp32 main params follow the restored bf16 parameters (as
    Megatron-LM's ``reload_model_params`` after a load without the optimizer)."""
    common = ["run", "--bf16", "--total", "3"]
    _ok(
        run_ranks(
            WORKER,
            2,
            [*common, "--save", str(tmp_path / "ckpt"), "--save-at", "3", "--ref-out", str(tmp_path / "ref")],
            timeout=240,
        )
    )
    load = ["--model-only", "--load", str(tmp_path / "ckpt"), "--load-at", "3", "--ref-in", str(tmp_path / "ref")]
    (one,) = _ok(run_ranks(WORKER, 1, [*common, *load], timeout=240))
    assert "error" not in one, one
    assert one["mismatches"] == [] and one["stale_main_params"] == 0 and one["optimizer_states"] == 0, one


def _refused(results):
    """Every rank's error (one line), with every live tensor as it was before the load."""
    errors = []
    for r in _ok(results):
        err = r["error"]
        assert "\n" not in err and r["digest_before"] == r["digest_after"], (err, r)
        errors.append(err)
    return errors


@needs_megatron
def test_tensor_parallel_change_continues_the_training(dp2):
    """DP2 -> TP2 x DP1 from a plain load (model and optimizer through megatron-core's global
    coordinates): the losses after it follow the saving run's own continuation up to the reduction
    order of the other TP size (bit-exactness against megatron-core's own resharding is
    tests/integration/test_layout_change.py)."""
    d, reference = dp2
    (r0, _r1) = _ok(run_ranks(WORKER, 2, ["tp2", *TOTAL, "--load", str(d / "ckpt"), "--load-at", "3"], timeout=240))
    assert "error" not in r0, r0
    resumed = _losses(r0)
    assert sorted(resumed) == [4, 5, 6], resumed
    _close(resumed, reference, 1e-3)


@needs_megatron
def test_tensor_parallel_change_into_another_model_is_refused_before_any_live_tensor_changes(dp2):
    d, _ = dp2
    args = ["tp2", "--warm", "1", "--hidden", "96", "--load", str(d / "ckpt"), "--load-at", "3"]
    for err in _refused(run_ranks(WORKER, 2, args, timeout=240)):
        assert err.startswith("LayoutMismatchError") and "(TP1×PP1×DP2) in this run (TP2×PP1×DP1)" in err, err
        assert "(slice pp0.tp" in err and "globally in the checkpoint, float32 [" in err and "96" in err, err
        assert "only the data-parallel" not in err, err


@needs_megatron
def test_tensor_parallel_change_takes_an_empty_extra_state_and_refuses_fp8_metadata(tmp_path):
    """Transformer Engine's layers without FP8 write an empty ``_extra_state``: it holds nothing, so
    a TP change goes on; FP8 metadata is kept per local module and refused, naming it, every live
    tensor as it was."""
    for kind in ("empty", "fp8"):
        save = ["run", "--total", "2", "--extra-state", kind, "--save", str(tmp_path / kind), "--save-at", "2"]
        _ok(run_ranks(WORKER, 2, save, timeout=240))
    args = ["tp2", "--total", "3", "--extra-state", "empty", "--load", str(tmp_path / "empty"), "--load-at", "2"]
    for r in _ok(run_ranks(WORKER, 2, args, timeout=240)):
        assert "error" not in r and sorted(_losses(r)) == [3], r
    args = ["tp2", "--warm", "1", "--extra-state", "fp8", "--load", str(tmp_path / "fp8"), "--load-at", "2"]
    for err in _refused(run_ranks(WORKER, 2, args, timeout=240)):
        assert err.startswith("LayoutMismatchError") and "(0.extra_probe._extra_state)" in err, err


@needs_megatron
def test_tensor_parallel_change_of_a_checkpoint_without_global_coordinates_is_refused_naming_the_conversions(
    tmp_path,
):
    """A checkpoint written before identity 3 (no global coordinates) still restores at another DP
    size only: a TP change is refused on every rank, every live tensor as it was, naming the conversion."""
    ckpt = tmp_path / "ckpt"
    _ok(
        run_ranks(
            WORKER, 2, ["run", "--total", "3", "--old-identity", "--save", str(ckpt), "--save-at", "3"], timeout=240
        )
    )
    args = ["tp2", "--warm", "1", "--load", str(ckpt), "--load-at", "3"]
    for err in _refused(run_ranks(WORKER, 2, args, timeout=240)):
        assert err.startswith("LayoutMismatchError") and "(TP1×PP1×DP2) in this run (TP2×PP1×DP1)" in err, err
        assert "no global coordinates (identity version 2" in err, err
        assert f"--load {ckpt} --lazy-ckpt-convert-to OUT_DIR" in err, err
        assert f"datastates-ckpt export {ckpt} OUT_DIR --megatron-lm DIR -- TRAINING_FLAGS" in err, err


@needs_megatron
@pytest.mark.parametrize("vocab", [512, 128])
def test_another_vocabulary_across_a_tensor_parallel_change_is_refused(dp2, vocab):
    """TP1×DP2 of vocabulary 256 at TP2 with vocabulary 512 or 128: refused on every rank, naming
    both vocabularies and the flag, every live tensor as it was (before, it loaded: rows zeroed or
    dropped)."""
    d, _ = dp2
    args = ["tp2", "--warm", "1", "--vocab", str(vocab), "--load", str(d / "ckpt"), "--load-at", "3"]
    for err in _refused(run_ranks(WORKER, 2, args, timeout=240)):
        assert err.startswith("LayoutMismatchError") and "(TP1×PP1×DP2) in this run (TP2×PP1×DP1)" in err, err
        assert f"has 256 rows in the checkpoint, {vocab} in this run" in err, err
        assert f"another vocabulary (256 in the checkpoint, {vocab} in this run)" in err, err
        assert "--lazy-ckpt-allow-vocab-change" in err, err


@needs_megatron
def test_another_vocabulary_loads_with_the_flag_and_its_new_rows_start_at_zero(dp2):
    """With --lazy-ckpt-allow-vocab-change, vocabulary 256 -> 512 at TP2: rows 256..511 (tensor
    rank 1's) are zero in the parameter and in Adam's exp_avg, rows 0..255 are the checkpoint's,
    and training goes on."""
    d, _ = dp2
    args = [
        "tp2",
        "--total",
        "4",
        "--vocab",
        "512",
        "--allow-vocab-change",
        "--load",
        str(d / "ckpt"),
        "--load-at",
        "3",
    ]
    r0, r1 = _ok(run_ranks(WORKER, 2, args, timeout=240))
    assert "error" not in r0 and sorted(_losses(r0)) == [4], r0
    assert r0["embedding_rows"]["zero"] == [] and r0["embedding_rows"]["zero_exp_avg"] == [], r0
    assert r1["embedding_rows"]["zero"] == list(range(256, 512)), r1
    assert r1["embedding_rows"]["zero_exp_avg"] == list(range(256, 512)), r1


@needs_megatron
def test_another_vocabulary_at_a_data_parallel_change_is_refused_and_loads_with_the_flag(dp2):
    """DP2 -> DP1 with vocabulary 512: refused (the shapes differ), every live tensor as it was; with
    --lazy-ckpt-allow-vocab-change it loads through the global coordinates, rows 256..511 at zero."""
    d, _ = dp2
    args = ["run", "--vocab", "512", "--load", str(d / "ckpt"), "--load-at", "3"]
    (err,) = _refused(run_ranks(WORKER, 1, [*args, "--warm", "1"], timeout=240))
    assert err.startswith("LayoutMismatchError") and "float32 [256, 64] in the checkpoint, float32 [512, 64]" in err
    assert "; another vocabulary: pass --lazy-ckpt-allow-vocab-change to load it anyway" in err, err
    (r,) = _ok(run_ranks(WORKER, 1, [*args, "--total", "4", "--allow-vocab-change"], timeout=240))
    assert "error" not in r and sorted(_losses(r)) == [4], r
    assert r["embedding_rows"]["zero"] == list(range(256, 512)), r
    assert r["embedding_rows"]["zero_exp_avg"] == list(range(256, 512)), r


@needs_megatron
def test_another_vocabulary_padding_of_the_same_vocabulary_loads_with_the_padded_rows_at_zero(dp2):
    """Both runs declare vocabulary 256; this one pads it to 512 rows (as megatron-core pads to
    --make-vocab-size-divisible-by × TP): no flag needed, rows 256..511 start at zero."""
    d, _ = dp2
    args = ["tp2", "--total", "4", "--vocab", "512", "--declared-vocab", "256", "--load", str(d / "ckpt")]
    r0, r1 = _ok(run_ranks(WORKER, 2, [*args, "--load-at", "3"], timeout=240))
    assert "error" not in r0 and sorted(_losses(r0)) == [4], r0
    assert r0["embedding_rows"]["zero"] == [] and r1["embedding_rows"]["zero"] == list(range(256, 512)), (r0, r1)


@needs_megatron
def test_another_model_is_refused_before_any_live_tensor_changes(dp2):
    """A DP change into a model of another hidden size: one line naming a parameter, both shapes and
    both layouts, on every rank, and every live tensor (model and optimizer) as it was."""
    d, _ = dp2
    args = ["run", "--warm", "1", "--hidden", "96", "--load", str(d / "ckpt"), "--load-at", "3"]
    (err,) = _refused(run_ranks(WORKER, 1, args, timeout=240))
    assert err.startswith("LayoutMismatchError") and "(TP1×PP1×DP2) in this run (TP1×PP1×DP1)" in err, err
    assert "(slice pp0.tp0, chunk 0) is float32 [" in err and "in the checkpoint, float32 [" in err, err
    assert "96" in err and "only the data-parallel size" not in err, err


@needs_megatron
def test_export_torch(dp2, tmp_path):
    """The consolidated ``torch`` export (no Megatron-LM): every element equal to what the DP=2 run held.
    (The ``torch_dist`` export runs Megatron-LM: tests/integration/test_torch_dist_bridge.py.)"""
    from datastates_megatron.megatron.export.exporter import export

    d, _ = dp2
    path = export(str(d / "ckpt"), str(tmp_path / "torch"), "torch", iteration=3)
    state = torch.load(path, weights_only=False)
    ref = [torch.load(d / "ref" / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for name, value in ref[0]["params"].items():
        assert torch.equal(state[name], value), name
        for rr in ref:
            if name in rr["states"]:
                start, end, st = rr["states"][name]
                for key in ("main", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(state["optimizer"][name][key].view(-1)[start:end], st[key].view(-1)), (name, key)
                assert float(state["optimizer"][name]["step"]) == float(st["step"])
    assert state["iteration"] == 3 and state["model"]["num_layers"] == 2 and state["layout"]["dp"] == 2


# ---------------------------------------------------------------------------------------------- engine
def _one_rank_checkpoint(root, tensors):
    opts = EngineOptions(cache_bytes=1 << 20, chunk_bytes=4096, small_bytes=0, timeout_s=30)  # 4 KiB checksum chunks
    with CheckpointManager(str(root), opts, keep_last=0) as mgr:
        for name, t in tensors.items():
            mgr.register(name, t)
        mgr.save(5, {"iteration": 5})
    ckpt = iter_dir(str(root), 5)
    return ckpt, read_manifest(ckpt)


def test_partial_reads_verify_only_the_chunks_they_touch(tmp_path):
    w = torch.arange(10_000, dtype=torch.float32)  # 40000 bytes: 10 chunks of 4 KiB
    ckpt, manifest = _one_rank_checkpoint(tmp_path, {"w": w, "b": torch.arange(7, dtype=torch.bfloat16)})
    with CheckpointReader(ckpt, manifest) as reader:
        assert torch.equal(reader.read(ElementRange(0, "w", 1020, 10)), w[1020:1030])  # straddles chunks 0 and 1
        assert reader.chunks_of(ElementRange(0, "w", 1020, 10)) == [(0, "w", 0), (0, "w", 1)]
        assert torch.equal(reader.read(ElementRange(0, "b", 2, 3)), torch.arange(2, 5, dtype=torch.bfloat16))
    # corrupt one byte of chunk 5 of "w": ranges elsewhere still read, a range over it is refused
    path = os.path.join(ckpt, manifest.ranks[0].file)
    with CheckpointReader(ckpt, manifest) as reader:
        offset = reader.entry(0, "w").offset + 5 * 4096 + 7
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    with CheckpointReader(ckpt, manifest, threads=2) as reader:
        assert torch.equal(reader.read(ElementRange(0, "w", 0, 1000)), w[:1000])
        dst_ok, dst_bad = torch.zeros(1000), torch.zeros(100)
        plan = LoadPlan(
            "test",
            (ReadItem(ElementRange(0, "w", 0, 1000), dst_ok), ReadItem(ElementRange(0, "w", 5200, 100), dst_bad)),
        )
        with pytest.raises(
            CorruptCheckpointError, match=r"rank 0: .*\.dsck: checksum mismatch in tensor 'w' \(chunk 5,"
        ):
            reader.execute(plan)
        assert not dst_ok.any() and not dst_bad.any()  # verified first: nothing was written
    with CheckpointReader(ckpt, manifest, verify=False) as reader:  # verification off: the bytes as they are
        assert not torch.equal(reader.read(ElementRange(0, "w", 5120, 1024)), w[5120:6144])
