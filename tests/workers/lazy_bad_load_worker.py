"""Worker for test_lazy_bad_load: a LazyCheckpointer over the demo GPT (2 gloo ranks) tries to load
damaged checkpoints; after each failed ``load()`` the live model/optimizer must be unchanged.

Iterations 1 and 2 are committed, one more step is trained (so the live state differs from both),
then rank 0 damages iteration 2 one way at a time (restoring a pristine copy in between) and every
rank calls ``load()``.  Damage that hits every rank's file comes first, then the pristine checkpoint
is loaded, then damage to rank 1's file only (a rank whose own file is fine must not restore while
another rank fails), then rank 1 alone cannot open its file (EACCES): every rank must raise the same
error.
Prints ``RESULT {"rank", "scenarios": {name: {"error", "unchanged"}}, "final": ...}``."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys

import torch.distributed as dist


from datastates_megatron._output import write_line  # noqa: E402
from datastates_megatron.engine.format.file_format import RankFile  # noqa: E402
from datastates_megatron.engine.format.manifest import read_manifest  # noqa: E402
from datastates_megatron.engine.names import MANIFEST_NAME, iter_dir  # noqa: E402
from tests.faults.damage import edit_manifest, flip  # noqa: E402


def _biggest(path: str):
    with RankFile(path) as rf:
        return max(rf.entries.values(), key=lambda e: e.nbytes), rf.header


def damage(root: str, name: str) -> None:
    """Damage iteration 2 of ``root`` as scenario ``name`` says (called on rank 0 only)."""
    d, d1 = iter_dir(root, 2), iter_dir(root, 1)
    m, m1 = read_manifest(d), read_manifest(d1)
    files = [os.path.join(d, r.file) for r in m.ranks]
    only_rank1 = name.endswith("_rank1")
    targets = files[1:] if only_rank1 else files
    if name.startswith("data_flip"):
        for f in targets:
            e, _ = _biggest(f)
            flip(f, e.offset + e.nbytes // 2, 5)
    elif name == "index_flip":
        for f in targets:
            _, h = _biggest(f)
            flip(f, h.index_offset + 11, 2)
    elif name == "header_flip":
        for f in targets:
            flip(f, 30, 4)
    elif name.startswith("truncated"):
        for f in targets:
            os.truncate(f, os.path.getsize(f) - 4096)
    elif name.startswith("missing"):
        for f in targets:
            os.unlink(f)
    elif name == "other_iteration":
        for r, f in zip(m1.ranks, targets):
            shutil.copyfile(os.path.join(d1, r.file), f)
    elif name == "manifest_not_json":
        flip(os.path.join(d, MANIFEST_NAME), 0, 2)
    elif name == "manifest_version":
        edit_manifest(d, lambda b: b.update(format_version=99), reseal=False)
    elif name == "manifest_path_outside":
        edit_manifest(d, lambda b: [r.update(file=f"../iter_0000001/{r['file']}") for r in b["ranks"]])
    elif name == "manifest_layout":
        edit_manifest(d, lambda b: b["layout"].update(tp=2))
    elif name == UNREADABLE:
        pass  # nothing on disk: rank 1 cannot open its file (unreadable_rank_files)
    else:
        raise ValueError(name)


SCENARIOS = [
    "data_flip",
    "index_flip",
    "header_flip",
    "truncated",
    "missing",
    "other_iteration",
    "manifest_not_json",
    "manifest_version",
    "manifest_path_outside",
    "manifest_layout",
]
# after the others: only rank 1's file is bad.  A rank that restores while another fails leaves the
# ranks in different collectives, so nothing can follow it.
LAST = "data_flip_rank1"
UNREADABLE = "eacces_rank1"


def unreadable_rank_files():
    """From now on opening a rank file fails with EACCES in this process (what ``chmod 000`` does to
    a user other than root); returns the undo."""
    from datastates_megatron.engine.format import file_format

    real = file_format.open_regular

    def open_regular(path, *args, **kwargs):
        if str(path).endswith(".dsck"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real(path, *args, **kwargs)

    file_format.open_regular = open_regular
    return lambda: setattr(file_format, "open_regular", real)


def main() -> int:
    from datastates_megatron import LazyCheckpointer, LazyCkptConfig
    from datastates_megatron.demo import gpt
    from datastates_megatron.megatron.cpu.training_record import state_digest

    root = sys.argv[1]
    scenarios = sys.argv[2].split(",") if len(sys.argv) > 2 else SCENARIOS
    gpt.init_distributed(seed=11, timeout_s=20)
    rank = dist.get_rank()
    chunks, opt = gpt.build(2, 64, 4, 32, 256, bf16=False, seed=11)
    data = lambda it: gpt.batch(it, gpt.dp_rank(), seed=11, seq_len=32, vocab=256)  # noqa: E731
    ckpt = LazyCheckpointer(chunks, opt, LazyCkptConfig(save_dir=root, host_cache_gb=1 / 1024, keep_last=0))
    digests = {}
    for it in (1, 2):
        gpt.train_step(chunks, opt, data(it))
        ckpt.save(it)
        digests[it] = state_digest(chunks, opt)
    ckpt.wait()
    gpt.train_step(chunks, opt, data(3))
    live = state_digest(chunks, opt)
    assert live != digests[2]
    pristine = os.path.join(root, "pristine-2")
    if rank == 0:
        shutil.copytree(iter_dir(root, 2), pristine)
    dist.barrier()
    out = {"rank": rank, "scenarios": {}}

    def attempt(name: str, live: dict) -> bool:
        if rank == 0:
            damage(root, name)
        dist.barrier()
        try:
            ckpt.load()
            error = None
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
        out["scenarios"][name] = {"error": error, "unchanged": state_digest(chunks, opt) == live}
        write_line(f"SCENARIO {name} rank {rank}: {error}")
        write_line("RESULT " + json.dumps(out))  # the last RESULT line is the one read
        return error is not None

    for name in scenarios:
        if not attempt(name, live):
            break  # a damaged checkpoint was accepted: the ranks may be out of step
        dist.barrier()
        if rank == 0:
            shutil.rmtree(iter_dir(root, 2))
            shutil.copytree(pristine, iter_dir(root, 2))
        dist.barrier()
    else:
        it, _ = ckpt.load()  # the pristine checkpoint still loads, exactly
        out["final"] = {"iteration": it, "exact": state_digest(chunks, opt) == digests[2]}
        gpt.train_step(chunks, opt, data(3))
        if attempt(LAST, state_digest(chunks, opt)):
            undo = unreadable_rank_files() if rank == 1 else (lambda: None)
            try:
                attempt(UNREADABLE, state_digest(chunks, opt))
            finally:
                undo()
    write_line("RESULT " + json.dumps(out))
    ckpt.close()
    gpt.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
