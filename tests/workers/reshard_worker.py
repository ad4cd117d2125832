"""Worker for test_reshard (and tests/integration/bench_reshard.py): the demo GPT on CPU gloo ranks, one scenario per run.

The global batch is fixed (``GLOBAL_ROWS`` sequences per iteration, split evenly over the DP ranks),
so training is the same computation at any DP size up to the order of reductions.

Scenarios (each prints ``RESULT <json>`` on every rank):

* ``run``: optionally ``load()`` iteration ``--load-at`` from ``--load`` into a *differently
  initialised* model (other seed; the bucket layout is whatever ``--bucket-size`` says) — resharding
  when the DP size differs — and compare every element with the reference in ``--ref-in``; train to
  ``--total``, optionally checkpointing iteration ``--save-at`` under ``--save`` and dumping, right
  after it, a reference of every full parameter and of this rank's main params / Adam states (taken
  with megatron-core's own accessors, not our metadata) to ``--ref-out``.  Reports every loss.
* ``tp2``: the same model with tensor-parallel size 2 (``load()`` reshards it through megatron-core's
  global coordinates, or refuses: another model, or a checkpoint without them).

``--old-identity`` saves as a datastates-megatron before identity 3 did: no global coordinates.

With ``--warm N`` the model first trains N iterations (so the optimizer holds state).  When
``load()`` raises, the result has the error and a digest of every live tensor (parameters, buffers,
param buffers, main params, optimizer state, scheduler) taken before and after it.
"""

import argparse
import glob
import json
import os
import sys
import time

import torch

from datastates_megatron._output import write_line

GLOBAL_ROWS = 4
MODEL = dict(num_layers=2, hidden=64, heads=4, seq_len=32, vocab=256)


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["run", "tp2"])
    p.add_argument("--load", default=None)
    p.add_argument("--load-at", type=int, default=None)
    p.add_argument("--ref-in", default=None)
    p.add_argument("--save", default=None)
    p.add_argument("--save-at", type=int, default=None)
    p.add_argument("--ref-out", default=None)
    p.add_argument("--total", type=int, default=6)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--bucket-size", type=int, default=None, help="small buckets (overlap_grad_reduce on)")
    p.add_argument("--layers", type=int, default=MODEL["num_layers"])
    p.add_argument("--hidden", type=int, default=MODEL["hidden"])
    p.add_argument("--vocab", type=int, default=MODEL["vocab"], help="the vocabulary (the demo GPT does not pad it)")
    p.add_argument("--allow-vocab-change", action="store_true")
    p.add_argument(
        "--declared-vocab",
        type=int,
        default=None,
        help="the vocabulary the run declares (default --vocab): fewer "
        "rows than --vocab stand for megatron-core's vocabulary padding",
    )
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--swiglu", action="store_true", help="the MLP's gated linear unit (Megatron-LM's --swiglu)")
    p.add_argument("--warm", type=int, default=0, help="iterations trained before the load")
    p.add_argument("--model-only", action="store_true", help="load(optimizer=False, rng=False)")
    p.add_argument("--local", default=None, help="the node-local tier (needed with an s3:// --save)")
    p.add_argument("--old-identity", action="store_true", help="save identity 2 (no global coordinates)")
    p.add_argument(
        "--extra-state",
        choices=["empty", "fp8"],
        default=None,
        help="a module with a get_extra_state as Transformer Engine's layers have, without FP8 (an empty "
        "tensor) or with FP8 metadata (bytes)",
    )
    return p.parse_args()


def _build(a, seed):
    from datastates_megatron.demo import gpt

    return gpt.build(
        a.layers,
        a.hidden,
        MODEL["heads"],
        MODEL["seq_len"],
        a.vocab,
        bf16=a.bf16,
        seed=seed,
        overlap_grad_reduce=a.bucket_size is not None,
        bucket_size=a.bucket_size,
        swiglu=a.swiglu,
    )


class ExtraStateProbe(torch.nn.Module):
    """A module's ``_extra_state`` as Transformer Engine writes it: an empty uint8 tensor for a layer
    without FP8, else its scaling metadata pickled into a uint8 tensor (here fixed bytes)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8) if self.kind == "empty" else torch.arange(16, dtype=torch.uint8)

    def set_extra_state(self, state):
        pass


def _data(it, vocab=MODEL["vocab"]):
    """Iteration ``it``'s batch, this rank's rows of it (tokens below ``vocab`` and the usual 256)."""
    from datastates_megatron.demo import gpt

    rows = GLOBAL_ROWS // gpt.dp_size()
    full = gpt.batch(
        it, 0, seed=11, micro_batch_size=GLOBAL_ROWS, seq_len=MODEL["seq_len"], vocab=min(vocab, MODEL["vocab"])
    )
    r = gpt.dp_rank()
    return {k: (v[r * rows : (r + 1) * rows] if isinstance(v, torch.Tensor) else v) for k, v in full.items()}


def _embedding_rows(chunks, opt, optimizer: bool = True) -> dict:
    """The word embedding's rows that are all zero, by global row (this tensor-parallel rank's), in
    the parameter and (``optimizer``: its state was loaded) in Adam's ``exp_avg``: ``{"rows": n,
    "zero": [...], "zero_exp_avg": [...]}``."""
    from megatron.core import parallel_state

    p = next(p for p, n in _names(chunks).items() if n == "embedding.word_embeddings.weight")
    first = parallel_state.get_tensor_model_parallel_rank() * p.shape[0]
    zero = (p == 0).all(1).nonzero().view(-1)
    if not optimizer:
        return {"rows": p.shape[0], "zero": (first + zero).tolist()}
    start, end, states = _optimizer_view(chunks, opt)["embedding.word_embeddings.weight"]
    exp_avg = torch.full((p.numel(),), float("nan"))  # elements of other data-parallel ranks: not zero
    exp_avg[start:end] = states["exp_avg"].view(-1)
    zero_exp_avg = (exp_avg.view(p.shape) == 0).all(1).nonzero().view(-1)
    return {"rows": p.shape[0], "zero": (first + zero).tolist(), "zero_exp_avg": (first + zero_exp_avg).tolist()}


def _names(chunks):
    from datastates_megatron.megatron.checkpointing.shards import parameter_names

    return {p: name for p, (_c, name) in parameter_names(chunks).items()}


def _optimizer_view(chunks, opt):
    """``{name: (start, end, {main, exp_avg, exp_avg_sq, step})}`` via megatron-core's accessors."""
    names = _names(chunks)
    out = {}
    for do in opt.chained_optimizers:
        for g in range(len(do.model_fp32_groups)):
            for mp in [*do.model_fp32_groups[g], *do.model_float16_groups[g]]:
                r = do._get_model_param_range_map(mp)["param"]
                t = do._get_main_param_and_optimizer_states(mp)
                states = {"main": t["param"], "exp_avg": t["exp_avg"], "exp_avg_sq": t["exp_avg_sq"], "step": t["step"]}
                out[names[mp]] = (int(r.start), int(r.end), {k: v.detach().clone() for k, v in states.items()})
    return out


def _stale_main_params(opt) -> int:
    """How many fp32 main-param shards of bf16/fp16 parameters differ from their (restored) parameter."""
    stale = 0
    for do in opt.chained_optimizers:
        for models, mains in zip(do.model_float16_groups, do.shard_fp32_from_float16_groups):
            for mp, main in zip(models, mains):
                r = do._get_model_param_range_map(mp)["param"]
                stale += not torch.equal(main.view(-1), mp.detach().view(-1)[r.start : r.end].float())
    return stale


def _dump_reference(path, chunks, opt):
    """Every parameter this rank holds (TP-local), with the axis it is split on across TP ranks
    (``tp_dims``: megatron-core's ``partition_dim``, None when every TP rank holds it whole), this
    rank's TP rank, and its main params / Adam states."""
    from megatron.core import parallel_state

    named = _names(chunks)
    params = {name: p.detach().clone() for p, name in named.items()}
    tp_dims = {
        name: p.partition_dim if getattr(p, "tensor_model_parallel", False) else None for p, name in named.items()
    }
    torch.save(
        {
            "params": params,
            "states": _optimizer_view(chunks, opt),
            "tp_dims": tp_dims,
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
        },
        path,
    )


def _full_reference(ref_dir):
    """Full parameters and full flattened optimizer states assembled from every old rank's dump."""
    params, states, steps = None, {}, {}
    for f in sorted(glob.glob(os.path.join(ref_dir, "rank*.pt"))):
        d = torch.load(f, weights_only=True)
        params = params or d["params"]
        for name, (start, end, st) in d["states"].items():
            numel = params[name].numel()
            for key, v in st.items():
                if key == "step":
                    steps.setdefault(name, set()).add(float(v))
                    continue
                full = states.setdefault((name, key), torch.full((numel,), float("nan"), dtype=v.dtype))
                full[start:end] = v.view(-1)
    return params, states, steps


def compare_with_reference(chunks, opt, ref_dir) -> list[str]:
    """Every element of this rank's parameters and optimizer shards against the reference; [] when equal."""
    params, states, steps = _full_reference(ref_dir)
    bad = []
    for p, name in _names(chunks).items():
        if not torch.equal(p.detach(), params[name]):
            bad.append(f"param {name}")
    for name, (start, end, st) in _optimizer_view(chunks, opt).items():
        for key, v in st.items():
            if key == "step":
                if steps[name] != {float(v)}:
                    bad.append(f"step {name}: {float(v)} vs {steps[name]}")
            elif not torch.equal(v.view(-1), states[(name, key)][start:end]):
                bad.append(f"{key} {name}[{start}:{end}]")
    return bad


def live_digest(chunks, opt, sched) -> str:
    """SHA-256 over every live tensor of the model and optimizer (and the scheduler's state)."""
    import hashlib

    from datastates_megatron.megatron.checkpointing.shards import inner_optimizers, param_buffers

    h = hashlib.sha256()

    def add(label, t):
        h.update(label.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())

    for c, chunk in enumerate(chunks):
        for name, t in [*chunk.named_parameters(), *chunk.named_buffers()]:
            add(f"{c}.{name}", t)
    for c, bname, buf in param_buffers(chunks):
        add(f"{c}.{bname}", buf.param_data)
    for i, inner in enumerate(inner_optimizers(opt)):
        for g, pg in enumerate(inner.param_groups):
            h.update(repr(sorted((k, v) for k, v in pg.items() if k != "params")).encode())
            for j, p in enumerate(pg["params"]):
                add(f"opt{i}.g{g}.p{j}", p)
                for k, v in sorted(inner.state.get(p, {}).items()):
                    if isinstance(v, torch.Tensor):
                        add(f"opt{i}.g{g}.p{j}.{k}", v)
                    else:
                        h.update(repr(v).encode())
    h.update(repr(sorted(sched.state_dict().items())).encode())
    return h.hexdigest()


def main():
    a = _args()
    from datastates_megatron import LazyCheckpointer, LazyCkptConfig

    if a.old_identity:  # what a writer before identity 3 recorded
        from datastates_megatron.megatron.checkpointing import shards

        shards.IDENTITY_VERSION = 2
        shards.global_blocks = lambda model: {}
    from datastates_megatron.demo import gpt

    if a.scenario == "tp2":
        from datastates_megatron.megatron.cpu import cuda_on_cpu
        from megatron.core import parallel_state

        cuda_on_cpu.install()
        torch.distributed.init_process_group("gloo", init_method="env://")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    gpt.init_distributed(seed=a.seed)
    rank = torch.distributed.get_rank()
    result = {"rank": rank, "dp": gpt.dp_size()}
    chunks, opt = _build(a, a.seed if a.load is None else a.seed + 1)
    if a.extra_state:
        chunks[0].module.add_module("extra_probe", ExtraStateProbe(a.extra_state))
    sched = gpt.make_scheduler(opt, lr=1e-3, warmup_steps=2, decay_steps=100)
    save_dir = a.save or f"{os.path.normpath(a.load)}-scratch-dp{gpt.dp_size()}"
    tier = {"local_dir": a.local, "persist_interval": 1} if a.local else {}
    cfg = LazyCkptConfig(
        save_dir=save_dir,
        load_dir=a.load,
        host_cache_gb=0.05,
        keep_last=0,
        verify_on_load=not a.no_verify,
        allow_vocab_change=a.allow_vocab_change,
        **tier,
    )
    losses = {}
    with LazyCheckpointer(chunks, opt, cfg, opt_param_scheduler=sched, vocab_size=a.declared_vocab or a.vocab) as ckpt:
        start = 0
        for it in range(1, a.warm + 1):
            gpt.train_step(chunks, opt, _data(it, a.vocab), scheduler=sched)
        if a.load is not None:
            timing = result["restore"] = {}
            ckpt._mgr.load = _timed(ckpt._mgr.load, timing)
            torch.distributed.barrier()
            before = live_digest(chunks, opt, sched)
            t0 = time.perf_counter()
            try:
                if a.model_only:
                    start, _ = ckpt.load(a.load_at, optimizer=False, rng=False)
                else:
                    start, _ = ckpt.load(a.load_at)
            except Exception as e:  # noqa: BLE001 - reported to the test
                result["error"] = f"{type(e).__name__}: {e}"
                result["digest_before"], result["digest_after"] = before, live_digest(chunks, opt, sched)
                write_line("RESULT " + json.dumps(result))
                gpt.destroy_distributed()
                return
            result["load_s"] = time.perf_counter() - t0
            torch.distributed.barrier()
            result["load_all_s"] = time.perf_counter() - t0
            result["embedding_rows"] = _embedding_rows(chunks, opt, not a.model_only)
            if a.ref_in and a.model_only:
                params, _, _ = _full_reference(a.ref_in)
                result["mismatches"] = [
                    f"param {n}" for p, n in _names(chunks).items() if not torch.equal(p, params[n])
                ]
                result["optimizer_states"] = sum(len(o.optimizer.state) for o in opt.chained_optimizers)
                result["stale_main_params"] = _stale_main_params(opt)
                result["scheduler_steps"] = sched.num_steps
            elif a.ref_in:
                result["mismatches"] = compare_with_reference(chunks, opt, a.ref_in)[:20]
        for it in range(start + 1, a.total + 1):
            losses[it] = gpt.train_step(chunks, opt, _data(it, a.vocab), scheduler=sched)
            if it == a.save_at:
                ckpt.save(it)
                ckpt.wait()
                if a.ref_out:
                    os.makedirs(a.ref_out, exist_ok=True)
                    _dump_reference(os.path.join(a.ref_out, f"rank{rank}.pt"), chunks, opt)
    result["losses"] = losses
    write_line("RESULT " + json.dumps(result))
    gpt.destroy_distributed()


def _timed(fn, out: dict):
    """Wrap the manager's load to record its time and read statistics by plan kind (for the benchmark)."""

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        res = fn(*args, **kwargs)
        out[res.plan_kind] = {
            "s": time.perf_counter() - t0,
            "bytes": res.stats.bytes,
            "verify_s": res.stats.verify_s,
            "copy_s": res.stats.copy_s,
            "files_opened": res.stats.files_opened,
            "fetched_bytes": res.stats.fetched_bytes,
        }
        return res

    return wrapper


if __name__ == "__main__":
    sys.exit(main())
