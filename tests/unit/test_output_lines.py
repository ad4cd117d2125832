"""Every line a child process prints on a shared pipe is one write (issue 42: the export's two ranks
printed "rank N started" with ``print``, whose text and newline are two writes under
``PYTHONUNBUFFERED``; the lines interleaved and a test failed by chance).  Checked deterministically:
each ``write`` call the process makes is recorded as it happens, and must be one whole line."""

from __future__ import annotations

import ast
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from datastates_megatron._output import write_line
from datastates_megatron.megatron.export import export_ranks

ROOT = Path(__file__).resolve().parents[2]
# where processes share a pipe: the export's starter and ranks, the demo's trainers, the tests' workers
SHARED_PIPE_WRITERS = [
    "datastates_megatron/megatron/export",
    "datastates_megatron/megatron/cpu",
    "datastates_megatron/demo",
    "tests/workers",
    "tests/distributed/ranks.py",
]
# a process whose stdout records every write call, as one os.write each, then runs export_ranks
RECORDED = """
import json, os, sys

class Calls:
    def write(self, text):
        os.write(1, ("WRITE " + json.dumps(text) + "\\n").encode())
        return len(text)

    def flush(self):
        pass

sys.stdout = Calls()
from datastates_megatron.megatron.export.export_ranks import main
sys.exit(main(sys.argv[1:]))
"""


class _Calls:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.flushes = 0

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        self.flushes += 1


def test_write_line_is_one_call_of_one_whole_line():
    out = _Calls()
    write_line("rank 0 started (pid 1)", out)
    write_line("", out)
    write_line(7, out)
    assert out.calls == ["rank 0 started (pid 1)\n", "\n", "7\n"] and out.flushes == 3


def test_no_print_where_processes_share_a_pipe():
    found = []
    for entry in SHARED_PIPE_WRITERS:
        path = ROOT / entry
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                    found.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert found == [], f"print() writes a line in two calls: use _output.write_line: {found}"


def test_the_exports_rank_lines_are_whole_lines(tmp_path):
    """The real starter and ranks (held after they announce themselves), unbuffered as the export runs
    them: every write call of each is one whole line."""
    nproc = 4
    script = tmp_path / "script.py"
    script.write_text("raise SystemExit('never run: the rank holds before')\n")
    rank = [sys.executable, "-c", RECORDED, "rank", str(script)]
    starter = [sys.executable, "-c", RECORDED, "start", "--nproc", str(nproc), "--", *rank]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "DSM_HOLD_AT": "export_worker"}
    proc = subprocess.Popen(starter, stdout=subprocess.PIPE, env=env, start_new_session=True)
    calls, buffer, deadline = [], b"", time.monotonic() + 240
    try:
        while sum(c.startswith("rank ") for c in calls) < nproc:
            left = deadline - time.monotonic()
            assert left > 0 and proc.poll() is None, (proc.poll(), calls)
            if select.select([proc.stdout], [], [], left)[0]:
                chunk = os.read(proc.stdout.fileno(), 65536)
                assert chunk, calls
                buffer += chunk
                *records, buffer = buffer.split(b"\n")
                calls += [json.loads(r.decode().removeprefix("WRITE ")) for r in records]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the starter and the held ranks: our session
        proc.wait()
        proc.stdout.close()
    whole = re.compile(rf"^(started {nproc} ranks \(pids( \d+){{{nproc}}}\)|rank [0-9] started \(pid \d+\))\n$")
    assert [c for c in calls if not whole.match(c)] == [], calls
    assert sorted(c.split(" (")[0] for c in calls if c.startswith("rank ")) == [
        f"rank {r} started" for r in range(nproc)
    ]
    assert export_ranks.DONE not in "".join(calls)
