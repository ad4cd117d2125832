"""Every small document read from object storage -- manifest, run id, lock, global index, tracker --
is refused from its size (the listing's, or a HEAD's) before its body is fetched, as a file on
POSIX is refused from ``fstat``: an oversized object put under the prefix by anyone with write
access costs a one-line error, not memory (findings of issue #49, "no size cap on object reads")."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from datastates_megatron.cli import EXIT_DAMAGED, main
from datastates_megatron.engine.errors import CorruptCheckpointError, SaveDirBusyError
from datastates_megatron.engine.fs.safe_io import MANIFEST_MAX_BYTES
from datastates_megatron.engine.names import LOCK_NAME, RUN_ID_NAME, TRACKER_NAME
from datastates_megatron.engine.storage import open_storage
from datastates_megatron.engine.storage.lock import ObjectLock
from datastates_megatron.engine.storage.object_tier import ObjectTier
from datastates_megatron.engine.storage.survey import survey_objects

from ..unit.rank_files import write_checkpoint
from .jobs import TOKEN, WORLD, Job

_OVER = MANIFEST_MAX_BYTES + (1 << 20)  # just over the manifest cap: what a fetch of it would cost


def _saved(bucket: str, tmp_path) -> str:
    local = str(tmp_path / "local")
    write_checkpoint(local, 1, WORLD, TOKEN, numel=20_000)
    job = Job(bucket, local)
    try:
        assert job.promote(1) == [[1]] * WORLD
    finally:
        job.close()
    return f"s3://{bucket}/job/save"


def test_an_oversized_manifest_is_refused_from_the_listing_in_bounded_memory(bucket, s3_env, tmp_path, capsys):
    url = _saved(bucket, tmp_path)
    s3_env.client().put_object(Bucket=bucket, Key="job/save/iter_0000009/manifest.json", Body=b" " * _OVER)
    tracemalloc.start()
    try:
        with open_storage(url) as st:
            found = survey_objects(st)  # what a trainer's start-up and ``ls`` read
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak  # the object is never fetched
    assert sorted(found.committed) == [1]
    err = str(found.damaged[9])
    assert err == (
        f"{url}/iter_0000009/manifest.json: manifest is larger than {MANIFEST_MAX_BYTES} bytes ({_OVER}); "
        "refusing to read it"
    )
    with pytest.raises(CorruptCheckpointError, match="manifest is larger than"):
        found.latest()  # a trainer does not skip it silently
    assert main(["ls", url, "--json"]) == EXIT_DAMAGED
    doc = json.loads(capsys.readouterr().out)
    assert [r["state"] for r in doc["checkpoints"]] == ["committed", "damaged"]
    assert "\n" not in doc["latest_error"] and "larger than" in doc["latest_error"]


def test_an_oversized_run_id_lock_and_tracker_are_refused_before_their_bodies(bucket, s3_env, tmp_path, capsys):
    url = _saved(bucket, tmp_path)
    c = s3_env.client()
    big = b"{" + b" " * (8 << 20) + b"}"  # parses as JSON: only its size refuses it
    c.put_object(Bucket=bucket, Key=f"job/save/{RUN_ID_NAME}", Body=big)
    c.put_object(Bucket=bucket, Key=f"job/save/{TRACKER_NAME}", Body=b"1" + b" " * (8 << 20))
    c.put_object(Bucket=bucket, Key=f"job/save/{LOCK_NAME}", Body=big)
    peaks = []
    with open_storage(url) as st:
        st.head(RUN_ID_NAME)  # the client is set up before memory is traced
        tracemalloc.start()
        try:
            tier = ObjectTier(st, rank=0, token=TOKEN, writes=[0])
            with pytest.raises(CorruptCheckpointError, match=rf"run id is larger than 4096 bytes \({len(big)}\)"):
                tier.ensure_run_id()
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.reset_peak()
            with pytest.raises(SaveDirBusyError, match="holder unknown"):
                ObjectLock(st).acquire()  # not parsed, not expired: refused
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert max(peaks) < 4 << 20, peaks  # neither 8 MiB body is fetched
    assert main(["ls", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tracker_text"].startswith("<unreadable") and "larger than 64 bytes" in doc["tracker_text"]
    assert doc["tracker_agrees"] is None


def test_a_document_grown_since_its_listing_is_refused_at_its_cap(bucket, s3_env, tmp_path):
    url = _saved(bucket, tmp_path)
    with open_storage(url) as st:
        info = st.head("iter_0000001/manifest.json")
        # the listing said 10 bytes; the object holds more: at most 11 bytes are read, then refused
        with pytest.raises(CorruptCheckpointError, match="changed while it was read"):
            st.read_capped(info.key, MANIFEST_MAX_BYTES, "manifest", size=10)
        assert st.read_capped(info.key, MANIFEST_MAX_BYTES, "manifest") == st.get(info.key)
