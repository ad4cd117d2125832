"""The ``datastates-ckpt`` CLI against real checkpoints written by CheckpointManager (world size 1)."""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from datastates_megatron.cli import EXIT_DAMAGED, EXIT_OK, EXIT_USAGE, main
from datastates_megatron.engine import EngineOptions, RankFile
from datastates_megatron.engine.format.file_format import HEADER_BYTES
from datastates_megatron.engine.manager import CheckpointManager


def _state():
    g = torch.Generator().manual_seed(0)
    ts = {f"layer{i}.weight": torch.randn(64, 32, generator=g) for i in range(6)}
    ts["big"] = torch.randn(600_000, generator=g)  # 2.4 MB: several checksum chunks
    ts["bf16"] = torch.randn(7, 9, generator=g).to(torch.bfloat16)
    ts["mask"] = torch.rand(17, generator=g) > 0.5
    return ts


@pytest.fixture()
def save_dir(tmp_path):
    """iter 100 and 200 committed (200 latest), plus an uncommitted iter 300 added afterwards."""
    root = tmp_path / "ckpt"
    ts = _state()
    opts = EngineOptions(cache_bytes=1 << 20, chunk_bytes=256 << 10, timeout_s=30)
    with CheckpointManager(str(root), opts, layout={"tp": 1, "pp": 1}, keep_last=0) as mgr:
        for n, t in ts.items():
            mgr.register(n, t, meta={"role": "bias"} if n == "bf16" else None)
        objects = {"iteration": 100, "args": argparse.Namespace(lr=0.1), "rng": [1, 2, 3]}
        assert mgr.save(100, objects, {"consumed_samples": 1600})
        mgr.wait()
        assert mgr.save(200, {"iteration": 200}, {"consumed_samples": 3200})
    os.makedirs(root / "iter_0000300")
    (root / "iter_0000300" / "r00000-0000000000000000-000009.dsck").write_bytes(b"partial")
    return root


def _rank_file(ckpt):
    (path,) = glob.glob(os.path.join(ckpt, "*.dsck"))
    return path


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_lists_committed_uncommitted_latest_and_tracker(save_dir, capsys):
    code, out, err = _run(capsys, "ls", save_dir)
    assert code == EXIT_OK and err == ""
    lines = out.splitlines()
    row = {int(ln.split()[0]): ln for ln in lines if ln.strip() and ln.split()[0].isdigit()}
    assert set(row) == {100, 200, 300}
    assert "committed" in row[100] and "persistent" in row[100] and "latest" not in row[100]
    assert "committed" in row[200] and "<- latest" in row[200]
    assert "uncommitted" in row[300]
    assert "latest: 200" in out and "tracker: 200 (agrees)" in out


def test_ls_json_has_stable_keys_and_values(save_dir, capsys):
    code, out, _ = _run(capsys, "ls", save_dir, "--json")
    assert code == EXIT_OK
    doc = json.loads(out)
    assert doc["command"] == "ls" and doc["latest"] == 200 and doc["tracker"] == 200 and doc["tracker_agrees"] is True
    by_it = {c["iteration"]: c for c in doc["checkpoints"]}
    assert [c["iteration"] for c in doc["checkpoints"]] == [100, 200, 300]
    keys = {
        "iteration",
        "path",
        "state",
        "format",
        "tier",
        "world_size",
        "bytes",
        "data_bytes",
        "files",
        "commit_seq",
        "created",
        "age_s",
        "latest",
        "error",
    }
    assert all(set(c) == keys for c in doc["checkpoints"])
    assert by_it[200]["state"] == "committed" and by_it[200]["latest"] and by_it[200]["world_size"] == 1
    assert by_it[200]["tier"] == "persistent" and by_it[200]["bytes"] > by_it[200]["data_bytes"] > 2_400_000
    assert by_it[300]["state"] == "uncommitted" and by_it[300]["tier"] is None and by_it[300]["files"] == 1


def test_ls_labels_megatron_native_checkpoints_foreign_not_uncommitted(save_dir, capsys):
    native = save_dir / "iter_0000500"
    native.mkdir()
    for name in ("common.pt", ".metadata", "__0_0.distcp", "metadata.json"):
        (native / name).write_bytes(os.urandom(64))
    (save_dir / "iter_0000050" / "mp_rank_00").mkdir(parents=True)
    (save_dir / "iter_0000050" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"x")
    (save_dir / ".datastates.lock").write_text("{}\n")  # our lock file is not a checkpoint
    code, out, _ = _run(capsys, "ls", save_dir)
    assert code == EXIT_OK
    row = {int(ln.split()[0]): ln for ln in out.splitlines() if ln.strip() and ln.split()[0].isdigit()}
    assert set(row) == {50, 100, 200, 300, 500}
    assert "foreign (torch_dist)" in row[500] and "uncommitted" not in row[500]
    assert "foreign (torch)" in row[50]
    assert "uncommitted" in row[300] and "<- latest" in row[200]
    code, out, _ = _run(capsys, "ls", save_dir, "--json")
    by_it = {c["iteration"]: c for c in json.loads(out)["checkpoints"]}
    assert (by_it[500]["state"], by_it[500]["format"]) == ("foreign", "torch_dist")
    assert (by_it[50]["state"], by_it[50]["format"]) == ("foreign", "torch")
    assert (by_it[300]["state"], by_it[300]["format"]) == ("uncommitted", None)
    assert by_it[200]["format"] is None and not by_it[500]["latest"]


def test_ls_shows_damaged_manifest_and_that_the_loader_refuses(save_dir, capsys):
    os.makedirs(save_dir / "iter_0000050")
    (save_dir / "iter_0000050" / "manifest.json").write_text("{ not json")
    code, out, _ = _run(capsys, "ls", save_dir)
    assert code == EXIT_DAMAGED  # as the help says (issue 35: it was 0)
    assert any(ln.split()[:2] == ["50", "DAMAGED"] for ln in out.splitlines())
    assert "manifest is not valid JSON" in out and "loader refuses" in out
    doc = json.loads(_run(capsys, "ls", save_dir, "--json")[1])
    damaged = [c for c in doc["checkpoints"] if c["iteration"] == 50][0]
    assert damaged["state"] == "damaged" and "not valid JSON" in damaged["error"]
    assert doc["latest"] is None and "not valid JSON" in doc["latest_error"] and doc["tracker_agrees"] is None


def test_ls_missing_dir_is_one_line_error(tmp_path, capsys):
    code, out, err = _run(capsys, "ls", tmp_path / "nope")
    assert code == EXIT_USAGE and out == ""
    assert err.count("\n") == 1 and "no such directory" in err and "Traceback" not in err


def test_inspect_shows_manifest_ranks_dtypes_and_objects(save_dir, capsys):
    code, out, _ = _run(capsys, "inspect", save_dir / "iter_0000100")
    assert code == EXIT_OK
    assert "iteration 100" in out and "world size 1" in out and "tier persistent" in out
    assert '"consumed_samples": 1600' in out and '"tp": 1' in out
    assert os.path.basename(_rank_file(save_dir / "iter_0000100")) in out
    assert "tensors: 9" in out and "float32" in out and "bfloat16" in out and "bool" in out
    assert "iteration  int = 100" in out and "Namespace (1 fields)" in out and "list (3)" in out
    assert "layer0.weight" not in out  # counts only without --tensors


def test_inspect_tensors_and_json(save_dir, capsys):
    code, out, _ = _run(capsys, "inspect", save_dir / "iter_0000100", "--tensors", "--rank", "0")
    assert code == EXIT_OK and "layer5.weight" in out and "[600000]" in out and "2400000" in out
    code, out, _ = _run(capsys, "inspect", save_dir / "iter_0000100", "--json", "--tensors")
    doc = json.loads(out)
    assert doc["manifest"]["iteration"] == 100 and doc["manifest"]["metadata"] == {"consumed_samples": 1600}
    assert doc["manifest"]["layout"] == {"tp": 1, "pp": 1} and doc["manifest"]["tier"] == "persistent"
    (r0,) = doc["ranks"]
    assert r0["error"] is None and r0["tensor_count"] == 9 and r0["tensor_meta_count"] == 1
    assert set(r0["objects"]) == {"iteration", "args", "rng"}
    t = {x["name"]: x for x in r0["tensors"]}
    assert t["big"] == {"name": "big", "dtype": "float32", "shape": [600000], "bytes": 2_400_000, "chunks": 10}
    assert t["bf16"]["dtype"] == "bfloat16" and t["mask"]["dtype"] == "bool"
    assert r0["dtypes"]["float32"]["count"] == 7
    doc = json.loads(_run(capsys, "inspect", save_dir / "iter_0000200", "--json")[1])
    assert doc["ranks"][0]["tensors"] is None and doc["ranks"][0]["objects"] == {"iteration": "int = 200"}


def test_inspect_errors_are_one_line(save_dir, capsys):
    code, _, err = _run(capsys, "inspect", save_dir / "iter_0000300")
    assert code == EXIT_USAGE and "not a committed checkpoint" in err and err.count("\n") == 1
    code, _, err = _run(capsys, "inspect", save_dir)
    assert code == EXIT_USAGE and "try `datastates-ckpt ls" in err
    code, _, err = _run(capsys, "inspect", save_dir / "iter_0000100", "--rank", "1")
    assert code == EXIT_USAGE and "--rank 1 is not in this checkpoint" in err
    (save_dir / "iter_0000100" / "manifest.json").write_text('{"format": "something else"}')
    code, _, err = _run(capsys, "inspect", save_dir / "iter_0000100")
    assert code == EXIT_DAMAGED and "damaged manifest" in err and "Traceback" not in err


def test_verify_clean_checkpoint(save_dir, capsys):
    code, out, err = _run(capsys, "verify", save_dir / "iter_0000200", "--threads", "2")
    assert code == EXIT_OK and "ERROR" not in out and out.splitlines()[-1].startswith("OK iter_0000200")
    assert err == ""  # no bar when stderr is not a terminal, and no line in under --progress-every
    code, out, err = _run(capsys, "verify", save_dir / "iter_0000200", "--progress-every", "1e-9")
    lines = err.splitlines()
    assert code == EXIT_OK and lines and all(x.startswith("verify: ") and "GB/s, ETA" in x for x in lines), err
    assert "(100%)" in lines[-1] and "\r" not in err  # log lines for a Slurm log, not a redrawn bar
    assert _run(capsys, "verify", save_dir / "iter_0000200", "--progress-every", "0")[0] == EXIT_USAGE
    doc = json.loads(_run(capsys, "verify", save_dir / "iter_0000200", "--json")[1])
    assert doc["ok"] and doc["errors"] == [] and doc["tensors_checked"] == 9 and doc["bytes_checked"] > 2_400_000


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_verify_flipped_byte_names_rank_file_and_tensor(save_dir, capsys):
    ckpt = save_dir / "iter_0000200"
    path = _rank_file(ckpt)
    with RankFile(path) as rf:
        big, layer3 = rf.entries["big"], rf.entries["layer3.weight"]
        chunk = rf.header.chunk_bytes
    _flip(path, big.offset + 3 * chunk + 5)
    _flip(path, layer3.offset + 100)
    code, out, _ = _run(capsys, "verify", ckpt)
    assert code == EXIT_DAMAGED
    errors = [ln for ln in out.splitlines() if ln.startswith("ERROR")]
    assert len(errors) == 2  # one line per bad tensor
    name = os.path.basename(path)
    assert any(f"rank 0: {name}: tensor 'big': checksum mismatch in chunk(s) 3 " in ln for ln in errors)
    assert any("tensor 'layer3.weight'" in ln and name in ln for ln in errors)
    assert out.splitlines()[-1].startswith("FAILED iter_0000200")
    doc = json.loads(_run(capsys, "verify", ckpt, "--json")[1])
    assert not doc["ok"]
    bad = {e["tensor"]: e for e in doc["errors"]}
    assert set(bad) == {"big", "layer3.weight"}
    assert bad["big"] == {**bad["big"], "rank": 0, "file": name, "kind": "checksum", "chunks": [3]}


def test_verify_damaged_header_names_rank_and_file(save_dir, capsys):
    ckpt = save_dir / "iter_0000200"
    path = _rank_file(ckpt)
    _flip(path, 20)
    code, out, _ = _run(capsys, "verify", ckpt)
    assert code == EXIT_DAMAGED
    assert f"ERROR rank 0: {os.path.basename(path)}: header checksum mismatch; its 9 tensor(s) cannot be checked" in out


def test_verify_truncated_file(save_dir, capsys):
    ckpt = save_dir / "iter_0000100"
    path = _rank_file(ckpt)
    size = os.path.getsize(path)
    os.truncate(path, HEADER_BYTES + 1000)
    code, out, _ = _run(capsys, "verify", ckpt)
    assert code == EXIT_DAMAGED
    (line,) = [ln for ln in out.splitlines() if ln.startswith("ERROR")]
    assert line.startswith(f"ERROR rank 0: {os.path.basename(path)}: file is truncated")
    assert f"{HEADER_BYTES + 1000} bytes, manifest says {size}" in line and "9 tensor(s) cannot be checked" in line
    doc = json.loads(_run(capsys, "verify", ckpt, "--json")[1])
    assert [(e["rank"], e["kind"], e["tensor"]) for e in doc["errors"]] == [(0, "size", None)]


def test_verify_missing_file_and_missing_dir(save_dir, capsys):
    ckpt = save_dir / "iter_0000100"
    path = _rank_file(ckpt)
    os.unlink(path)
    code, out, _ = _run(capsys, "verify", ckpt)
    assert code == EXIT_DAMAGED and f"ERROR rank 0: {os.path.basename(path)}: file is missing" in out
    code, out, err = _run(capsys, "verify", save_dir / "iter_0000999")
    assert code == EXIT_USAGE and out == "" and "no such checkpoint directory" in err and err.count("\n") == 1


def test_a_checkpoint_gone_since_it_was_listed_says_retention_may_have_removed_it(save_dir, capsys):
    """A reader that lists, then verifies, while the trainer saves: the iteration it picked is older
    than what is committed now, so the message says what most likely happened."""
    shutil.rmtree(save_dir / "iter_0000100")
    code, out, err = _run(capsys, "verify", save_dir / "iter_0000100")
    assert code == EXIT_USAGE and out == "" and err.count("\n") == 1
    assert "no such checkpoint directory" in err and "retention" in err and "iteration 200" in err, err
    code, _, err = _run(capsys, "inspect", save_dir / "iter_0000999")
    assert code == EXIT_USAGE and "retention" not in err


def test_a_checkpoint_directory_we_may_not_read_is_not_called_missing(save_dir, capsys, monkeypatch):
    ckpt = str(save_dir / "iter_0000100")
    real_stat = os.stat

    def denied(path, *a, **k):  # as for a non-root reader under a save root of mode 000
        if os.fspath(path) == ckpt:
            raise PermissionError(13, "Permission denied", ckpt)
        return real_stat(path, *a, **k)

    monkeypatch.setattr(os, "stat", denied)
    code, out, err = _run(capsys, "verify", ckpt)
    assert code == EXIT_USAGE and out == "" and err.count("\n") == 1
    assert "permission denied" in err.lower() and "no such" not in err, err


def test_an_unforeseen_error_is_one_line_not_a_traceback(save_dir, capsys, monkeypatch):
    from datastates_megatron.engine.format import manifest

    def boom(_):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(manifest, "read_manifest", boom)
    code, out, err = _run(capsys, "inspect", save_dir / "iter_0000100")
    assert code == EXIT_DAMAGED and out == "" and err.count("\n") == 1
    assert "unexpected RecursionError" in err and "DSM_DEBUG=1" in err
    monkeypatch.setenv("DSM_DEBUG", "1")
    with pytest.raises(RecursionError):
        main(["inspect", str(save_dir / "iter_0000100")])


def test_verify_file_from_another_save_is_rejected(save_dir, capsys):
    """A valid file of the same size, but not the one the manifest committed (another iteration's)."""
    with CheckpointManager(
        str(save_dir), EngineOptions(cache_bytes=1 << 20, timeout_s=30), layout={"tp": 1, "pp": 1}, keep_last=0
    ) as mgr:
        for n, t in _state().items():
            mgr.register(n, t, meta={"role": "bias"} if n == "bf16" else None)
        mgr.save(210, {"iteration": 210})
    src, dst = _rank_file(save_dir / "iter_0000210"), _rank_file(save_dir / "iter_0000200")
    assert os.path.getsize(src) == os.path.getsize(dst)
    shutil.copyfile(src, dst)
    code, out, _ = _run(capsys, "verify", save_dir / "iter_0000200")
    assert code == EXIT_DAMAGED
    assert f"ERROR rank 0: {os.path.basename(dst)}: rank 0 file is not the one committed by the manifest" in out


def _console_script():
    script = os.path.join(os.path.dirname(sys.executable), "datastates-ckpt")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "datastates_megatron.cli"]


def test_console_script_end_to_end(save_dir):
    ckpt = save_dir / "iter_0000200"
    ok = subprocess.run(
        [*_console_script(), "verify", str(ckpt), "--json"], capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ok"] is True
    path = _rank_file(ckpt)
    with RankFile(path) as rf:
        offset = rf.entries["layer1.weight"].offset
    _flip(path, offset)
    bad = subprocess.run([*_console_script(), "verify", str(ckpt)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == EXIT_DAMAGED
    assert f"ERROR rank 0: {os.path.basename(path)}: tensor 'layer1.weight'" in bad.stdout
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("argv", [["--help"], ["ls", "--help"], ["inspect", "--help"], ["verify", "--help"]])
def test_help_is_the_reference(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "exit status" in out and "--json" in out
    assert "usage: datastates-ckpt" in out


def test_bad_usage_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == EXIT_USAGE
    assert _run(capsys, "verify", "x", "--threads", "0")[0] == EXIT_USAGE


def test_export_of_a_non_megatron_checkpoint_is_a_one_line_error(tmp_path, capsys):
    import torch

    from datastates_megatron.cli import main
    from datastates_megatron.engine import EngineOptions
    from datastates_megatron.engine.manager import CheckpointManager

    with CheckpointManager(str(tmp_path / "c"), EngineOptions(cache_bytes=1 << 20)) as m:
        m.register("w", torch.ones(10))
        m.save(1)
    rc = main(["export", str(tmp_path / "c"), str(tmp_path / "out"), "--format", "torch"])
    err = capsys.readouterr().err
    assert rc != 0 and "no Megatron parameter maps" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "iter_1.pt").exists()


_LIGHT_PROBE = """
import sys
import datastates_megatron.cli as cli
for argv in (["--help"], ["export", "--help"], ["verify"], ["frobnicate"]):
    try:
        cli.main(argv)
    except SystemExit as e:
        print("exit", argv[0], e.code)
print("heavy", sorted(m for m in ("torch", "numpy", "numba", "megatron") if m in sys.modules))
"""


def test_help_and_usage_errors_import_no_torch():
    """``datastates-ckpt --help`` (and a bad command line) on a login node: no torch, numpy, numba or megatron."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", _LIGHT_PROBE], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "exit --help 0" in r.stdout and "exit export 0" in r.stdout
    assert "exit verify 2" in r.stdout and "exit frobnicate 2" in r.stdout
    assert "heavy []" in r.stdout, r.stdout


def test_help_names_the_engine_tracker_file():
    from datastates_megatron import cli
    from datastates_megatron.engine.format.manifest import TRACKER_NAME

    assert cli._TRACKER_NAME == TRACKER_NAME
