"""The multi-rank launcher forks ranks from a warm server: each must still behave as ``python script``."""

import textwrap

import pytest

from tests.distributed.ranks import run_ranks

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
