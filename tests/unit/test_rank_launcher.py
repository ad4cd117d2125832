"""The tests' launcher: ranks forked from a warm server must still behave as ``python script``; a
function rank reports its result; a command's timeout or kill reaches every process under it."""

import sys
import textwrap

import psutil
import pytest

from tests.distributed.ranks import run_command, run_ranks

SCRIPT = textwrap.dedent("""
    import atexit, json, os, sys, threading, time

    out = sys.argv[1]
    rank = os.environ["RANK"]

    def late():
        time.sleep(0.3)
        open(os.path.join(out, "thread-" + rank), "w").close()

    threading.Thread(target=late).start()  # non-daemon: joined before exit
    atexit.register(lambda: open(os.path.join(out, "atexit-" + rank), "w").close())
    print("RESULT " + json.dumps({"rank": int(rank), "argv": sys.argv[1:], "name": __name__,
                                  "pid": os.getpid(), "sid": os.getsid(0), "flag": os.environ.get("FLAG")}))
    sys.stdout.flush()
    if len(sys.argv) > 2:
        sys.exit(int(sys.argv[2]))
""")


@pytest.fixture(params=["forked", "fresh"])
def launcher(request, monkeypatch):
    if request.param == "fresh":
        monkeypatch.setenv("DSM_TEST_FRESH_INTERPRETERS", "1")
    return request.param


def test_each_rank_is_its_own_main_process_with_its_env_threads_and_atexit(tmp_path, launcher):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    res = run_ranks(str(script), 2, [str(tmp_path)], rank_env={1: {"FLAG": "one"}}, timeout=60)
    assert [r["returncode"] for r in res] == [0, 0], res
    got = [r["result"] for r in res]
    assert [g["rank"] for g in got] == [0, 1] and all(g["name"] == "__main__" for g in got)
    assert all(g["argv"] == [str(tmp_path)] for g in got)
    assert [g["flag"] for g in got] == [None, "one"]  # one rank's environment does not leak into another's
    assert got[0]["pid"] != got[1]["pid"] and all(g["sid"] == g["pid"] for g in got)  # own session each
    for rank in (0, 1):
        assert (tmp_path / f"thread-{rank}").exists() and (tmp_path / f"atexit-{rank}").exists()


def test_exit_status_and_a_failed_rank_stops_the_others(tmp_path, launcher):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT + "\ntime.sleep(60)\n")
    res = run_ranks(str(script), 2, [str(tmp_path), "3"], rank_env={1: {"RANK": "1"}}, timeout=60)
    assert [r["returncode"] for r in res] == [3, 3], res
    blocked = tmp_path / "blocked.py"
    blocked.write_text(SCRIPT.replace("if len(sys.argv) > 2:", "if os.environ['RANK'] == '0':") + "\ntime.sleep(60)\n")
    res = run_ranks(str(blocked), 2, [str(tmp_path), "5"], timeout=60)
    assert res[0]["returncode"] == 5 and res[1]["returncode"] == -9, res  # the survivor is killed, not waited for
    assert not res[0]["timed_out"]


def test_a_rank_that_writes_more_than_a_pipe_holds_is_not_stalled(tmp_path, launcher):
    script = tmp_path / "talker.py"
    script.write_text("import sys\nsys.stderr.write('x' * (1 << 20))\nprint('RESULT {\"done\": true}')\n")
    res = run_ranks(str(script), 1, [], timeout=30)
    assert res[0]["returncode"] == 0 and res[0]["result"] == {"done": True} and not res[0]["timed_out"]
    assert len(res[0]["stderr"]) == 1 << 20


def test_a_function_rank_returns_its_result_and_a_failed_one_stops_the_others():
    res = run_ranks(_rank, 2, ["ok"], timeout=60)
    assert [(r["returncode"], r["result"]) for r in res] == [(0, {"rank": 0}), (0, {"rank": 1})], res
    res = run_ranks(_rank, 2, ["rank 1 fails"], timeout=60)
    assert res[1]["returncode"] == 1 and "rank 1 fails" in res[1]["stderr"], res
    assert res[0]["returncode"] == -9 and not res[0]["timed_out"], res  # blocked: killed, not waited for


def _rank(args: list[str]) -> dict:
    import os
    import time

    if args[0] != "ok":
        if os.environ["RANK"] == "1":
            raise RuntimeError(args[0])
        time.sleep(60)  # as if blocked in a collective
    return {"rank": int(os.environ["RANK"])}


# A launcher like torchrun: its worker runs in a session of its own and writes its pid, then sleeps.
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    worker = "import os, signal, sys, time\\n" \\
        "signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1] + '.term', 'w').close(), sys.exit(0)))\\n" \\
        "open(sys.argv[1], 'w').write(str(os.getpid()))\\n" \\
        "time.sleep(120)\\n"
    p = subprocess.Popen([sys.executable, "-c", worker, sys.argv[1]], start_new_session=True)
    print("launched", flush=True)
    p.wait()
    time.sleep(120 if len(sys.argv) > 2 else 0)
""")


def _launcher(tmp_path, *extra: str) -> tuple[list[str], object]:
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    return [sys.executable, str(script), str(tmp_path / "worker.pid"), *extra], tmp_path / "worker.pid"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("how", ["timeout", "kill_when"])
def test_a_command_timed_out_or_killed_takes_every_process_under_it(tmp_path, how):
    cmd, pid_file = _launcher(tmp_path)
    if how == "timeout":
        done = run_command([cmd], timeout=3)
    else:
        done = run_command([cmd], timeout=60, kill_when=pid_file.exists)
    assert done.timed_out == (how == "timeout") and done.returncode == -9, done
    assert "launched" in done.stdout and _gone(int(pid_file.read_text()))


def test_term_when_signals_the_workers_and_lets_the_run_finish(tmp_path):
    cmd, pid_file = _launcher(tmp_path)
    with open(tmp_path / "log", "w") as log:
        done = run_command([cmd], timeout=60, log=log, term_when=pid_file.exists)
    assert done.returncode == 0 and not done.timed_out, done
    assert (tmp_path / "worker.pid.term").exists() and "launched" in (tmp_path / "log").read_text()
