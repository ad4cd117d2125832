#!/usr/bin/env python
"""Exhaustive fault-injection sweep: kill -9 at every phase, bit flips everywhere, memory pressure,
a full disk.  Prints what was tried, what survived, and how much data was lost (must be 0).

    python -m tests.faults.sweep [--quick] [--spawn] [--no-demo] [--no-fulldisk] [--json OUT]

Engine level (2 gloo ranks, tests/workers/fault_worker.py; ranks are forked from this warm process,
or fresh interpreters with ``--spawn``): each injection runs ``save`` of iterations 1-3 with
``keep_last=1`` and the fault, then a restart that loads the newest committed checkpoint (checksums
verified), checks it bit for bit, and saves up to iteration 4.  *Data lost* counts restarts that
loaded an older iteration than one the crashed run had been told was committed (its ``wait()``
returned it), or could not load at all.  Faults:

* ``copy``: an external SIGKILL N ms into a save whose device->host copies are slowed;
* ``flush:k``, ``before_finish:k``, ``before_manifest:k``, ``before_tracker:k``, ``retention:k``,
  ``retention_files:k``: the crash points of engine/runtime/faults.py (``DSM_CRASH_AT``), on one rank
  (``DSM_CRASH_RANK``) or all; ``after_commit``: a launcher kills every rank once the tracker moves;
* ``restore``: an external SIGKILL N ms into the load of a 2 x 32 MB checkpoint, and
  ``DSM_CRASH_AT=restore:n`` (reported as *not placed* while engine/runtime/faults.py has no such call).

Demo level (real ``python -m datastates_megatron.demo.train`` processes): a crash point, a restart,
and a comparison with an uninterrupted run: every loss after the resume and the final digest of every
param shard, main param and Adam state must be identical.

Corruption: single bit flips at random places of a committed 2-rank checkpoint (tensor data, index,
header, objects, manifest), each followed by the load path of every rank: *detected* (an error, no
tensor touched), *harmless* (bytes nothing reads, e.g. the manifest's ``created``), or *silent*
(a wrong state or a wrong "latest" loaded without an error).

Memory: tests/workers/memory_worker.py (128 MiB state, 4 MiB cache, 4 saves in flight): RSS growth.
Full disk: a 64 MiB tmpfs (root only) filled mid-flush and at the manifest.

Hostile storage (tests/faults/attacks.py): symlinks, FIFOs, /dev/zero, huge numbers, deep nesting and
resealed bad fields planted in a save directory, each followed by what a user or trainer runs on it
(ls, verify, load, start-up and save) in a forked child: the outcome, its time and peak memory
growth, and whether any byte outside the save directory changed.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from datastates_megatron.engine import CheckpointError  # noqa: E402
from datastates_megatron.engine.format import data_layout, file_format, hashing  # noqa: E402
from datastates_megatron.engine.format.file_format import RankFile  # noqa: E402
from datastates_megatron.engine.format.manifest import read_manifest, read_tracker  # noqa: E402
from datastates_megatron.engine.names import MANIFEST_NAME, iter_dir  # noqa: E402
from datastates_megatron.engine.tiers.tier import committed_iterations, latest_committed  # noqa: E402
from datastates_megatron.engine.load.load_plan import SameLayoutPlanner  # noqa: E402
from datastates_megatron.engine.load.reader import CheckpointReader, open_checkpoint  # noqa: E402
from tests.distributed.ranks import run_ranks  # noqa: E402
from tests.workers import fault_worker as fw  # noqa: E402

WORKER = "tests.workers.fault_worker"
MiB = 1 << 20


@dataclasses.dataclass
class Outcome:
    phase: str
    label: str
    who: str
    killed: bool = False
    resumed: bool = False
    lost: bool = False
    detail: str = ""


class Sweep:
    def __init__(self, args) -> None:
        self.args = args
        self.tmp = tempfile.mkdtemp(prefix="fault-sweep-", dir=args.dir)
        self.outcomes: list[Outcome] = []
        self.n = 0

    # ------------------------------------------------------------------------------ launching
    def launch(self, argv, env=None, kill_when=None, timeout=180.0):
        if self.args.spawn:
            return run_ranks(WORKER, 2, argv, env=env, kill_when=kill_when, timeout=timeout)
        return run_ranks(fw.run, 2, argv, env=env, kill_when=kill_when, timeout=timeout)

    def fresh(self, name: str) -> str:
        self.n += 1
        d = os.path.join(self.tmp, f"{self.n:03d}-{name.replace(':', '_')}")
        os.makedirs(d)
        return d

    def log(self, o: Outcome) -> None:
        self.outcomes.append(o)
        mark = "ok  " if o.resumed and not o.lost else ("----" if not o.killed else "FAIL")
        print(f"  [{mark}] {o.phase:<15} {o.label:<26} {o.who:<6} {o.detail}", flush=True)

    # ------------------------------------------------------------------------------ engine level
    def resume_and_check(self, root: str, progress: str, until: int, extra=()) -> tuple[bool, bool, str]:
        acked = fw.acknowledged(progress, 2)
        try:
            on_disk = latest_committed(root) if committed_iterations(root) else None
        except CheckpointError as e:
            return False, True, f"no loadable latest after the crash: {e}"
        res = self.launch(["resume", "--root", root, "--until", str(until), "--keep-last", "1", *extra])
        results = [r["result"] for r in res]
        if not all(r["returncode"] == 0 and r["result"] for r in res):
            return False, True, "restart failed: " + " | ".join(r["stderr"][-300:] for r in res)
        if any("error" in r for r in results):
            return False, True, f"restart could not load: {results[0].get('error') or results[1].get('error')}"
        loaded = results[0]["iteration"]
        lost = (loaded or 0) < (acked or 0)
        ok = (
            all(r["iteration"] == on_disk and r["exact"] and r["objects_ok"] and not r["errors"] for r in results)
            and all(r["committed"] == list(range((loaded or 0) + 1, until + 1)) for r in results)
            and committed_iterations(root) == [until]
            and read_tracker(root) == until
            and all(
                os.path.exists(os.path.join(root, n, MANIFEST_NAME)) for n in os.listdir(root) if n.startswith("iter_")
            )
        )
        return ok, lost, f"acked {acked}, on disk {on_disk}, resumed from {loaded}"

    def crash(self, phase: str, label: str, who: str, extra=(), env=None, kill_when=None, big=None) -> None:
        d = self.fresh(label)
        root, progress = os.path.join(d, "ckpt"), os.path.join(d, "progress")
        size = ["--big", str(big)] if big else []
        argv = ["save", "--root", root, "--iters", "3", "--keep-last", "1", "--progress", progress, *size, *extra]
        res = self.launch(argv, env=env, kill_when=(lambda: kill_when(root)) if kill_when else None)
        o = Outcome(phase, label, who, killed=any(r["returncode"] == -9 for r in res))
        if not o.killed:
            o.detail = "not reached (no rank was killed)"
        else:
            o.resumed, o.lost, o.detail = self.resume_and_check(root, progress, 4, size)
            if phase == "copy":  # did the kill land before the gate (copies complete) of that iteration?
                it = label.split("save:")[1].split("+")[0]
                early = [r for r, lines in enumerate(fw.read_progress(progress, 2)) if f"snapshot {it}" not in lines]
                o.detail += f"; snapshot {it} incomplete on ranks {early}"
        self.log(o)
        if not self.args.keep:
            shutil.rmtree(d, ignore_errors=True)

    def engine_sweep(self) -> None:
        q = self.args.quick
        print("engine level: kill -9 during save/commit/retention, restart, load, continue", flush=True)
        for who in ("all", "rank1"):
            rank_env = {} if who == "all" else {"DSM_CRASH_RANK": "1"}
            kill_rank = [] if who == "all" else ["--kill-rank", "1"]
            for it, ms in [(2, 60)] if q else [(1, 50), (2, 0), (2, 30), (2, 60), (2, 90), (2, 120)]:
                self.crash(
                    "copy",
                    f"SIGKILL save:{it}+{ms}ms",
                    who,
                    ["--slow-copy-ms", "10", "--kill-at", f"save:{it}", "--kill-after-ms", str(ms), *kill_rank],
                )
            for k in [7, 21] if q else [1, 3, 7, 14, 15, 21, 28, 35, 42]:
                self.crash("flush", f"flush:{k}", who, env={"DSM_CRASH_AT": f"flush:{k}", **rank_env})
            for k in [2] if q else [1, 2, 3]:
                self.crash(
                    "before_finish", f"before_finish:{k}", who, env={"DSM_CRASH_AT": f"before_finish:{k}", **rank_env}
                )
        for point in ("before_manifest", "before_tracker"):  # reached by rank 0 only
            for k in [2] if q else [1, 2, 3]:
                self.crash(point, f"{point}:{k}", "rank0", env={"DSM_CRASH_AT": f"{point}:{k}"})
        for point in ("retention", "retention_files"):
            for k in [1] if q else [1, 2]:
                self.crash("retention", f"{point}:{k}", "rank0", env={"DSM_CRASH_AT": f"{point}:{k}"})
        for it in [2] if q else [1, 2, 3]:
            self.crash(
                "after_commit",
                f"launcher kill at tracker>={it}",
                "all",
                ["--slow-write-ms", "20"],
                kill_when=lambda root, it=it: (read_tracker(root) or 0) >= it,
            )

    def restore_sweep(self) -> None:
        """Kills during the load of a big checkpoint; the checkpoint must load afterwards, exactly."""
        q = self.args.quick
        print("restore: kill -9 during the load of a 2 x 32 MB checkpoint", flush=True)
        d = self.fresh("restore")
        root = os.path.join(d, "ckpt")
        big = ["--big", str(8_000_000), "--cache-kb", "8192"]
        res = self.launch(["save", "--root", root, "--iters", "2", "--keep-last", "1", *big])
        assert all(r["returncode"] == 0 for r in res), [r["stderr"][-2000:] for r in res]
        injections = []
        for who in ("all", "rank1"):
            kill_rank = [] if who == "all" else ["--kill-rank", "1"]
            for ms in [40] if q else [10, 40, 80, 150]:
                injections.append(
                    (
                        f"SIGKILL load+{ms}ms",
                        who,
                        ["--slow-restore-ms", "20", "--kill-at", "load", "--kill-after-ms", str(ms), *kill_rank],
                        None,
                    )
                )
            for n in [3] if q else [1, 5]:
                env = {"DSM_CRASH_AT": f"restore:{n}", **({} if who == "all" else {"DSM_CRASH_RANK": "1"})}
                injections.append((f"restore:{n}", who, [], env))
        for label, who, extra, env in injections:
            progress = os.path.join(d, f"progress-{len(self.outcomes)}")
            res = self.launch(["load", "--root", root, "--progress", progress, *big, *extra], env=env)
            o = Outcome("restore", label, who, killed=any(r["returncode"] == -9 for r in res))
            lines = fw.read_progress(progress, 2)
            mid = [("load_start" in x and not any(y.startswith("load_done") for y in x)) for x in lines]
            if not o.killed:
                o.detail = (
                    "not reached (no rank was killed: crash point not placed?)" if env else "missed (load ended first)"
                )
            else:
                check = self.launch(["load", "--root", root, *big])
                ok = all(
                    r["returncode"] == 0
                    and r["result"]
                    and r["result"].get("iteration") == 2
                    and r["result"].get("exact")
                    for r in check
                )
                o.resumed, o.lost = ok, not ok
                o.detail = f"killed mid-load on ranks {[i for i, m in enumerate(mid) if m]}; reload {'exact' if ok else 'FAILED'}"
            self.log(o)
        ok, lost, detail = self.resume_and_check(root, os.path.join(d, "none"), 3, big)
        self.log(Outcome("restore", "final resume", "all", True, ok, lost, detail))
        if not self.args.keep:
            shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------------------ demo level
    def demo_sweep(self) -> None:
        q = self.args.quick
        print("demo trainer: crash, restart, bit-exact comparison with an uninterrupted run", flush=True)
        model = [
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--seq-length",
            "32",
            "--vocab-size",
            "256",
            "--train-iters",
            "8",
        ]
        lazy = [*model, "--lazy-ckpt", "--lazy-ckpt-host-cache-gb", "0.002", "--lazy-ckpt-keep-last", "2"]
        demo = "datastates_megatron.demo.train"
        d = self.fresh("demo")
        ref = run_ranks(demo, 2, [*model, "--log-json", os.path.join(d, "ref")], timeout=600)
        assert all(r["returncode"] == 0 for r in ref), [r["stderr"][-2000:] for r in ref]
        reference = [json.load(open(os.path.join(d, f"ref.rank{r}.json"))) for r in range(2)]
        points = [
            ("flush:3", "all"),
            ("flush:12", "rank1"),
            ("before_finish:4", "all"),
            ("before_manifest:3", "rank0"),
            ("before_tracker:3", "rank0"),
            ("retention:2", "rank0"),
            ("retention_files:1", "rank0"),
            ("restore:3", "all"),
        ]
        if q:
            points = points[1:2] + points[4:5]
        for point, who in points:
            save = os.path.join(d, point.replace(":", "_"))
            if point.startswith("restore"):  # a checkpoint to load first
                pre = run_ranks(demo, 2, [*lazy, "--save", save, "--exit-after-iteration", "4"], timeout=600)
                assert all(r["returncode"] == 0 for r in pre), [r["stderr"][-2000:] for r in pre]
            env = {"DSM_CRASH_AT": point, **({"DSM_CRASH_RANK": "1"} if who == "rank1" else {})}
            crashed = run_ranks(demo, 2, [*lazy, "--save", save], env=env, timeout=600)
            o = Outcome("demo", point, who, killed=any(r["returncode"] == -9 for r in crashed))
            if not o.killed:
                o.detail = "not reached (no rank was killed: crash point not placed?)"
                self.log(o)
                continue
            on_disk = latest_committed(save) if committed_iterations(save) else None
            log = os.path.join(d, point.replace(":", "_") + "-resumed")
            resumed = run_ranks(demo, 2, [*lazy, "--save", save, "--log-json", log], timeout=600)
            if not all(r["returncode"] == 0 for r in resumed):
                o.lost, o.detail = True, "restart failed: " + resumed[0]["stderr"][-300:]
                self.log(o)
                continue
            got = [json.load(open(f"{log}.rank{r}.json")) for r in range(2)]
            exact = True
            for a, b in zip(reference, got):
                want = {x["iteration"]: x["loss"] for x in a["iterations"]}
                after = {x["iteration"]: x["loss"] for x in b["iterations"]}
                exact &= b["resumed_from"] == on_disk and all(after[i] == want[i] for i in after)
                exact &= sorted(after) == list(range((on_disk or 0) + 1, 9)) and a["digest"] == b["digest"]
            o.resumed, o.lost = exact, not exact
            o.detail = f"resumed from {on_disk}; losses and digest {'bit-exact' if exact else 'DIFFER'}"
            self.log(o)
        if not self.args.keep:
            shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------------------ corruption
    def corruption_sweep(self) -> dict:
        trials = 60 if self.args.quick else 400
        print(f"corruption: {trials} single bit flips in a committed 2-rank checkpoint", flush=True)
        d = self.fresh("corrupt")
        pristine = os.path.join(d, "pristine")
        res = self.launch(["save", "--root", pristine, "--iters", "3", "--keep-last", "2", "--big", "50000"])
        assert all(r["returncode"] == 0 for r in res), [r["stderr"][-2000:] for r in res]
        rng = random.Random(self.args.seed)
        stats: dict = collections.defaultdict(collections.Counter)
        silent_examples = []
        for t in range(trials):
            root = os.path.join(d, "trial")
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(pristine, root)
            where, what = self._flip_random(root, rng)
            outcome = self._load_all(root)
            stats[where][outcome] += 1
            if outcome == "silent" and len(silent_examples) < 5:
                silent_examples.append(f"{where}: {what}")
        # targeted: every single-bit flip of the last character of each manifest value that keeps the
        # JSON valid (a digit stays a digit, a letter a letter): flips no parser can notice
        fields: dict = collections.defaultdict(collections.Counter)
        for it in (2, 3):
            text = open(os.path.join(iter_dir(pristine, it), MANIFEST_NAME), "rb").read()
            for key, at in _value_ends(text):
                for bit in range(7):
                    c = chr(text[at] ^ (1 << bit))
                    if not (c.isalnum() and c.isdigit() == chr(text[at]).isdigit()):
                        continue
                    root = os.path.join(d, "trial")
                    shutil.rmtree(root, ignore_errors=True)
                    shutil.copytree(pristine, root)
                    with open(os.path.join(iter_dir(root, it), MANIFEST_NAME), "r+b") as f:
                        f.seek(at)
                        f.write(c.encode())
                    outcome = self._load_all(root)
                    fields[key][outcome] += 1
                    stats["manifest field"][outcome] += 1
                    if outcome == "silent" and len(silent_examples) < 8:
                        silent_examples.append(f"manifest of iteration {it}: {key} {chr(text[at])!r} -> {c!r}")
        shutil.rmtree(d, ignore_errors=True)
        return {
            "trials": trials + sum(sum(c.values()) for c in fields.values()),
            "by_place": {k: dict(v) for k, v in stats.items()},
            "manifest_fields": {k: dict(v) for k, v in fields.items()},
            "silent_examples": silent_examples,
        }

    @staticmethod
    def _flip_random(root: str, rng: random.Random) -> tuple[str, str]:
        where = rng.choice(["data", "index", "header", "objects", "manifest"])
        # rank files: the latest checkpoint (3), which a load reads; manifests: either, since an
        # older one's commit_seq decides what "latest" means too
        it = rng.choice([2, 3]) if where == "manifest" else 3
        d = iter_dir(root, it)
        m = read_manifest(d)
        if where == "manifest":
            path = os.path.join(d, MANIFEST_NAME)
            size = os.path.getsize(path)
            off = rng.randrange(size)
        else:
            rank = rng.randrange(2)
            path = os.path.join(d, m.ranks[rank].file)
            with RankFile(path) as rf:
                h = rf.header
                if where == "data":
                    e = rng.choice([e for e in rf.entries.values() if e.nbytes])
                    off = e.offset + rng.randrange(e.nbytes)
                elif where == "index":
                    off = h.index_offset + rng.randrange(h.index_bytes)
                elif where == "objects":
                    off = h.objects_offset + rng.randrange(h.objects_bytes)
                else:
                    off = rng.randrange(8 + 8 + 11 * 8 + 8)  # the packed header and its checksum
        bit = rng.randrange(8)
        with open(path, "r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ (1 << bit)]))
        return where, f"{os.path.relpath(path, root)} byte {off} bit {bit}"

    @staticmethod
    def _load_all(root: str) -> str:
        """Run the load path of every rank (as CheckpointManager.load does) into fresh tensors."""
        outcome = "harmless"
        for rank in range(2):
            ts = fw.make_state(rank, 50_000)
            for t in ts.values():
                t.fill_(-3)
            try:
                it = latest_committed(root)
                ckpt, m = open_checkpoint(root, it)
                with CheckpointReader(ckpt, m, rank=rank, verify=True, threads=1) as reader:
                    objects = reader.load(SameLayoutPlanner(ts, 2, {}))[0].objects
            except CheckpointError:
                if not all(bool((t == -3).all()) for t in ts.values()):
                    return "silent"  # refused, but after touching tensors
                outcome = "detected"
                continue
            if it != 3 or not fw.is_state_of(ts, rank, 3) or objects != {"iteration": 3, "rank": rank}:
                return "silent"
        return outcome

    # ------------------------------------------------------------------------------ memory, disk
    def hostile(self) -> list[dict]:
        from tests.faults import attacks

        print(f"hostile storage: {len(attacks.ATTACKS)} attacks, each in a forked child (30 s limit)", flush=True)
        attacks.warm_up(self.fresh("hostile-warm-up"))
        out = []
        for attack in attacks.ATTACKS:
            got = attacks.run_attack(attack, self.fresh("hostile"))
            got["attack"] = attack.name
            out.append(got)
            mark = "ok  " if got["as_specified"] else "FAIL"
            print(
                f"  [{mark}] {attack.name:<46} {got['wall_s']:6.2f} s {got['rss_growth'] / MiB:6.1f} MiB  "
                f"outside {'unchanged' if got['outside_unchanged'] else 'CHANGED'}  {got['outcome'][:90]}",
                flush=True,
            )
        return out

    def memory(self) -> dict:
        print("memory: 128 MiB state, 4 MiB host cache, 4 saves in flight, slow storage", flush=True)
        d = self.fresh("memory")
        env = dict(os.environ, PYTHONPATH=ROOT)
        done = subprocess.run(
            [sys.executable, "-m", "tests.workers.memory_worker", "--root", os.path.join(d, "c")],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        shutil.rmtree(d, ignore_errors=True)
        if done.returncode != 0:
            return {"error": done.stderr[-2000:]}
        return json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[7:])

    def full_disk(self) -> list[dict]:
        from tests.faults.conftest import mount_tmpfs, unmount

        print("full disk: a 64 MiB tmpfs filled mid-flush and at the manifest", flush=True)
        out = []
        for fill, on_error in (("data", "raise"), ("data", "warn"), ("manifest", "raise"), ("manifest", "warn")):
            fs = os.path.join(self.fresh(f"disk-{fill}-{on_error}"), "fs")
            why = mount_tmpfs(fs, "64m")
            if why:
                return [{"skipped": why}]
            try:
                root = os.path.join(fs, "ckpt")
                res = self.launch(
                    [
                        "fulldisk",
                        "--root",
                        root,
                        "--big",
                        "3000000",
                        "--cache-kb",
                        "4096",
                        "--keep-last",
                        "2",
                        "--on-error",
                        on_error,
                        "--fill",
                        fill,
                    ]
                )
                r = [x["result"] for x in res]
                row = {"fill": fill, "on_error": on_error, "rc": [x["returncode"] for x in res]}
                if all(r):
                    row.update(
                        committed=[x["committed"] for x in r],
                        errors_at_2=[len(x["errors"].get("2", [])) for x in r],
                        latest_after_failure=r[0]["after_failure"]["latest"],
                        partial_left=r[0]["after_failure"]["iter2_entries"] or [],
                        iter2_loadable=any(x["iter2_loadable"] is not False for x in r),
                        committed_on_disk=committed_iterations(root),
                    )
                out.append(row)
                status = "ok" if all(r) and row["committed"] == [[1, 3], [1, 3]] and not row["partial_left"] else "FAIL"
                print(
                    f"  [{status:<4}] full disk at {fill:<8} on_error={on_error:<5} {json.dumps(row)[:260]}", flush=True
                )
            finally:
                unmount(fs)
        return out


def _value_ends(text: bytes):
    """(key path, offset of the last alphanumeric character of its value) for every scalar of a
    manifest written by ``Manifest.to_json`` (``indent=1``: one scalar per line)."""
    path: list[str] = []
    out = []
    for line_start, line in _lines(text):
        stripped = line.strip()
        depth = len(line) - len(line.lstrip(b" "))
        del path[max(0, depth - 1) :]
        if b'": ' in stripped:
            key = stripped.split(b'": ', 1)[0].strip(b'"').decode()
            value = stripped.split(b'": ', 1)[1]
            path.append(key)
            if value[:1] not in (b"{", b"["):
                ends = [i for i, ch in enumerate(line) if chr(ch).isalnum()]
                if ends and ends[-1] > line.index(b'": ') + 2:
                    out.append((".".join(p for p in path if not p.isdigit()), line_start + ends[-1]))
                path.pop()
        elif stripped in (b"{", b"{},", b"{}") and path:
            pass
    return out


def _lines(text: bytes):
    start = 0
    for line in text.split(b"\n"):
        yield start, line
        start += len(line) + 1


def summarize(
    sweep: Sweep, corruption: dict | None, memory: dict | None, disk: list | None, hostile: list | None, wall: float
) -> dict:
    by_phase: dict = collections.OrderedDict()
    for o in sweep.outcomes:
        row = by_phase.setdefault(o.phase, collections.Counter())
        row["tried"] += 1
        row["killed"] += o.killed
        row["one rank" if o.who != "all" else "all ranks"] += o.killed
        row["resumed"] += o.killed and o.resumed and not o.lost
        row["lost"] += o.lost
        row["not reached"] += not o.killed
    print("\n================ fault sweep summary ================")
    print(
        f"{'phase':<15}{'injections':>11}{'killed':>8}{'1 rank':>8}{'all':>6}{'resumed ok':>12}{'data lost':>11}{'not reached':>13}"
    )
    tot = collections.Counter()
    for phase, row in by_phase.items():
        tot.update(row)
        print(
            f"{phase:<15}{row['tried']:>11}{row['killed']:>8}{row['one rank']:>8}{row['all ranks']:>6}"
            f"{row['resumed']:>12}{row['lost']:>11}{row['not reached']:>13}"
        )
    print(
        f"{'total':<15}{tot['tried']:>11}{tot['killed']:>8}{tot['one rank']:>8}{tot['all ranks']:>6}"
        f"{tot['resumed']:>12}{tot['lost']:>11}{tot['not reached']:>13}"
    )
    summary = {"phases": {k: dict(v) for k, v in by_phase.items()}, "total": dict(tot), "wall_s": wall}
    if corruption:
        agg = collections.Counter()
        print(f"\ncorruptions ({corruption['trials']} single bit flips):  place: detected / harmless / silent")
        for place, c in sorted(corruption["by_place"].items()):
            agg.update(c)
            print(f"  {place:<15} {c.get('detected', 0):>4} / {c.get('harmless', 0):>3} / {c.get('silent', 0):>3}")
        tried = sum(agg.values())
        print(
            f"corruptions detected / tried: {agg['detected']} / {tried}  (harmless, nothing reads those bits: "
            f"{agg['harmless']}; silent: {agg['silent']})"
        )
        if corruption.get("manifest_fields"):
            print("  manifest, every value-preserving flip per field: detected / harmless / silent")
            for key, c in sorted(corruption["manifest_fields"].items()):
                print(f"    {key:<22} {c.get('detected', 0):>3} / {c.get('harmless', 0):>3} / {c.get('silent', 0):>3}")
        for ex in corruption["silent_examples"]:
            print(f"  silent: {ex}")
        summary["corruption"] = corruption
    if memory:
        if "error" in memory:
            print(f"\nmemory worker failed: {memory['error'][-500:]}")
        else:
            print(
                f"\nmax RSS growth while saving: {memory['save_growth'] / MiB:.1f} MiB vs host-cache budget "
                f"{memory['cache_bytes'] / MiB:.0f} MiB (+ stated constant 32 MiB) for a {memory['state_bytes'] / MiB:.0f} MiB "
                f"state, {memory['saves']} saves, cache peak {memory['cache_peak_used'] / MiB:.1f} MiB, "
                f"backpressure wait {memory['cache_wait_s']:.2f} s; load adds {memory['load_growth'] / MiB:.0f} MiB "
                f"of mapped (file-backed, reclaimable) pages"
            )
        summary["memory"] = memory
    if disk:
        if "skipped" in disk[0]:
            print(f"\nfull disk: skipped ({disk[0]['skipped']})")
        else:
            good = [
                d
                for d in disk
                if d.get("committed") == [[1, 3], [1, 3]]
                and not d.get("partial_left")
                and d.get("latest_after_failure") == 1
                and not d.get("iter2_loadable")
            ]
            summary["full_disk_failures"] = len(disk) - len(good)
            print(
                f"\nfull disk (64 MiB tmpfs): {len(good)} / {len(disk)} scenarios as specified (previous checkpoint "
                f"intact and latest, nothing partial left or loadable, next save commits once space is freed)"
            )
            for d in disk:
                if d not in good:
                    print(
                        f"  not as specified: ENOSPC at the {d['fill']}, on_error={d['on_error']}: committed "
                        f"{d.get('committed')}, left in iter_0000002: {d.get('partial_left')}"
                    )
        summary["full_disk"] = disk
    if hostile:
        bad = [h["attack"] for h in hostile if not h["as_specified"]]
        summary["hostile_failures"] = len(bad)
        print(
            f"\nhostile storage: {len(hostile) - len(bad)} / {len(hostile)} attacks as specified; bytes changed outside "
            f"the save directory: {sum(not h['outside_unchanged'] for h in hostile)}; slowest "
            f"{max(h['wall_s'] for h in hostile):.2f} s; largest memory growth "
            f"{max(h['rss_growth'] for h in hostile) / MiB:.1f} MiB"
        )
        for name in bad:
            print(f"  not as specified: {name}")
        summary["hostile"] = hostile
    silent = sum(c.get("silent", 0) for c in (corruption or {"by_place": {}})["by_place"].values())
    print(
        f"\ndata lost = {tot['lost']} (restarts that lost an acknowledged commit or could not load); "
        f"silent corruptions = {silent}"
    )
    print(f"wall time {wall:.0f} s")
    summary["data_lost"] = tot["lost"]
    summary["silent_corruptions"] = silent
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few injections per phase (~2 minutes)")
    p.add_argument("--spawn", action="store_true", help="fresh interpreters per rank instead of forks (slower)")
    p.add_argument("--no-demo", action="store_true", help="skip the demo-trainer (megatron-core) sweep")
    p.add_argument("--no-fulldisk", action="store_true", help="skip the tmpfs full-disk runs")
    p.add_argument(
        "--only", default=None, help="comma-separated sections: engine,restore,demo,corruption,memory,disk,hostile"
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dir", default=None, help="where to put the scratch checkpoints (default: $TMPDIR)")
    p.add_argument("--keep", action="store_true", help="keep the scratch checkpoints")
    p.add_argument("--json", default=None, help="also write the summary here")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    for module in (hashing, data_layout, file_format):
        module.warmup()  # forked ranks inherit the loaded kernels
    sections = set((a.only or "engine,restore,demo,corruption,memory,disk,hostile").split(","))
    if a.no_demo:
        sections.discard("demo")
    if a.no_fulldisk:
        sections.discard("disk")
    sweep = Sweep(a)
    t0 = time.perf_counter()
    corruption = memory = disk = hostile = None
    try:
        if "engine" in sections:
            sweep.engine_sweep()
        if "restore" in sections:
            sweep.restore_sweep()
        if "disk" in sections:
            disk = sweep.full_disk()
        if "demo" in sections:
            sweep.demo_sweep()
        if "memory" in sections:
            memory = sweep.memory()
        if "hostile" in sections:
            hostile = sweep.hostile()
        if "corruption" in sections:  # last: it runs restore threads in this process
            corruption = sweep.corruption_sweep()
    finally:
        if not a.keep:
            shutil.rmtree(sweep.tmp, ignore_errors=True)
    summary = summarize(sweep, corruption, memory, disk, hostile, time.perf_counter() - t0)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    failed = summary.get("full_disk_failures") or summary.get("hostile_failures")
    return 1 if summary["data_lost"] or summary["silent_corruptions"] or failed else 0


if __name__ == "__main__":
    sys.exit(main())
