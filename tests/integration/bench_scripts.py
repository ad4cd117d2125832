"""Running a benchmark script of ``scripts/`` as a user does, for its smoke test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_json(script: str, args: list[str], cwd: Path, timeout: float) -> dict:
    """``python scripts/<script> ARGS`` (which must print one JSON document): the document, after
    asserting the script exited 0 (its stderr's tail in the message)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)
