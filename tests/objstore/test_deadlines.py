"""Every request to an S3 store has a total deadline, stated and configurable: an endpoint that
accepts connections and never answers (a listening socket nobody reads: the kernel completes the
handshake) makes ``datastates-ckpt ls`` fail in seconds with one line naming the object and the
settings, not after 5 tries of 60 s (finding of issue #49, "slow failure against a silent
endpoint")."""

from __future__ import annotations

import socket
import time

import pytest

from datastates_megatron.cli import main
from datastates_megatron.engine.errors import OptionsError
from datastates_megatron.engine.storage import ObjectStorageError, open_storage
from datastates_megatron.engine.storage.timeouts import Timeouts

from .conftest import _ENV


@pytest.fixture
def silent(monkeypatch):
    """An S3 endpoint that accepts every connection and answers nothing."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)  # never accepted: connections complete in the kernel, requests are never read
        for k, v in {**_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{s.getsockname()[1]}"}.items():
            monkeypatch.setenv(k, v)
        yield


def _ls_seconds(capsys) -> tuple[float, str]:
    t0 = time.monotonic()
    code = main(["ls", "s3://quiet/run"])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1, err  # one line, no traceback
    return took, err


def test_ls_against_a_silent_endpoint_fails_within_the_default_deadline(silent, capsys, monkeypatch):
    for var in ("DSM_S3_CONNECT_TIMEOUT_S", "DSM_S3_READ_TIMEOUT_S", "DSM_S3_DEADLINE_S"):
        monkeypatch.delenv(var, raising=False)
    took, err = _ls_seconds(capsys)
    d = Timeouts()
    # the stated bound (two tries of 10 s with the defaults), not 307 s; slack for the CLI's start
    # on a loaded machine
    assert took < d.deadline_s + 5, took
    assert took >= d.read_s, took  # it did wait for an answer, one read timeout at least
    assert err.startswith("datastates-ckpt: error: s3://quiet/run: list failed after 2 tries: ReadTimeoutError")
    assert f"no answer within {d.read_s:g} s a try, deadline {d.deadline_s:g} s" in err
    assert "DSM_S3_READ_TIMEOUT_S" in err and "DSM_S3_DEADLINE_S" in err


def test_the_deadline_and_timeouts_are_set_from_the_environment(silent, capsys, monkeypatch):
    monkeypatch.setenv("DSM_S3_CONNECT_TIMEOUT_S", "0.5")
    monkeypatch.setenv("DSM_S3_READ_TIMEOUT_S", "0.5")
    monkeypatch.setenv("DSM_S3_DEADLINE_S", "2")
    _, err = _ls_seconds(capsys)
    assert "no answer within 0.5 s a try, deadline 2 s" in err
    with open_storage("s3://quiet/run") as st:
        assert st.timeouts == Timeouts(connect_s=0.5, read_s=0.5, deadline_s=2.0)
        t0 = time.monotonic()
        with pytest.raises(ObjectStorageError, match="list failed"):
            list(st.list())
        took = time.monotonic() - t0
    # no try starts that could end past the deadline: within it, but for the scheduling of a loaded
    # machine (generous: the defaults would take 20 s)
    assert 0.5 <= took < 2 + 3, took
    with open_storage("s3://quiet/run", deadline_s=7) as st:  # an argument wins over the environment
        assert st.timeouts == Timeouts(connect_s=0.5, read_s=0.5, deadline_s=7.0)


@pytest.mark.parametrize("value", ["soon", "0", "-1", "nan", "inf"])
def test_a_bad_timeout_setting_is_one_line_naming_the_variable(value, monkeypatch, capsys):
    monkeypatch.setenv("DSM_S3_DEADLINE_S", value)
    with pytest.raises(OptionsError, match=rf"DSM_S3_DEADLINE_S must be a number of seconds > 0, got '{value}'"):
        Timeouts.from_env()
    assert main(["ls", "s3://quiet/run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DSM_S3_DEADLINE_S" in err, err


def test_the_cli_help_states_the_defaults_in_force(capsys):
    with pytest.raises(SystemExit):
        main(["ls", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    d = Timeouts()
    assert f"DSM_S3_DEADLINE_S (default {d.deadline_s:g})" in text
    assert f"DSM_S3_CONNECT_TIMEOUT_S ({d.connect_s:g})" in text and f"DSM_S3_READ_TIMEOUT_S ({d.read_s:g})" in text


def test_no_try_starts_that_could_outlast_the_deadline():
    from datastates_megatron.engine.storage.retry import Retry

    tries = []

    def refused():
        tries.append(time.monotonic())
        raise ConnectionError("refused")

    def fail(e, n):
        return RuntimeError(f"{n} tries")

    policy = Retry(attempts=5, base_s=0.01, cap_s=0.02)
    with pytest.raises(RuntimeError, match="^1 tries$"):  # a try may last 10 s: none fits after the first
        policy.call(refused, transient=lambda e: True, what="x", fail=fail, deadline_s=5, try_s=10)
    tries.clear()
    with pytest.raises(RuntimeError, match="^5 tries$"):  # no deadline: the attempts bound it
        policy.call(refused, transient=lambda e: True, what="x", fail=fail)
    assert len(tries) == 5
