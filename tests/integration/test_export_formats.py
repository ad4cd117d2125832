"""``datastates-ckpt export`` in every format, on the layouts a new user writes first, each output
read back by its own consumer and compared bit for bit with the tensors the training run held.

One tiny training run per layout (the demo GPT with megatron-core on CPU gloo ranks,
``tests/workers/reshard_worker.py``; built once per module): 1 rank, TP1 x DP2, TP2 x DP1, and
TP2 x DP1 with ``--swiglu`` (its fused ``linear_fc1`` is a megatron-core ``ShardedTensorFactory``:
two pieces per rank).  Right after saving iteration 2, every rank dumps what it holds (its
TP-local parameters with their ``partition_dim``, its main params and Adam states, by megatron-core's
own accessors); the full tensors are assembled from those dumps here, not from our metadata:

* ``--format safetensors``: read by the ``safetensors`` library;
* ``--format torch_dist --nproc N``: read by megatron-core's ``dist_checkpointing.load_plain_tensors``
  (in a process of its own: it needs a process group), layers stacked on megatron-core's layer axis;
* ``--format torch``: read by ``torch.load``, model and optimizer state; TP2 is refused in one line.

Names are megatron-core's (its sharded keys, as a single-rank model names a layer): the local
layer spec's ``sharded_state_dict_keys_map`` says which module a layer norm is recorded under.

The Megatron-LM ``pretrain_gpt.py`` checkpoint at TP2 x PP2, against Megatron-LM's own
conversion, and the fine-tune from the export: ``tests/integration/test_export_global.py`` (slow).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.ranks import describe, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("safetensors") is None,
    reason="needs megatron-core and safetensors (the [megatron] extra)",
)

WORKER = "tests.workers.reshard_worker"
ITERATION = 2
# name: (ranks, worker arguments, TP size, swiglu)
LAYOUTS = {
    "one_rank": (1, ["run"], 1, False),
    "dp2": (2, ["run"], 1, False),
    "tp2": (2, ["tp2"], 2, False),
    "tp2_swiglu": (2, ["tp2", "--swiglu"], 2, True),
}
LAYERS = "decoder.layers."


# ---------------------------------------------------------------------------------------------- the runs
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(layout)``: ``(checkpoint root, [each rank's dump])`` of that layout's run (one run per
    layout and module, on first use)."""
    built: dict[str, tuple[Path, list[dict]]] = {}

    def get(layout: str):
        if layout not in built:
            ranks, args, _, swiglu = LAYOUTS[layout]
            d = tmp_path_factory.mktemp(layout)
            run = [*args, "--total", str(ITERATION), "--save", str(d / "ckpt"), "--save-at", str(ITERATION)]
            results = run_ranks(WORKER, ranks, [*run, "--ref-out", str(d / "ref")], timeout=300)
            assert all(r["returncode"] == 0 and r["result"] for r in results), describe(results)
            dumps = [torch.load(d / "ref" / f"rank{r}.pt", weights_only=True) for r in range(ranks)]
            built[layout] = d / "ckpt", dumps
        return built[layout]

    return get


def _glu_halves(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's fused GLU weight is its piece of ``w`` then its piece of ``v`` (megatron-core's
    ``apply_swiglu_sharded_factory``)."""
    w, v = torch.chunk(t, 2, dim)
    return w, v


def full_parameters(dumps: list[dict], tp: int, swiglu: bool) -> dict[str, torch.Tensor]:
    """Every parameter whole, by the training model's own name: the TP ranks' pieces joined on
    their ``partition_dim`` (a fused GLU weight: every rank's ``w`` piece, then every rank's ``v``);
    a parameter every TP rank holds whole must be the same on each."""
    by_tp = {d["tp_rank"]: d for d in dumps}
    assert sorted(by_tp) == list(range(tp)) and all(d["tp_size"] == tp for d in dumps)
    out = {}
    for name, first in dumps[0]["params"].items():
        dim = dumps[0]["tp_dims"][name]
        pieces = [by_tp[r]["params"][name] for r in range(tp)]
        if tp == 1 or dim is None:
            assert all(torch.equal(p, first) for p in pieces), name
            out[name] = first
        elif swiglu and ".mlp.linear_fc1." in name:
            halves = [_glu_halves(p, dim) for p in pieces]
            out[name] = torch.cat([w for w, _ in halves] + [v for _, v in halves], dim)
        else:
            out[name] = torch.cat(pieces, dim)
    return out


def megatron_name(name: str) -> str:
    """The name megatron-core records a parameter of the local layer spec under."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if not name.startswith(LAYERS):
        return name
    layer, _, rest = name[len(LAYERS) :].partition(".")
    for old, new in get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map.items():
        if rest.startswith(old):
            rest = new + rest[len(old) :]
    return f"{LAYERS}{layer}.{rest}"


def stacked(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Single-rank names -> megatron-core's keys: a layer's tensors stacked on the layer axis."""
    layers: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, t in tensors.items():
        if name.startswith(LAYERS):
            layer, _, rest = name[len(LAYERS) :].partition(".")
            layers.setdefault(LAYERS + rest, {})[int(layer)] = t
        else:
            out[name] = t
    for key, per_layer in layers.items():
        assert sorted(per_layer) == list(range(len(per_layer))), key
        out[key] = torch.stack([per_layer[i] for i in range(len(per_layer))])
    return out


def _export(*args: str) -> tuple[int, dict | None, str]:
    """``datastates-ckpt export ARGS --json`` as a user runs it: (exit status, its JSON line, stderr)."""
    from datastates_megatron.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["export", *args, "--json"])
    lines = out.getvalue().splitlines()
    return code, json.loads(lines[-1]) if code == 0 and lines else None, err.getvalue()


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))[:6]}"
    differ = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not differ, f"{what}: {len(differ)} of {len(want)} tensors differ, e.g. {differ[:3]}"


# ---------------------------------------------------------------------------------------------- safetensors
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_safetensors_export_is_what_the_run_held(layout, saved, tmp_path):
    from safetensors.torch import load_file

    ckpt, dumps = saved(layout)
    _, _, tp, swiglu = LAYOUTS[layout]
    code, doc, err = _export(str(ckpt), str(tmp_path / "st"), "--format", "safetensors")
    assert code == 0, err
    path = tmp_path / "st" / f"iter_{ITERATION:07d}.safetensors"
    assert doc == {"path": str(path), "format": "safetensors", "iteration": ITERATION}
    want = {megatron_name(n): t for n, t in full_parameters(dumps, tp, swiglu).items()}
    assert_bit_equal(load_file(str(path)), want, f"{layout} safetensors")


# ---------------------------------------------------------------------------------------------- torch_dist
_LOAD = """
import sys, tempfile, torch, torch.distributed as dist
from megatron.core import dist_checkpointing
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
for checkpoint, out in zip(sys.argv[1::2], sys.argv[2::2]):
    torch.save(dist_checkpointing.load_plain_tensors(checkpoint), out)
"""
TORCH_DIST_NPROC = {"one_rank": 1, "dp2": 1, "tp2": 1, "tp2_swiglu": 2}  # the export's own processes


@pytest.fixture(scope="module")
def torch_dist_loaded(saved, tmp_path_factory):
    """Every layout exported to torch_dist (``--nproc`` of :data:`TORCH_DIST_NPROC`), then read back
    by megatron-core in one process: ``{layout: (exit status, JSON line, stderr, tensors or None)}``."""
    tmp = tmp_path_factory.mktemp("torch_dist")
    exported, loads = {}, []
    for layout, nproc in TORCH_DIST_NPROC.items():
        ckpt, _ = saved(layout)
        exported[layout] = _export(str(ckpt), str(tmp / layout), "--format", "torch_dist", "--nproc", str(nproc))
        if exported[layout][0] == 0:
            loads += [str(tmp / layout / f"iter_{ITERATION:07d}"), str(tmp / f"{layout}.pt")]
    done = subprocess.run([sys.executable, "-c", _LOAD, *loads], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = {}
    for layout, (code, doc, err) in exported.items():
        tensors = torch.load(tmp / f"{layout}.pt", weights_only=False) if code == 0 else None
        out[layout] = code, doc, err, tmp / layout, tensors
    return out


@pytest.mark.parametrize("layout", list(TORCH_DIST_NPROC))
def test_torch_dist_export_loads_in_megatron_core_as_what_the_run_held(layout, saved, torch_dist_loaded):
    _, dumps = saved(layout)
    _, _, tp, swiglu = LAYOUTS[layout]
    code, doc, err, out, got = torch_dist_loaded[layout]
    assert code == 0, err
    assert doc == {"path": str(out / f"iter_{ITERATION:07d}"), "format": "torch_dist", "iteration": ITERATION}
    assert (out / "latest_checkpointed_iteration.txt").read_text() == str(ITERATION)
    assert not any(p.name.startswith(".export-") for p in out.iterdir())  # the staging directory is gone
    assert (got.pop("iteration"), got.pop("checkpoint_version")) == (ITERATION, 3.0)
    want = stacked({megatron_name(n): t for n, t in full_parameters(dumps, tp, swiglu).items()})
    assert_bit_equal(got, want, f"{layout} torch_dist")


# ---------------------------------------------------------------------------------------------- torch
def full_optimizer(dumps: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's main param and Adam states whole, from the DP ranks' shards (TP1)."""
    params = dumps[0]["params"]
    out: dict[str, dict] = {}
    for d in dumps:
        for name, (start, end, states) in d["states"].items():
            full = out.setdefault(name, {})
            for key, v in states.items():
                if key == "step":
                    assert full.setdefault("step", v).item() == v.item(), name
                    continue
                t = full.setdefault(key, torch.full((params[name].numel(),), float("nan"), dtype=v.dtype))
                t[start:end] = v.view(-1)
    for name, full in out.items():
        for key in ("main", "exp_avg", "exp_avg_sq"):
            full[key] = full[key].view(params[name].shape)
            assert not full[key].isnan().any(), (name, key)  # every element held by some DP rank
    return out


@pytest.mark.parametrize("layout", ["one_rank", "dp2"])
def test_torch_export_is_what_the_run_held_model_and_optimizer(layout, saved, tmp_path):
    ckpt, dumps = saved(layout)
    ranks = LAYOUTS[layout][0]
    code, doc, err = _export(str(ckpt), str(tmp_path / "pt"), "--format", "torch")
    assert code == 0, err
    state = torch.load(doc["path"], weights_only=False)
    assert doc == {"path": str(tmp_path / "pt" / f"iter_{ITERATION:07d}.pt"), "format": "torch", "iteration": 2}
    assert state["iteration"] == ITERATION and state["layout"]["dp"] == ranks and state["layout"]["tp"] == 1
    params = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    assert_bit_equal(params, full_parameters(dumps, 1, False), f"{layout} torch")
    want = full_optimizer(dumps)
    assert sorted(state["optimizer"]) == sorted(want)
    for name, states in want.items():
        got = state["optimizer"][name]
        for key in ("main", "exp_avg", "exp_avg_sq"):
            assert got[key].dtype == states[key].dtype and torch.equal(got[key], states[key]), (name, key)
        assert float(got["step"]) == float(states["step"]), name


def test_torch_export_of_a_tp2_checkpoint_is_refused_in_one_line_naming_the_layout(saved, tmp_path):
    ckpt, _ = saved("tp2")
    code, _, err = _export(str(ckpt), str(tmp_path / "pt"), "--format", "torch")
    assert code != 0 and err.count("\n") == 1, err
    assert "export needs a checkpoint written with TP=PP=CP=EP=1" in err and "'tp': 2" in err, err
    assert not (tmp_path / "pt").exists() or not any((tmp_path / "pt").iterdir())


def test_iteration_picks_a_committed_one_and_refuses_another(saved, tmp_path):
    """``--iteration N`` of a save directory exports that checkpoint; one that is not committed there,
    or another than an ``iter_*`` directory holds, is one line and nothing is written."""
    ckpt, dumps = saved("one_rank")
    code, doc, err = _export(str(ckpt), str(tmp_path / "st"), "--format", "safetensors", "--iteration", "2")
    assert code == 0 and doc["iteration"] == ITERATION, err
    for where, iteration, says in [
        (ckpt, "1", f"{ckpt / 'iter_0000001'}: no manifest.json: not a committed checkpoint"),
        (ckpt / "iter_0000002", "3", f"{ckpt / 'iter_0000002'} holds iteration 2, not 3"),
    ]:
        out = tmp_path / f"refused-{iteration}"
        code, _, err = _export(str(where), str(out), "--format", "safetensors", "--iteration", iteration)
        assert code != 0 and err.count("\n") == 1 and says in err, err
        assert not out.exists()
