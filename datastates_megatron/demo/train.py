"""Demo trainer: a small megatron-core GPT with Megatron-style flags and ``--lazy-ckpt``.

Run with torchrun (CPU/gloo here; GPUs when present)::

    torchrun --nproc-per-node 2 -m datastates_megatron.demo.train --save runs/demo --train-iters 20 \
        --save-interval 1 --lazy-ckpt --lazy-ckpt-host-cache-gb 0.25

It resumes from the latest committed checkpoint under ``--load`` (default ``--save``) and prints
``resumed from iteration N`` on rank 0.  SIGTERM / SIGUSR1 (Slurm pre-emption) save a final
checkpoint, wait for its commit and exit 0.  ``--log-json`` writes, per rank, every iteration's
loss (exact) and timing, each commit's telemetry, and a digest of the final model/optimizer state.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

from .._output import write_line

__all__ = ["main", "parse_args"]

log = logging.getLogger("datastates_megatron.demo")


def parse_args(argv=None) -> argparse.Namespace:
    from ..megatron.megatron_lm.args import add_lazy_ckpt_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("training (Megatron-style names)")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--load", default=None, help="resume from here (default: --save)")
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--save-interval", type=int, default=1)
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--vocab-size", type=int, default=1024)
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-json", default=None, help="write per-rank records to PATH.rank<R>.json")
    g.add_argument("--exit-after-iteration", type=int, default=None, help="stop (after saving) at this iteration")
    add_lazy_ckpt_args(p)
    args = p.parse_args(argv)
    if args.load is None:
        args.load = args.save
    return args


def one_line(err: BaseException) -> str:
    """``err``'s message on one line (a flag error lists its problems one a line: joined by ``;``)."""
    first, *rest = str(err).splitlines() or [""]
    rest = [ln.strip().removeprefix("- ") for ln in rest if ln.strip()]
    return " ".join([first, "; ".join(rest)]) if rest else first


def main(argv=None) -> int:
    """Train; a refused flag or start-up (a save location another job holds) is one line on stderr
    and exit status 2, never a traceback (``DSM_DEBUG=1`` shows it)."""
    args = parse_args(argv)
    from ..engine.errors import CheckpointError

    try:
        return _train(args)
    except CheckpointError as e:
        if os.environ.get("DSM_DEBUG"):
            raise
        write_line(f"{os.path.basename(sys.argv[0]) or 'train'}: error: {one_line(e)}", sys.stderr)
        return 2


def _train(args) -> int:
    from ..engine.errors import NoCheckpointError
    from ..megatron.cpu.training_record import state_digest
    from ..megatron.megatron_lm.args import validate_lazy_ckpt_args
    from . import gpt

    config = validate_lazy_ckpt_args(args)  # None without --lazy-ckpt
    gpt.init_distributed(seed=args.seed)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING, format=f"[rank {rank}] %(asctime)s %(name)s: %(message)s"
    )
    chunks, optimizer = gpt.build(
        args.num_layers,
        args.hidden_size,
        args.num_attention_heads,
        args.seq_length,
        args.vocab_size,
        bf16=args.bf16,
        seed=args.seed,
        lr=args.lr,
    )
    scheduler = gpt.make_scheduler(optimizer, lr=args.lr, decay_steps=max(args.train_iters, 10))
    ckpt = None
    records: dict = {"rank": rank, "iterations": [], "commits": [], "resumed_from": None}
    if args.lazy_ckpt:
        from ..megatron.checkpointing.checkpointer import LazyCheckpointer

        ckpt = LazyCheckpointer(chunks, optimizer, config, opt_param_scheduler=scheduler, vocab_size=args.vocab_size)
        ckpt.on_commit.append(
            lambda rec, stall: records["commits"].append(
                {
                    "iteration": rec.iteration,
                    "bytes_per_rank": list(rec.bytes_per_rank),
                    "stall_s": stall,
                    "save_call_s": rec.save_call_s,
                    "copy_s": rec.copy_s,
                    "flush_s": rec.flush_s,
                    "commit_s": rec.commit_s,
                    "flush_gbps": rec.flush_gbps,
                    "at": time.time(),  # when this rank heard of it (epoch seconds, as "end")
                }
            )
        )
    start = 0
    if ckpt is not None:
        try:
            start, _extra = ckpt.load()
            records["resumed_from"] = start
            records["restored_from"] = ckpt.restored_from
            if rank == 0:
                write_line(f"resumed from iteration {start}")
        except NoCheckpointError:
            if rank == 0:
                write_line("no checkpoint found: starting from scratch")

    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, on_signal)

    dp = gpt.dp_rank()
    last = start
    for it in range(start + 1, args.train_iters + 1):
        t0 = time.perf_counter()
        data = gpt.batch(
            it,
            dp,
            seed=args.seed,
            micro_batch_size=args.micro_batch_size,
            seq_len=args.seq_length,
            vocab=args.vocab_size,
        )
        loss = gpt.train_step(chunks, optimizer, data, scheduler=scheduler)
        t_step = time.perf_counter() - t0
        save_s = 0.0
        final = bool(stop["signal"]) or it in (args.exit_after_iteration, args.train_iters)
        if ckpt is not None and (it % args.save_interval == 0 or final):
            t1 = time.perf_counter()
            ckpt.save(it, {"loss": loss}, final=final)  # the last one is never skipped
            save_s = time.perf_counter() - t1
        if ckpt is not None:
            ckpt.poll()
        last = it
        records["iterations"].append(
            {
                "iteration": it,
                "loss": loss,
                "step_s": t_step,
                "save_s": save_s,
                "iter_s": time.perf_counter() - t0,
                "end": time.time(),
            }
        )
        if rank == 0 and (it % 5 == 0 or it == args.train_iters):
            write_line(f"iteration {it:6d} | loss {loss:.6f} | {1e3 * (time.perf_counter() - t0):.1f} ms")
        if stop["signal"] or it == args.exit_after_iteration:
            if rank == 0 and stop["signal"]:
                write_line(f"signal {stop['signal']} received: saved iteration {it}, exiting")
            break
    t_drain = time.perf_counter()
    if ckpt is not None:
        ckpt.wait()
    records["drain_s"] = time.perf_counter() - t_drain
    records["last_iteration"] = last
    records["digest"] = state_digest(chunks, optimizer)
    if ckpt is not None:
        records["stats"] = {k: v for k, v in ckpt.stats.items() if k != "last_commit"}
        ckpt.close()
    if args.log_json:
        with open(f"{args.log_json}.rank{rank}.json", "w") as f:
            json.dump(records, f)
    gpt.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
