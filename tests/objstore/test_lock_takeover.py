"""Taking over the save prefix's lease lock of a job killed with ``kill -9`` outside Slurm, safely
and without waiting for its lease (finding of issue #49): the refusal names the exact variable
(``DSM_TAKE_OVER_LOCK=<holder>``), which takes over that holder's lock only -- never a holder still
running on this host, never another holder than the one named -- and bad values are one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from datastates_megatron.engine.errors import OptionsError, SaveDirBusyError
from datastates_megatron.engine.names import LOCK_NAME
from datastates_megatron.engine.storage.lock import TAKE_OVER_ENV, ObjectLock

from .jobs import storage

_HOLD_AND_DIE = """
import os, signal, sys
from datastates_megatron.engine.storage import open_storage
from datastates_megatron.engine.storage.lock import ObjectLock
lock = ObjectLock(open_storage(sys.argv[1])).acquire()
print(lock._nonce, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # kill -9: no release, the lease object stays
"""


def _killed_holder(bucket: str) -> tuple[str, int]:
    """A job that took the lock and was killed with SIGKILL: (its holder token, its pid)."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop("DSM_JOB_ID", None)
    env.pop("SLURM_JOB_ID", None)
    p = subprocess.run(
        [sys.executable, "-c", _HOLD_AND_DIE, f"s3://{bucket}/job/save"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == -9, p.stderr  # reaped: its pid no longer runs
    return p.stdout.strip(), json.loads(bytes(storage(bucket).get(LOCK_NAME)))["pid"]


def test_the_refusal_names_the_variable_and_it_takes_over_a_killed_job_s_lock(bucket, monkeypatch):
    monkeypatch.delenv("DSM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv(TAKE_OVER_ENV, raising=False)
    token, pid = _killed_holder(bucket)
    st = storage(bucket)
    with pytest.raises(SaveDirBusyError) as e:
        ObjectLock(st).acquire()  # its lease (300 s) has not run out
    text = str(e.value)
    assert "\n" not in text and f"pid {pid}" in text
    assert "not running on this host" in text and f"{TAKE_OVER_ENV}={token}" in text, text
    monkeypatch.setenv(TAKE_OVER_ENV, token)
    with ObjectLock(st) as mine:
        body = json.loads(bytes(st.get(LOCK_NAME)))
        assert body["pid"] == os.getpid() and body["nonce"] == mine._nonce
        mine.check()


def test_the_variable_never_takes_a_running_holder_s_lock_nor_another_holder_s(bucket, monkeypatch):
    monkeypatch.delenv("DSM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    st = storage(bucket)
    with ObjectLock(st) as alive:  # this process: running on this host
        monkeypatch.setenv(TAKE_OVER_ENV, alive._nonce)
        with pytest.raises(SaveDirBusyError, match=f"pid {os.getpid()}, which is still running on this host") as e:
            ObjectLock(st).acquire()
        assert "\n" not in str(e.value)
        alive.check()  # still its lock
        monkeypatch.setenv(TAKE_OVER_ENV, "0123456789abcdef0123456789abcdef")
        with pytest.raises(SaveDirBusyError) as e:
            ObjectLock(st).acquire()
        assert re.search(rf"{TAKE_OVER_ENV}=0123456789abcdef0123456789abcdef names another holder", str(e.value))
        alive.check()


@pytest.mark.parametrize("value", ["yes", "../x", "0123"])
def test_a_malformed_takeover_value_is_one_line(bucket, monkeypatch, value):
    monkeypatch.setenv(TAKE_OVER_ENV, value)
    with pytest.raises(
        OptionsError, match=rf"{TAKE_OVER_ENV} must be the 32 hex digits a refusal names, got '{re.escape(value)}'"
    ) as e:
        ObjectLock(storage(bucket)).acquire()  # checked even when the lock is free: a typo is not ignored
    assert "\n" not in str(e.value)
