"""The torch_dist export never hangs and never leaves anything behind (issue 35): a missing psutil is
named before anything starts; a rank whose child process dies (megatron-core's writer without psutil)
ends at once with that child's error, and a failing rank ends the others and the export at once with
its error; a timeout or a SIGTERM to the export kills its whole process group (the rank starter and
every rank) and removes the ``.export-*`` staging directory.  The stalled ranks are a fault point
(``DSM_HOLD_AT=export_worker``, before Megatron-LM is imported: the tree here is a stand-in with the
checkout's layout), the dying child a fork that raises, as megatron-core's does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.managers import one_checkpoint, stand_in_megatron_lm

from datastates_megatron.cli import EXIT_DAMAGED, EXIT_USAGE, main
from datastates_megatron.megatron.export import export_ranks
from datastates_megatron.megatron.export.worker_process import run_worker

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--", "--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8"]


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state not in "ZX":
            found.append(int(entry))
    return found


@pytest.fixture
def saved(tmp_path):
    return one_checkpoint(tmp_path / "ckpt")


@pytest.fixture
def tree(tmp_path):
    """A stand-in Megatron-LM checkout: its layout only (the held ranks never import it)."""
    return stand_in_megatron_lm(tmp_path / "megatron-lm")


def _staging(out: Path) -> list[str]:
    return [n for n in os.listdir(out) if n.startswith(".export-")] if out.exists() else []


def test_missing_psutil_is_named_before_anything_starts(saved, tree, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "psutil", None)
    out = tmp_path / "out"
    t0 = time.monotonic()
    code = main(["export", str(saved), str(out), "--megatron-lm", str(tree), *FLAGS])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and time.monotonic() - t0 < 10
    assert err.count("\n") == 1 and "torch_dist export needs psutil" in err and "pip install" in err, err
    assert not out.exists()


def test_a_worker_whose_child_dies_ends_at_once_with_the_childs_error():
    script = textwrap.dedent(
        """
        import multiprocessing as mp
        from datastates_megatron.megatron.export.worker_process import watch_children

        def write():  # megatron-core's writer without psutil: raises before it answers
            raise RuntimeError("psutil is not installed, please install it with `pip install psutil`")

        if __name__ == "__main__":
            watch_children(0.05)
            ctx = mp.get_context("fork")
            count = ctx.JoinableQueue()
            count.put(0)
            ctx.Process(target=write).start()
            count.join()  # as megatron-core waits for its writers: forever, without the watch
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    done = run_worker([sys.executable, "-c", script], env, 120, marker="OK", prefix="worker: ")
    assert time.monotonic() - t0 < 60
    assert done.returncode == 1 and not done.done, done
    assert "psutil is not installed" in done.tail and "failed (exit 1): ending the worker" in done.tail, done.tail


def test_a_timeout_kills_the_whole_worker_group():
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', 'dsm-grandchild-marker']); time.sleep(600)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = run_worker([sys.executable, "-c", script, "dsm-child-marker"], env, 2, marker="OK", prefix="worker: ")
    assert done.returncode is None and done.how == "did not finish in time (killed)"
    assert not _processes_naming("dsm-child-marker") and not _processes_naming("dsm-grandchild-marker")


def test_a_failing_rank_ends_the_others_and_the_export_at_once_with_its_error():
    rank = (
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.exit('rank 1: RuntimeError: the checkpoint has another layout')\n"
        "time.sleep(600)\n"
    )
    starter = [sys.executable, "-m", export_ranks.__name__, "start", "--nproc", "3", "--"]
    starter += [sys.executable, "-c", rank, "dsm-rank-marker"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    done = run_worker(starter, env, 120, marker=export_ranks.DONE, prefix="export: ")
    assert time.monotonic() - t0 < 60
    assert done.returncode == 1 and not done.done, done
    assert "rank 1: RuntimeError: the checkpoint has another layout" in done.tail, done.tail
    assert "rank 1 failed (exit 1): ending the other ranks" in done.tail, done.tail
    assert not _processes_naming("dsm-rank-marker")


def test_every_rank_succeeding_is_reported_done():
    starter = [sys.executable, "-m", export_ranks.__name__, "start", "--nproc", "2", "--"]
    # one write of a line each (below PIPE_BUF: atomic), so the two ranks' lines never interleave
    line = "os.write(1, f\"hello from {os.environ['RANK']} {os.environ['WORLD_SIZE']}\\n\".encode())"
    starter += [sys.executable, "-c", f"import os; {line}"]
    done = run_worker(starter, {**os.environ, "PYTHONPATH": str(ROOT)}, 60, marker=export_ranks.DONE, prefix="")
    assert done.returncode == 0 and done.done, done
    assert "hello from 0 2" in done.tail and "hello from 1 2" in done.tail, done.tail


pytest.importorskip("psutil")


def test_a_rank_failing_in_megatron_lm_ends_the_export_with_one_line(saved, tree, tmp_path, capsys):
    out = tmp_path / "out-fail"
    code = main(["export", str(saved), str(out), "--megatron-lm", str(tree), "--timeout-s", "120", *FLAGS])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert code == EXIT_DAMAGED and last.startswith("datastates-ckpt: error: torch_dist export of iteration 1"), err
    assert "failed (rank 0 failed (exit" in last and "the ranks' output is above" in last, last
    assert _staging(out) == [] and not (out / "iter_0000001").exists() and not _processes_naming(str(out))


def test_export_timeout_leaves_no_worker_and_no_staging(saved, tree, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSM_HOLD_AT", "export_worker")
    out = tmp_path / "out-timeout"
    code = main(["export", str(saved), str(out), "--megatron-lm", str(tree), "--timeout-s", "3", *FLAGS])
    err = capsys.readouterr().err
    assert code == EXIT_DAMAGED and "did not finish within 3 s (killed)" in err, err
    assert "export: rank 0 started (pid" in err, err
    assert _staging(out) == [] and not _processes_naming(str(out))


def test_sigterm_to_the_export_kills_the_ranks_and_removes_the_staging(saved, tree, tmp_path):
    out = tmp_path / "out-sigterm"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DSM_HOLD_AT": "export_worker"}
    cli = subprocess.Popen(
        [sys.executable, "-m", "datastates_megatron.cli", "export", str(saved), str(out)]
        + ["--megatron-lm", str(tree), *FLAGS],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        for line in cli.stderr:  # the rank says it started (and then holds)
            lines.append(line)
            if line.startswith("export: rank 0 started (pid"):
                break
        assert lines and lines[-1].startswith("export: rank 0 started"), lines
        assert _staging(out) and len(_processes_naming(str(out))) >= 2  # the starter and the rank
        cli.send_signal(signal.SIGTERM)
        rest = cli.stderr.read()
        assert cli.wait(timeout=60) == -signal.SIGTERM, rest
    finally:
        cli.kill()
        cli.wait()
    assert "terminated by SIGTERM" in rest, rest
    assert _staging(out) == [] and not _processes_naming(str(out))
