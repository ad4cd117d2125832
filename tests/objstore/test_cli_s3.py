"""``datastates-ckpt ls``, ``inspect`` and ``verify`` given s3:// URLs, against the local S3 server."""

from __future__ import annotations

import json

from datastates_megatron.cli import EXIT_DAMAGED, EXIT_OK, main
from datastates_megatron.engine.names import rank_file_name

from ..unit.rank_files import write_checkpoint
from .jobs import TOKEN, WORLD, Job


def _saved(bucket: str, tmp_path) -> None:
    local = str(tmp_path / "local")
    for it in (1, 2):
        write_checkpoint(local, it, WORLD, TOKEN, numel=50_000)
    job = Job(bucket, local)
    try:
        assert job.promote(1) == [[1]] * WORLD and job.promote(2) == [[2]] * WORLD
    finally:
        job.close()


def test_ls_and_verify_of_a_bucket(bucket, s3_env, tmp_path, capsys):
    _saved(bucket, tmp_path)
    c = s3_env.client()
    c.put_object(Bucket=bucket, Key="job/save/iter_0000003/r00000-00000000000000dd-000009.dsck", Body=b"cut short")
    url = f"s3://{bucket}/job/save"
    assert main(["ls", url, "--json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    states = {r["iteration"]: (r["state"], r["latest"], r["world_size"]) for r in doc["checkpoints"]}
    assert states == {1: ("committed", False, WORLD), 2: ("committed", True, WORLD), 3: ("uncommitted", False, None)}
    assert doc["latest"] == 2 and doc["tracker"] == 2 and doc["tracker_agrees"] is True
    assert main(["ls", url]) == EXIT_OK and "<- latest" in capsys.readouterr().out

    assert main(["inspect", f"{url}/iter_0000002", "--rank", "1", "--json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["checkpoint"] == f"{url}/iter_0000002" and [r["rank"] for r in doc["ranks"]] == [1]
    assert doc["ranks"][0]["error"] is None

    assert main(["verify", f"{url}/iter_0000002", "-q"]) == EXIT_OK
    assert "OK iter_0000002" in capsys.readouterr().out
    key = f"job/save/iter_0000002/{rank_file_name(1, TOKEN, 1)}"
    raw = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
    raw[4096 + 10] ^= 0xFF  # the store's damage
    c.put_object(Bucket=bucket, Key=key, Body=bytes(raw))
    assert main(["verify", f"{url}/iter_0000002", "-q", "--json"]) == EXIT_DAMAGED
    doc = json.loads(capsys.readouterr().out)
    assert doc["checkpoint"] == f"{url}/iter_0000002" and not doc["ok"]
    assert [(e["rank"], e["tensor"], e["kind"]) for e in doc["errors"]] == [(1, "w", "checksum")]


def test_ls_names_a_damaged_manifest_and_refuses_a_latest(bucket, s3_env, tmp_path, capsys):
    _saved(bucket, tmp_path)
    s3_env.client().put_object(Bucket=bucket, Key="job/save/iter_0000002/manifest.json", Body=b"{not json")
    assert main(["ls", f"s3://{bucket}/job/save", "--json"]) == EXIT_DAMAGED
    doc = json.loads(capsys.readouterr().out)
    assert [r["state"] for r in doc["checkpoints"]] == ["committed", "damaged"]
    assert doc["latest"] is None and "iter_0000002/manifest.json" in doc["latest_error"]


def test_verify_of_an_uncommitted_url_is_a_usage_error(bucket, s3_env, capsys):
    assert main(["verify", f"s3://{bucket}/job/save/iter_0000007"]) == 2
    assert "not a committed checkpoint" in capsys.readouterr().err
