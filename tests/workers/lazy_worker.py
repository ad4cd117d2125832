"""Worker for test_lazy_checkpointer: one LazyCheckpointer over the demo GPT, one scenario per run."""

import argparse
import json
import sys
import time

import torch

from datastates_megatron._output import write_line


def _count_manifest_reads() -> list:
    """Every read_manifest call from now on, in whichever package module imported it."""
    from datastates_megatron.engine.format import manifest

    original, calls = manifest.read_manifest, []

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("datastates_megatron") and (
            getattr(module, "read_manifest", None) is original
        ):
            module.read_manifest = counted
    return calls


def _count_restore_decisions() -> dict:
    """Calls into the manager's restore decision from now on: ``choose`` (the decision), the resolve
    round it runs (one per decision), rank 0's ``_decide`` and the local survey ``_restorable``;
    and the process-group collectives ``choose`` makes."""
    from datastates_megatron.engine import manager
    from datastates_megatron.engine.load import restorer

    calls = dict.fromkeys(("choose", "resolve", "_decide", "_restorable", "load"), 0)

    def counted(name, original):
        def call(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        return call

    for name in ("choose", "load"):
        setattr(manager.CheckpointManager, name, counted(name, getattr(manager.CheckpointManager, name)))
    for name in ("_decide", "_restorable"):
        setattr(restorer.Restorer, name, counted(name, getattr(restorer.Restorer, name)))
    restorer.resolve = counted("resolve", restorer.resolve)
    # process-group collectives while deciding (the decision's round goes through the store)
    calls["choose_collectives"] = 0
    inside = [False]
    for name in ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor", "barrier"):
        original = getattr(torch.distributed, name)

        def collective(*args, _original=original, **kwargs):
            calls["choose_collectives"] += inside[0]
            return _original(*args, **kwargs)

        setattr(torch.distributed, name, collective)
    choose = manager.CheckpointManager.choose

    def deciding(*args, **kwargs):
        inside[0] = True
        try:
            return choose(*args, **kwargs)
        finally:
            inside[0] = False

    manager.CheckpointManager.choose = deciding
    return calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["slow_copy", "replicated", "local_tier", "held_state"])
    p.add_argument("--save", required=True)
    p.add_argument("--local", default=None, help="local_tier: the node-local tier")
    p.add_argument("--no-hooks", action="store_true", help="control: remove the gate to show the test can fail")
    p.add_argument(
        "--source-writes",
        action="store_true",
        help="slow_copy: shards written straight from their memory; the writes are the slow part",
    )
    p.add_argument(
        "--master-weight-adam",
        action="store_true",
        help="the inner optimizer keeps a float64 master_param and an int step (held_state.MasterWeightAdam)",
    )
    p.add_argument(
        "--phase",
        choices=["straight", "save", "resume"],
        help="held_state: train 1..6 / train 1..3 and save 3 / load 3 and train 4..6",
    )
    a = p.parse_args()
    from datastates_megatron import LazyCheckpointer, LazyCkptConfig
    from datastates_megatron.demo import gpt
    from datastates_megatron.megatron.cpu.training_record import state_digest
    from datastates_megatron.engine import CorruptCheckpointError, load_file
    from datastates_megatron.engine.save import device_copy
    from datastates_megatron.engine.format import writer
    from datastates_megatron.engine.save.device_copy import as_bytes
    from datastates_megatron.engine.format.hashing import xxh64
    from datastates_megatron.engine.format.manifest import read_manifest
    from datastates_megatron.engine.names import iter_dir
    import os

    gpt.init_distributed(seed=7)
    rank = torch.distributed.get_rank()
    hidden = 128 if a.source_writes else 64  # a param shard above small_bytes: written from its memory
    chunks, opt = gpt.build(2, hidden, 4, 32, 256, bf16=a.scenario == "slow_copy", seed=7)
    data = lambda it: gpt.batch(it, gpt.dp_rank(), seed=7, seq_len=32, vocab=256)  # noqa: E731
    probe = None
    if a.scenario == "held_state":
        from tests.workers.held_state import attach_probe

        probe = attach_probe(chunks)
    if a.master_weight_adam:
        from tests.workers.held_state import use_master_weight_adam

        use_master_weight_adam(opt)
    tier = {"local_dir": a.local, "persist_interval": 3} if a.local else {}
    tier["when_behind"] = "wait"  # the scenarios save back to back and check each save (skips: test_skip_when_behind)
    if a.source_writes:
        tier["source_writes"] = True
    reads = _count_manifest_reads()  # from start-up on
    ckpt = LazyCheckpointer(chunks, opt, LazyCkptConfig(save_dir=a.save, host_cache_gb=1 / 1024, keep_last=0, **tier))
    result = {"rank": rank}
    if a.scenario == "held_state":
        first = 1
        if a.phase == "resume":
            decisions = _count_restore_decisions()
            first = ckpt.load()[0] + 1
            result["manifest_reads"] = len(reads)
            result["decisions"] = decisions
        for it in range(first, 7 if a.phase != "save" else 4):
            gpt.train_step(chunks, opt, data(it))
        if a.phase == "save":
            ckpt.save(3)
            ckpt.wait()
        inner = opt.chained_optimizers[0].optimizer if hasattr(opt, "chained_optimizers") else opt.optimizer
        result.update(
            digest=state_digest(chunks, opt),
            probe=probe.report(),
            state_keys=sorted({k for st in inner.state.values() for k in st}),
            plain_step=sorted({st["step"] for st in inner.state.values() if isinstance(st.get("step"), int)}),
        )
        ckpt.close()
        write_line("RESULT " + json.dumps(result))
        gpt.destroy_distributed()
        return
    gpt.train_step(chunks, opt, data(1))
    if a.scenario == "local_tier":  # iterations 1-4 saved locally, 3 promoted; load() in the same run
        ckpt.save(1)
        for it in range(2, 5):
            gpt.train_step(chunks, opt, data(it))
            ckpt.save(it)
        at_4 = state_digest(chunks, opt)
        ckpt.wait()
        gpt.train_step(chunks, opt, data(5))
        decisions = _count_restore_decisions()
        result["loaded"], _ = ckpt.load()
        result["decisions"] = decisions
        result["exact"] = state_digest(chunks, opt) == at_4
    elif a.scenario == "slow_copy":
        if a.source_writes:
            real_write = writer.RankFileWriter.write

            def slow_write(self, data, offset):
                time.sleep(0.06)  # a slow write straight from a shard: the step must wait for it
                return real_write(self, data, offset)

            writer.RankFileWriter.write = slow_write
        else:
            real = device_copy.DeviceCopier.copy

            def slow(self, src, dst, ready):
                time.sleep(0.02)  # a slow device->host copy: the step must wait for it
                return real(self, src, dst, ready)

            device_copy.DeviceCopier.copy = slow
        if a.no_hooks:
            ckpt._remove_hooks()
            ckpt._refresh = lambda: None
        at_save = {k: v for k, v in state_digest(chunks, opt).items() if not k.startswith("model_state.")}
        t0 = time.perf_counter()
        ckpt.save(1)
        result["save_call_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        gpt.train_step(chunks, opt, data(2))  # mutates every registered tensor in optimizer.step()
        result["step_s"] = time.perf_counter() - t0
        ckpt.wait()
        m = read_manifest(iter_dir(a.save, 1))
        try:
            tensors, _ = load_file(os.path.join(iter_dir(a.save, 1), m.ranks[rank].file))
        except CorruptCheckpointError:  # control only: a shard changed between its hash and its write
            tensors = {}
        saved = {n: xxh64(as_bytes(t).numpy()) for n, t in tensors.items()}
        result["equal_to_save_time"] = saved == at_save
        result["n_tensors"] = len(saved)
        result["source_bytes"] = ckpt._mgr.engine.source_bytes
    else:
        ckpt.save(1)
        ckpt.wait()
        m = read_manifest(iter_dir(a.save, 1))
        tensors, _ = load_file(os.path.join(iter_dir(a.save, 1), m.ranks[rank].file))
        result["param_shard_bytes"] = sum(
            t.numel() * t.element_size() for n, t in tensors.items() if ".param_shard" in n
        )
        result["param_buffer_bytes"] = sum(
            b.param_data.numel() * b.param_data.element_size() for c in chunks for b in c.buffers
        )
    ckpt.close()
    write_line("RESULT " + json.dumps(result))
    gpt.destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
