"""Run Megatron-LM's own ``pretrain_gpt.py`` (a tiny GPT) under torchrun through
``datastates_megatron.megatron.cpu.launch``, and compare runs exactly.

The tree comes from ``MEGATRON_LM_DIR`` (patched with scripts/apply_patches.sh; scripts/test.sh
unpacks and patches a fresh one from ../shared/megatron-lm) unless ``launch`` is given another one
(an unpatched tree runs through the launcher's runtime hook). Without a GPU the ranks use gloo and
the CPU-only flags; with one, NCCL and the same model, so the same test bodies run on both.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from datastates_megatron.engine.tiers.tier import committed_iterations, latest_committed
from datastates_megatron.megatron.cpu import training_record
from tests.distributed.ranks import free_port, run_command

MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
CUDA = torch.cuda.is_available()
RANKS = min(2, torch.cuda.device_count()) if CUDA else 2  # NCCL needs a GPU per rank

CPU_ONLY = [
    "--distributed-backend",
    "gloo",
    "--transformer-impl",
    "local",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
]
TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "512",
    "--use-distributed-optimizer",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--log-params-norm",
    "--seed",
    "1234",
]
LAZY = ["--lazy-ckpt", "--lazy-ckpt-host-cache-gb", "0.05"]
# --inprocess-restart: the wrapper's timeouts scaled to a tiny model on a shared 2-core machine; at most 3 attempts
INPROCESS = [
    "--inprocess-restart",
    "--inprocess-granularity",
    "rank",
    "--inprocess-max-iterations",
    "3",
    "--inprocess-heartbeat-interval",
    "2",
    "--inprocess-heartbeat-timeout",
    "60",  # Megatron-LM's default: a rank's monitor heartbeats while the rank restarts
]  # NVRx requires soft < hard < barrier timeout (Megatron-LM's defaults: 60, 90, 120 s)
# a GPU without Transformer Engine (the device image): megatron-core's own layers, as on CPU
NO_TE = [] if importlib.util.find_spec("transformer_engine") else ["--transformer-impl", "local"]


@dataclass
class Run:
    returncode: int | None
    log: str
    record: str  # training_record prefix
    codes: tuple = ()  # each launcher's exit status

    def iterations(self, rank: int = 0) -> dict[int, dict]:
        return training_record.read(self.record, rank)[0]

    def final(self, rank: int = 0) -> dict | None:
        return training_record.read(self.record, rank)[1]

    def describe(self) -> str:
        return f"rc={self.returncode}\n{self.log[-6000:]}"


def command(
    nproc: int, args: list[str], port: int, megatron_lm_dir: str | None = None, node: tuple[int, int] | None = None
) -> list[str]:
    """``node``: (this node's index, number of nodes) -- one torchrun per "node" on localhost, each
    with its own ``LOCAL_WORLD_SIZE``, as a multi-node job runs."""
    nodes = ["--nnodes", str(node[1]), "--node-rank", str(node[0]), "--master-addr", "127.0.0.1"] if node else []
    launcher = [sys.executable, "-m", "torch.distributed.run", *nodes, "--nproc-per-node", str(nproc)]
    return [*launcher, "--master-port", str(port), *_pretrain_gpt(args, megatron_lm_dir)]


def _pretrain_gpt(args: list[str], megatron_lm_dir: str | None) -> list[str]:
    script = os.path.join(megatron_lm_dir or MEGATRON_LM_DIR, "pretrain_gpt.py")
    return ["-m", "datastates_megatron.megatron.cpu.launch", script, *(NO_TE if CUDA else CPU_ONLY), *TINY, *args]


def rank_command(rank: int, world: int, args: list[str], port: int) -> list[str]:
    """One rank as its own "node", started directly with the variables torchrun gives a worker (as
    ``srun`` starts one task per node): a rank that dies then takes no launcher down with it, and
    leaves no other launcher waiting for it at the end (torchrun's exit barrier, 300 s)."""
    where = {"RANK": rank, "LOCAL_RANK": 0, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": 1, "GROUP_RANK": rank}
    where |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    return ["env", *(f"{k}={v}" for k, v in where.items()), sys.executable, *_pretrain_gpt(args, None)]


def run_env(args: list[str], record: str) -> dict[str, str]:
    """The environment of a launch: one thread per rank and the training record."""
    # Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS=1 at TP or CP > 1 (GPU launch scripts set it)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        CUDA_DEVICE_MAX_CONNECTIONS="1",
        **{training_record.ENV: record},
    )
    return env


def launch(
    tmp: Path,
    name: str,
    args: list[str],
    *,
    nproc: int = RANKS,
    timeout: float = 300.0,
    kill_when=None,
    term_when=None,
    megatron_lm_dir: str | None = None,
    nodes: int = 1,
) -> Run:
    """Run ``pretrain_gpt.py`` (of ``megatron_lm_dir``, default MEGATRON_LM_DIR) with ``args`` to the end, or until ``kill_when()`` (then every rank and
    torchrun get SIGKILL) or ``term_when()`` (then every rank gets SIGTERM, as ``srun`` delivers a
    pre-emption, and the run is left to finish). Both are polled every 50 ms. ``nodes`` > 1: that
    many torchruns of ``nproc`` ranks each, one per "node" (the return code is the first non-zero one)."""
    port = free_port()
    cmds = [command(nproc, args, port, megatron_lm_dir, (k, nodes) if nodes > 1 else None) for k in range(nodes)]
    return _run(tmp, name, args, cmds, timeout=timeout, kill_when=kill_when, term_when=term_when)


def launch_ranks(tmp: Path, name: str, args: list[str], *, world: int, timeout: float = 300.0) -> Run:
    """``pretrain_gpt.py`` on ``world`` ranks, each its own node (:func:`rank_command`); the Run's
    ``codes`` are the ranks' exit statuses."""
    port = free_port()
    return _run(tmp, name, args, [rank_command(r, world, args, port) for r in range(world)], timeout=timeout)


def _run(tmp: Path, name: str, args: list[str], cmds, **how) -> Run:
    record = str(tmp / f"{name}-record")  # see logged()
    log_path = tmp / f"{name}.log"
    with open(log_path, "w") as log:
        done = run_command(cmds, env=run_env(args, record), log=log, **how)
    return Run(done.returncode, log_path.read_text(errors="replace"), record, done.codes)


def committed_at_least(save: Path, iteration: int):
    """A ``kill_when``: true once a checkpoint of ``iteration`` or later is committed under ``save``."""

    def check() -> bool:
        return save.is_dir() and any(it >= iteration for it in committed_iterations(str(save)))

    return check


def logged(tmp: Path, name: str, iteration: int):
    """A ``term_when`` for ``launch(tmp, name, ...)``: true once rank 0 has logged ``iteration``."""

    def check() -> bool:
        return iteration in training_record.read(str(tmp / f"{name}-record"), 0)[0]

    return check


def latest(save: Path) -> int | None:
    return latest_committed(str(save)) if committed_iterations(str(save)) else None


def assert_same_training(got: Run, want: Run, iterations, *, ranks: int = RANKS, exact: bool = True) -> None:
    """``got`` logged ``iterations`` with the grad norm and params norm of ``want`` (to the bit, or to
    1e-5 relative when ``exact`` is False), and ended with the same state digest when both ended.
    ``iterations=None`` (a killed run): each rank logged 1..N for its own N (a kill lands on the
    ranks at slightly different iterations)."""
    import pytest

    for rank in range(ranks):
        g, w = got.iterations(rank), want.iterations(rank)
        mine = range(1, max(g, default=0) + 1) if iterations is None else iterations
        assert g and sorted(g) == list(mine), (rank, sorted(g), got.describe())
        for it in mine:
            for key in ("grad_norm", "params_norm"):
                if exact:
                    assert g[it][key] == w[it][key], (rank, it, key, g[it][key], w[it][key])
                else:
                    assert g[it][key] == pytest.approx(w[it][key], rel=1e-5), (rank, it, key)
        if exact and got.final(rank) is not None:
            assert got.final(rank)["digest"] == want.final(rank)["digest"], rank
