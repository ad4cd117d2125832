"""Hostile and broken storage, as a catalogue the fault sweep runs (``--only hostile``): each attack
plants something in a fresh save directory, then runs what a user or the trainer would (``ls``,
``verify``, a load, a start-up with retention, a save) in a forked child with a time limit, and
reports what happened, the child's peak memory growth, and whether any byte outside the save
directory changed.  The per-attack assertions live in test_hostile_storage.py,
test_hostile_files.py and test_bad_input.py; this is the same set, measured side by side."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import resource
import shutil
import signal
import time

import torch

from datastates_megatron.cli import main as cli
from datastates_megatron.engine import CheckpointError, EngineOptions
from datastates_megatron.engine.format.hashing import xxh64
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.format.manifest import read_manifest
from datastates_megatron.engine.names import MANIFEST_NAME, TRACKER_NAME, iter_dir, rank_file_name
from datastates_megatron.engine.names import RECYCLE_DIR
from tests.faults.damage import edit_manifest, rebuild_rank_file, reseal_index_record
from tests.workers.fault_worker import fill, make_state

MiB = 1 << 20
BIG = 5_000  # elements of the big tensor: a tiny state, so memory growth is the attack's


def _manager(root: str, **policy) -> CheckpointManager:
    policy.setdefault("keep_last", 0)
    return CheckpointManager(root, EngineOptions(cache_bytes=256 << 10, timeout_s=30), **policy)


def commit(root: str, iterations=(1, 2), big: int = BIG, **policy) -> None:
    """A save directory with ``iterations`` committed (one rank)."""
    ts = make_state(0, big)
    with _manager(root, **policy) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        for it in iterations:
            fill(ts, 0, it)
            mgr.save(it, {"iteration": it})
            mgr.wait()


def _rank_file(root: str, it: int) -> str:
    return os.path.join(iter_dir(root, it), read_manifest(iter_dir(root, it)).ranks[0].file)


# ------------------------------------------------------------------------------------------ victims
def _cli(*argv) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli([str(a) for a in argv])  # an escaping exception is reported as a traceback
    why = err.getvalue().strip() or next((x.strip() for x in out.getvalue().splitlines() if "ERROR" in x), "")
    return f"rc {code}" + (f": {why[:120]}" if code else "")


def op_ls(root: str) -> str:
    return _cli("ls", root)


def op_verify(root: str, it: int = 2) -> str:
    return _cli("verify", iter_dir(root, it))


def op_load(root: str, it: int | None = None) -> str:
    """Load into a live state; a refused load must leave every live tensor as it was."""
    ts = make_state(0, BIG)
    for t in ts.values():
        t.fill_(7)
    with _manager(root) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        try:
            got = mgr.load(it)
        except CheckpointError as e:
            if not all(bool((t == 7).all()) for t in ts.values()):
                return "PARTIAL RESTORE: " + str(e)[:100]
            return f"refused: {type(e).__name__}: {str(e)[:100]}"
    return f"loaded iteration {got.iteration}"


def op_inspect(root: str, it: int = 2) -> str:
    return _cli("inspect", iter_dir(root, it))


def op_load_chunked(root: str) -> str:
    """A verifying load of iteration 3 (the state :func:`_chunk_bytes_1` commits) into a live state."""
    ts = make_state(0, CHUNKED_BIG)
    for t in ts.values():
        t.fill_(7)
    with _manager(root, verify_on_load=True) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        try:
            got = mgr.load(3)
        except CheckpointError as e:
            if not all(bool((t == 7).all()) for t in ts.values()):
                return "PARTIAL RESTORE: " + str(e)[:100]
            return f"refused: {type(e).__name__}: {str(e)[:100]}"
    return f"loaded iteration {got.iteration}"


def op_start_and_save_many(root: str) -> str:
    """A trainer starting on the directory and committing four times (retention surveys the
    directory at every commit)."""
    ts = make_state(0, BIG)
    try:
        with _manager(root, keep_last=2) as mgr:
            for n, t in ts.items():
                mgr.register(n, t)
            for it in (3, 4, 5, 6):
                fill(ts, 0, it)
                mgr.save(it, {"iteration": it})
                mgr.wait()
    except CheckpointError as e:
        return f"refused: {type(e).__name__}: {str(e)[:100]}"
    return "saved iterations 3-6"


def op_start_and_save_recycling(root: str) -> str:
    """A trainer recycling rank files (``recycle_files="all"``, ``keep_last=1``) over four commits:
    every retired file is taken again by a later save."""
    ts = make_state(0, BIG)
    try:
        with _manager(root, keep_last=1, recycle_files="all") as mgr:
            for n, t in ts.items():
                mgr.register(n, t)
            for it in (3, 4, 5, 6):
                fill(ts, 0, it)
                mgr.save(it, {"iteration": it})
                mgr.wait()
    except CheckpointError as e:
        return f"refused: {type(e).__name__}: {str(e)[:100]}"
    return "saved iterations 3-6"


def op_start_and_save(root: str) -> str:
    """A trainer starting on the directory (start-up cleanup), saving iteration 3 with retention."""
    ts = make_state(0, BIG)
    try:
        with _manager(root, keep_last=1, recycle_files="all") as mgr:
            for n, t in ts.items():
                mgr.register(n, t)
            fill(ts, 0, 3)
            mgr.save(3, {"iteration": 3})
            mgr.wait()
    except CheckpointError as e:
        return f"refused: {type(e).__name__}: {str(e)[:100]}"
    return "saved iteration 3"


# ------------------------------------------------------------------------------------------ attacks
@dataclasses.dataclass(frozen=True)
class Attack:
    name: str
    plant: object  # plant(root, outside) before the child starts; outside is a directory of files to guard
    run: object  # run(root) -> str, in the child
    expect: str  # a substring the outcome must hold


def _replace(path: str, make) -> None:
    os.unlink(path)
    make(path)


def _manifest(root: str, it: int = 2) -> str:
    return os.path.join(iter_dir(root, it), MANIFEST_NAME)


def _fifo_manifest(root, outside):
    _replace(_manifest(root), os.mkfifo)


def _dev_zero_manifest(root, outside):
    _replace(_manifest(root), lambda p: os.symlink("/dev/zero", p))


def _dev_zero_tracker(root, outside):
    _replace(os.path.join(root, TRACKER_NAME), lambda p: os.symlink("/dev/zero", p))


def _raw_manifest(text):
    def plant(root, outside):
        with open(_manifest(root), "w") as f:
            f.write(text)

    return plant


def _resealed(edit, reseal=True):
    def plant(root, outside):
        edit_manifest(iter_dir(root, 2), edit, reseal=reseal)

    return plant


def _manifest_dir(root, outside):
    _replace(_manifest(root), os.mkdir)


def _rank_file_link(root, outside):
    path = _rank_file(root, 2)
    copy = os.path.join(outside, "rank-file-copy.dsck")
    shutil.copy(path, copy)
    _replace(path, lambda p: os.symlink(copy, p))


def _iter_dir_link(root, outside):
    archive = os.path.join(outside, "archive")
    shutil.move(iter_dir(root, 2), archive)
    os.symlink(archive, iter_dir(root, 2))


def _half_index(root, outside):
    """The index record of ``big`` declares half its bytes; index, header and manifest resealed."""

    def halve(rec, cks, raw):
        rec[13] //= 2
        cks[rec[14]] = xxh64(bytes(raw[rec[12] : rec[12] + rec[13]]))

    reseal_index_record(_rank_file(root, 2), "big", halve)


def _link_at_next_rank_file(root):
    """In the child: a trainer resumes; a link to an outside file waits at its next rank file name."""
    ts = make_state(0, BIG)
    with _manager(root) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        os.makedirs(iter_dir(root, 3))
        os.symlink(_outside_victim(root), os.path.join(iter_dir(root, 3), rank_file_name(0, mgr.token, mgr._seq + 1)))
        try:
            mgr.save(3, {"iteration": 3})
            mgr.wait()
        except CheckpointError as e:
            return f"refused: {type(e).__name__}: {str(e)[:100]}"
    return "saved iteration 3"


def _link_at_temp(name_of):
    def run(root):
        os.makedirs(iter_dir(root, 3), exist_ok=True)
        os.symlink(_outside_victim(root), name_of(root, os.getpid()))  # an attacker that guessed our pid
        return op_start_and_save(root)

    return run


def _recycle_links(root, outside):
    pool = os.path.join(root, RECYCLE_DIR)
    os.makedirs(pool, exist_ok=True)
    os.symlink(os.path.join(outside, "precious.bin"), os.path.join(pool, f"{0:07d}-{rank_file_name(0, 'x' * 16, 99)}"))
    _replace(_rank_file(root, 1), lambda p: os.symlink(os.path.join(outside, "precious.bin"), p))


def _hard_linked_lock(root, outside):
    """The save directory's lock file replaced by a hard link to a file outside."""
    from datastates_megatron.engine.names import LOCK_NAME

    _replace(os.path.join(root, LOCK_NAME), lambda p: os.link(os.path.join(outside, "precious.bin"), p))


def _cp_al_backup(root, outside):
    """A ``cp -al`` backup (hard links) of both committed checkpoints, outside the save directory."""
    import subprocess

    for it in (1, 2):
        subprocess.run(["cp", "-al", iter_dir(root, it), os.path.join(outside, f"backup-{it}")], check=True)


# ----------------------------------------------------------------- crafted files under the size caps
CHUNKED_BIG = 270_000  # ~1 MiB of data: at chunk_bytes=1 its index holds ~8.7 MB of checksums


def _dense_manifest(root, outside):
    """iter_2's manifest: just under the 64 MiB cap of ``[{},{},...]`` (22 million dicts if parsed)."""
    n = ((64 << 20) - 4096) // 3
    with open(_manifest(root), "wb") as f:
        f.write(b"[" + b"{}," * n + b"{}]")


def _chunk_bytes_1(root, outside):
    """iter_3 (~1 MiB of data) rewritten with a checksum per byte, every checksum resealed."""
    commit(root, iterations=(3,), big=CHUNKED_BIG)
    rebuild_rank_file(_rank_file(root, 3), chunk_bytes=1)


def _big_objects(root, outside):
    """iter_2's objects section: 96 MiB, a ``[{},{},...]`` beside what the writer stored; resealed."""
    path = _rank_file(root, 2)
    with open(path, "rb") as f:
        raw = f.read()
    from datastates_megatron.engine.format.file_format import HEADER_BYTES, Header

    h = Header.unpack(raw[:HEADER_BYTES], path)
    objects = raw[h.objects_offset : h.objects_offset + h.objects_bytes]
    n = ((96 << 20) - len(objects)) // 3
    rebuild_rank_file(path, objects_json=b'{"pad":[' + b"{}," * n + b"{}]," + objects[1:])


def _sparse_tib(root, outside):
    """iter_2's rank file extended (sparse) to 1 TiB, its header and manifest record saying so."""
    rebuild_rank_file(_rank_file(root, 2), file_bytes=1 << 40)


def op_read_index(root: str, it: int = 2) -> str:
    """What a resharding load does first: read iter_2's global index against its manifest (format
    2: every slice's parameters, and one lookup of each key, as a rank's plan does for its own)."""
    from datastates_megatron.engine.errors import CorruptCheckpointError
    from datastates_megatron.engine.format.global_index import read_index

    try:
        got = read_index(iter_dir(root, it), read_manifest(iter_dir(root, it)))
        if got is None:
            return "no index"
        if hasattr(got, "keys"):  # format 1, read whole
            return f"read {len(got.keys)} keys"
        try:
            keys = 0
            for sl in got.slices():
                got.params_of([sl])
                for key in got.keys_of(sl):
                    got.pieces(key, 0, 1)
                    keys += 1
        finally:
            got.close()
    except CorruptCheckpointError as e:
        return f"refused: {str(e)[:120]}"
    return f"read {keys} keys"


def _plant_index(root: str, header: dict, body: bytes, version: int) -> None:
    """iter_2's global index of ``body`` under a valid seal naming iter_2's commit, in format
    ``version`` as its writer lays it out (1: the body's checksum in the header; 2: the header's own)."""
    import struct

    from datastates_megatron.engine.format.global_index import MAGIC
    from datastates_megatron.engine.fs.durable import atomic_write
    from datastates_megatron.engine.names import INDEX_NAME

    m = read_manifest(iter_dir(root, 2))
    head = {"format_version": version, "iteration": m.iteration, "commit_seq": m.commit_seq}
    head.update(run_token=m.run_token, world_size=m.world_size, body_bytes=len(body), **header)
    raw = json.dumps(head, sort_keys=True).encode()
    seal = struct.pack("<Q", xxh64(raw)) if version == 2 else b""
    atomic_write(os.path.join(iter_dir(root, 2), INDEX_NAME), MAGIC + struct.pack("<Q", len(raw)) + raw + seal + body)


def _sealed_index(tables, rows=lambda: b""):
    """Plant in iter_2 a format-1 global index of ``tables()`` (and ``rows()``) under a valid seal:
    its header names iter_2's commit and the body's checksum, as the writer's would (made when planted)."""

    def plant(root, outside):
        import struct

        raw = tables()
        body = struct.pack("<Q", len(raw)) + raw + rows()
        _plant_index(root, {"body_xxh64": xxh64(body)}, body, 1)

    return plant


def _sealed_index2(contents=None, tables=None, rows=0, slices=1):
    """Plant in iter_2 a format-2 global index under valid seals: table of contents ``contents()``,
    or ``slices`` slices ``"s0"``, ``"s1"``, ... each of tables ``tables()`` and ``rows`` rows of one
    key ``k`` (zeros)."""

    def plant(root, outside):
        import struct

        if contents is not None:
            toc, sections = contents(), b""
        else:
            raw = tables()
            fences = bytes(24 * math.ceil(rows / 32))
            head = struct.pack("<Q", len(raw)) + raw + fences
            sections = (head + bytes(48 * rows)) * slices
            size = len(head) + 48 * rows
            entries = [[f"s{i}", i * size, len(head), xxh64(head), i * size + len(head), rows] for i in range(slices)]
            toc = json.dumps({"slices": entries}).encode()
        _plant_index(root, {"ranks": None}, struct.pack("<QQ", len(toc), xxh64(toc)) + toc + sections, 2)

    return plant


def _tables(filler: bytes, total: int) -> bytes:
    """Index tables of about ``total`` bytes whose params hold ``filler`` repeated."""
    head, tail = b'{"keys":[],"params":{"p":[', b'0]},"tensors":[]}'
    return head + filler * ((total - len(head) - len(tail)) // len(filler)) + tail


def _contents(filler: bytes, total: int) -> bytes:
    head, tail = b'{"slices":[', b"0]}"
    return head + filler * ((total - len(head) - len(tail)) // len(filler)) + tail


INDEX_CAP = 64 * MiB - 4096  # just under the index's size cap (the manifest's)
_ROWS = (INDEX_CAP - 2 * MiB) // 48
INDEX_ATTACKS = [
    # issue 41, item 7.2: 1,537 MiB and 7.0 s before the index had the manifest's bounds
    Attack(
        '64 MiB index tables of {"a":0}: read',
        _sealed_index(lambda: _tables(b'{"a":0},', INDEX_CAP)),
        op_read_index,
        "refused",
    ),
    # ... and 1,015 MiB and 8.7 s for 256 MiB of strings
    Attack(
        "256 MiB index of strings: read",
        _sealed_index(lambda: _tables(b'"' + b"s" * (1 << 20) + b'",', 256 * MiB)),
        op_read_index,
        "refused",
    ),
    Attack(
        "64 MiB index of 1 MiB strings: read",
        _sealed_index(lambda: _tables(b'"' + b"s" * (1 << 20) + b'",', INDEX_CAP)),
        op_read_index,
        "read",
    ),
    Attack(
        "64 MiB index of short strings, one per 16 bytes: read",
        _sealed_index(lambda: _tables(b'"ssssssssssss", ', INDEX_CAP)),
        op_read_index,
        "refused",
    ),
    Attack(
        "64 MiB index of rows: read",
        _sealed_index(
            lambda: b'{"keys":["k"],"params":{},"tensors":["t"]}', lambda: bytes(48 * ((INDEX_CAP - 4096) // 48))
        ),
        op_read_index,
        "read",
    ),
    # format 2 (ranged reads): the same bounds on each JSON text it parses
    Attack(
        '64 MiB format-2 contents of {"a":0}: read',
        _sealed_index2(contents=lambda: _contents(b'{"a":0},', INDEX_CAP)),
        op_read_index,
        "refused",
    ),
    Attack(
        "64 MiB format-2 slice tables of short strings, one per 16 bytes: read",
        _sealed_index2(tables=lambda: _tables(b'"ssssssssssss", ', INDEX_CAP)),
        op_read_index,
        "refused",
    ),
    # issue 49, item 4: strings that decode to more than their bytes (a string with one character
    # past the BMP is stored at 4 bytes per character), and values spread over many texts
    Attack(
        "64 MiB format-2 slice tables: one string ending in a non-BMP character: read",
        _sealed_index2(
            tables=lambda: _tables(b'"' + b"s" * (INDEX_CAP - 64) + "\U0001f600".encode() + b'",', INDEX_CAP)
        ),
        op_read_index,
        "refused",
    ),
    Attack(
        "64 MiB format-2 contents: one string ending in an escaped non-BMP character: read",
        _sealed_index2(contents=lambda: _contents(b'"' + b"s" * (INDEX_CAP - 64) + b'\\ud83d\\ude00",', INDEX_CAP)),
        op_read_index,
        "refused",
    ),
    Attack(
        "64 MiB format-2 slice tables: 2^19 strings ending in an escaped non-BMP character: read",
        _sealed_index2(tables=lambda: _tables(b'"' + b"s" * 113 + b'\\ud83d\\ude00",', INDEX_CAP)),
        op_read_index,
        "refused",
    ),
    Attack(
        "64 MiB format-2 slice tables: 2^19 ASCII strings of 125 B: read",
        _sealed_index2(tables=lambda: _tables(b'"' + b"s" * 125 + b'",', INDEX_CAP)),
        op_read_index,
        "refused",
    ),
    Attack(
        "64 MiB format-2 index: 128 slices of 80k short strings each: read",
        _sealed_index2(tables=lambda: _tables(b'"sss",', 480_000), slices=128),
        op_read_index,
        "refused",
    ),
    Attack(
        "64 MiB format-2 slice of rows of one key: read",
        _sealed_index2(
            tables=lambda: json.dumps({"keys": [["k", 0, _ROWS, 0]], "params": {}, "tensors": ["t"]}).encode(),
            rows=_ROWS,
        ),
        op_read_index,
        "read",
    ),
]


def _outside_victim(root: str) -> str:
    return os.path.join(os.path.dirname(root), "outside", "precious.bin")


def _nothing(root, outside):
    pass


ATTACKS = [
    Attack("manifest -> /dev/zero: ls", _dev_zero_manifest, op_ls, "rc 1"),
    Attack("manifest -> /dev/zero: load", _dev_zero_manifest, op_load, "refused"),
    Attack("manifest is a FIFO: ls", _fifo_manifest, op_ls, "rc 1"),
    Attack("manifest is a FIFO: verify", _fifo_manifest, op_verify, "rc 1"),
    Attack("manifest is a FIFO: start-up", _fifo_manifest, op_start_and_save, "saved"),
    Attack("tracker -> /dev/zero: ls", _dev_zero_tracker, op_ls, "rc 0"),
    Attack(
        "world_size 10^12, bad checksum: ls", _resealed(lambda b: b.update(world_size=10**12), False), op_ls, "rc 1"
    ),
    Attack("manifest nested 1,500 deep: ls", _raw_manifest("[" * 1500 + "]" * 1500), op_ls, "rc 1"),
    Attack("manifest nested 1,500 deep: start-up", _raw_manifest("[" * 1500 + "]" * 1500), op_start_and_save, "saved"),
    Attack("manifest is a directory: start-up", _manifest_dir, op_start_and_save, "saved"),
    Attack('resealed "file": 123: verify', _resealed(lambda b: b["ranks"][0].update(file=123)), op_verify, "rc 1"),
    Attack("resealed created NaN: verify", _resealed(lambda b: b.update(created=math.nan)), op_verify, "rc 1"),
    Attack("resealed world_size 2.7: load", _resealed(lambda b: b.update(world_size=2.7)), op_load, "refused"),
    Attack("resealed half-size index: load", _half_index, op_load, "refused"),
    Attack("resealed half-size index: verify", _half_index, op_verify, "rc 1"),
    Attack("rank file -> copy outside: load", _rank_file_link, op_load, "refused"),
    Attack("rank file -> copy outside: verify", _rank_file_link, op_verify, "rc 1"),
    Attack("iter_* -> archive outside: load", _iter_dir_link, op_load, "refused"),
    Attack("iter_* -> archive outside: start-up", _iter_dir_link, op_start_and_save, "saved"),
    Attack("link at next rank file name: save", _nothing, _link_at_next_rank_file, "refused"),
    Attack(
        "link at manifest temp name: save",
        _nothing,
        _link_at_temp(lambda root, pid: os.path.join(iter_dir(root, 3), f"{MANIFEST_NAME}.tmp-{pid}")),
        "refused",
    ),
    Attack(
        "link at tracker temp name: save",
        _nothing,
        _link_at_temp(lambda root, pid: os.path.join(root, f"{TRACKER_NAME}.tmp-{pid}")),
        "saved",  # the tracker is a hint: its update is skipped, the commit stands
    ),
    Attack("links as rank file and in recycle pool: save", _recycle_links, op_start_and_save, "saved"),
    Attack("lock file hard-linked to a file outside: start-up", _hard_linked_lock, op_start_and_save, "refused"),
    Attack("cp -al backup of the checkpoints: recycling saves", _cp_al_backup, op_start_and_save_recycling, "saved"),
    # crafted files under the size caps (issue 33): each within 64 MiB + 2x its bytes and 2 s per 64 MiB
    Attack("64 MiB manifest [{},{},...]: ls", _dense_manifest, op_ls, "rc 1"),
    Attack("64 MiB manifest [{},{},...]: verify", _dense_manifest, op_verify, "rc 1"),
    Attack("64 MiB manifest [{},{},...]: load", _dense_manifest, op_load, "refused"),
    Attack("64 MiB manifest [{},{},...]: start-up, 4 commits", _dense_manifest, op_start_and_save_many, "saved"),
    Attack("chunk_bytes=1 rank file: verify", _chunk_bytes_1, lambda root: op_verify(root, 3), "rc 1"),
    Attack("chunk_bytes=1 rank file: inspect", _chunk_bytes_1, lambda root: op_inspect(root, 3), "rc 1"),
    Attack("chunk_bytes=1 rank file: verifying load", _chunk_bytes_1, op_load_chunked, "refused"),
    Attack("96 MiB objects section: inspect", _big_objects, op_inspect, "rc 1"),
    Attack("96 MiB objects section: verify", _big_objects, op_verify, "rc 1"),
    Attack("96 MiB objects section: load", _big_objects, op_load, "refused"),
    Attack("1 TiB sparse rank file: verify", _sparse_tib, op_verify, "rc 1"),
    Attack("1 TiB sparse rank file: inspect", _sparse_tib, op_inspect, "rc 1"),
    Attack("1 TiB sparse rank file: load", _sparse_tib, op_load, "refused"),
]


def _digests(directory: str) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(directory):
        for name in files:
            p = os.path.join(dirpath, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _in_child(run, root: str, limit_s: float) -> dict:
    """``run(root)`` in a forked child under SIGALRM; its outcome, wall and CPU time (all its threads)
    and peak RSS growth. The bound is checked on CPU time, which other load on the machine does not
    inflate; wall time is kept as the guard against a wait."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            logging.disable(logging.WARNING)  # the table says what happened; the engine's log lines would bury it
            signal.alarm(int(math.ceil(limit_s)))
            usage = resource.getrusage(resource.RUSAGE_SELF)
            before, cpu0 = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
            t0 = time.perf_counter()
            try:
                outcome = run(root)
            except BaseException as e:  # reported: the sweep goes on
                outcome = f"TRACEBACK {type(e).__name__}: {str(e)[:100]}"
            wall = time.perf_counter() - t0
            usage = resource.getrusage(resource.RUSAGE_SELF)
            growth = (usage.ru_maxrss - before) * 1024
            cpu = usage.ru_utime + usage.ru_stime - cpu0
            os.write(w, json.dumps({"outcome": outcome, "wall_s": wall, "cpu_s": cpu, "rss_growth": growth}).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return {"outcome": f"CHILD DIED (wait status {status})", "wall_s": limit_s, "cpu_s": limit_s, "rss_growth": 0}
    return json.loads(data)


def _allocated(directory: str) -> int:
    """Bytes the files under ``directory`` occupy on disk (a sparse file counts what it holds)."""
    total = 0
    for dirpath, _, files in os.walk(directory):
        for name in files:
            total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


WALL_SLACK = 5  # wall time may exceed the CPU bound this many times (a machine shared with other work)


def bound(planted: int) -> tuple[int, float]:
    """The stated cost bound of reading crafted files of ``planted`` bytes (docs/reliability.md):
    peak memory growth <= 64 MiB + 2x the bytes, CPU time <= 2 s per 64 MiB (at least 2 s)."""
    return 64 * MiB + 2 * planted, 2.0 * max(1.0, planted / (64 * MiB))


def run_attack(attack: Attack, workdir: str, limit_s: float = 30.0) -> dict:
    """Plant ``attack`` in a fresh save directory under ``workdir`` and run its victim operation.
    ``planted``: the bytes the attack added; ``within_bound``: the run kept to :func:`bound`."""
    root, outside = os.path.join(workdir, "ckpt"), os.path.join(workdir, "outside")
    os.makedirs(outside)
    with open(os.path.join(outside, "precious.bin"), "wb") as f:
        f.write(os.urandom(8192))
    commit(root)
    before = _allocated(root)
    attack.plant(root, outside)
    planted = max(0, _allocated(root) - before)
    guarded = _digests(outside)
    got = _in_child(attack.run, root, limit_s)
    got["outside_unchanged"] = _digests(outside) == guarded
    got["as_specified"] = attack.expect in got["outcome"] and got["outside_unchanged"]
    got["planted"] = planted
    memory, seconds = bound(planted)
    got["within_bound"] = (
        got["rss_growth"] <= memory and got["cpu_s"] <= seconds and got["wall_s"] <= WALL_SLACK * seconds
    )
    return got


def warm_up(workdir: str) -> None:
    """Import and JIT everything once in the parent, so children measure the attack, not warm-up."""
    from datastates_megatron.engine.format.json_budget import wide_string_bytes

    root = os.path.join(workdir, "ckpt")
    commit(root)
    op_ls(root), op_verify(root), op_load(root)
    wide_string_bytes(b'["\\u0101"]')  # the escape-aware pass, compiled (numba) only when a text needs it
    shutil.rmtree(root)
    torch.set_num_threads(1)
