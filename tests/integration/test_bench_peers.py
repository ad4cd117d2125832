"""Integration smoke test of ``scripts/bench_peers.py`` (the peer benchmark, issue 7).

Runs the script under torchrun on 2 CPU gloo ranks with a tiny GPT, 3 measured iterations per
engine and only the fast engines (megatron-core ``dist_checkpointing`` is left out: it has hung on
small models on gloo), and checks that the JSON has every engine's keys, that every restore was
verified bit for bit, and that the plot was written.  A second launch with a tiny
``--engine-timeout`` checks that an overrunning phase is reported as ``timeout`` (exit status 3,
partial JSON written) instead of hanging.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.distributed.ranks import Finished, torchrun

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_peers.py"
TINY = [
    "--layers",
    "2",
    "--hidden",
    "64",
    "--heads",
    "4",
    "--seq-len",
    "32",
    "--vocab",
    "256",
    "--iters",
    "3",
    "--warmup",
    "1",
    "--no-progress",
]
FAST_ENGINES = ("baseline", "torch_save", "dcp_async", "ours", "ours_local", "ours_replicated", "control")
LAUNCH_TIMEOUT_S = 120.0


def _launch(tmp_path: Path, *extra: str) -> tuple[Finished, Path]:
    pytest.importorskip("megatron.core")
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    out = tmp_path / "bench.json"
    args = [*TINY, "--dir", str(tmp_path / "ckpt"), "--json", str(out), *extra]
    proc = torchrun(SCRIPT, 2, args, cwd=tmp_path, timeout=LAUNCH_TIMEOUT_S)
    if proc.timed_out:
        pytest.fail(f"bench_peers.py did not finish in {LAUNCH_TIMEOUT_S}s:\n{proc.stderr[-4000:]}")
    return proc, out


def test_fast_engines_report_every_key(tmp_path):
    proc, out = _launch(
        tmp_path,
        "--engines",
        ",".join(FAST_ENGINES),
        "--intervals",
        "1,2",
        "--sweep-engines",
        "torch_save",
        "--probe-mb",
        "4",
        "--dcp-checkpointer",
        "thread",
        "--plot",
        str(tmp_path / "bench.png"),
        "--rounds",
        "2",
        "--local-dir",
        str(tmp_path / "local"),
        "--persist-interval",
        "3",
    )
    if proc.returncode != 0:
        errors = ""
        if out.exists():
            doc = json.loads(out.read_text())
            errors = "\n".join(f"{n}: {r['status']} {r['error']}" for n, r in doc["engines"].items())
        pytest.fail(f"rc={proc.returncode}\n{errors}\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
    doc = json.loads(out.read_text())
    assert list(doc["engines"]) == list(FAST_ENGINES)
    keys = {name: sorted(res) for name, res in doc["engines"].items()}
    assert len({tuple(k) for k in keys.values()}) == 1, keys  # every engine reports the same fields
    for name, res in doc["engines"].items():
        assert res["status"] == "ok", (name, res["error"])
        assert res["iterations"] == 6 and len(res["iter_times_s"]) == 6  # 2 rounds x 3
        assert len(res["rounds"]) == 2 and len(res["ratio_e2e_rounds"]) == 2
        assert res["ratio_e2e"] is not None and res["ratio_median"] is not None
        if name in ("baseline", "control"):  # control: a second no-checkpoint run (A/A)
            assert res["checkpoints"] == 6 and res["restore_ok"] is None and res["bytes_per_ckpt"] is None
            assert (
                res["ratio_e2e_rounds"] == [1.0, 1.0]
                if name == "baseline"
                else all(0.3 < r < 3 for r in res["ratio_e2e_rounds"])
            )
            continue
        assert res["checkpoints"] == 6
        assert res["bytes_per_ckpt"] and res["bytes_per_ckpt"] > 0, name
        assert res["restore_ok"] is True, (name, res["restore_mismatches"])
        assert res["restore_iteration"] == 1 + 3, name  # warm-up 1 + 3 measured, last one saved
        # (ours_local: 4 is only in the local tier -- every 3rd is promoted -- and is still the one restored)
        assert res["restore_s"] > 0 and res["drain_s"] >= 0 and res["stall_per_ckpt_s"] >= 0

    replicated = doc["engines"]["ours_replicated"]
    assert replicated["replication_gbps"] > 0 and replicated["replication_bytes_per_rank"] > 0
    loss = replicated["node_loss"]
    assert replicated["node_loss_ok"] is True  # the partner restore is bit-exact
    assert loss["partner"]["iteration"] == 4 and loss["partner"]["lost_iterations"] == 0
    assert 0 < loss["partner"]["fetched"] < loss["partner"]["bytes"]  # rank 1's file only, over the wire
    assert "replicas/r00001" in loss["partner"]["from"][1], loss  # rank 1's node was the lost one
    assert loss["persistent"]["iteration"] == 3 and loss["persistent"]["lost_iterations"] == 1  # every 3rd persisted
    assert re.search(r"^partner .* 0 ", proc.stdout, re.M) and "replication (ours_replicated" in proc.stdout

    sweep = doc["sweep"]["torch_save"]["2"]
    assert sweep["status"] == "ok" and sweep["checkpoints"] == 1 and sweep["ratio_e2e"] is not None
    machine = doc["machine"]
    for key in ("memcpy_GBps_per_rank", "write_fsync_GBps", "read_cold_GBps"):
        assert machine[key] > 0, key
    assert doc["config"]["world_size"] == 2 and doc["config"]["params"] > 0
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert "ours" in proc.stdout and "overhead vs checkpoint interval" in proc.stdout
    floor = re.search(r"^floor: .*\(([\d.]+) s: \+([\d.]+)\) -> ([\d.]+)x", proc.stdout, re.M)
    assert floor, proc.stdout
    smallest = min(r["bytes_per_ckpt"] for r in doc["engines"].values() if r["bytes_per_ckpt"])
    assert float(floor.group(1)) == pytest.approx(smallest / (machine["write_fsync_GBps"] * 1e9), abs=0.0015)
    assert float(floor.group(3)) >= 1 + float(floor.group(2)) - 0.001  # copies add to the write
    assert doc["floor"]["ratio_e2e"] == pytest.approx(float(floor.group(3)), abs=0.0015)
    assert not (tmp_path / "ckpt" / "ours-every1").exists(), "engine directories are cleaned"
    assert not any((tmp_path / "local").iterdir()), "the local tier is cleaned"


def test_overrunning_phase_is_reported_as_timeout(tmp_path):
    proc, out = _launch(
        tmp_path,
        "--engines",
        "baseline,torch_save",
        "--sweep-engines",
        "",
        "--probe-mb",
        "0",
        "--engine-timeout",
        "0.001",
    )
    assert proc.returncode != 0
    doc = json.loads(out.read_text())
    assert doc["engines"]["baseline"]["status"] == "timeout"
    assert "engine-timeout" in doc["engines"]["baseline"]["error"]
    assert doc["engines"]["torch_save"]["status"] == "skipped"
    assert "timeout" in proc.stdout
