"""A real S3 endpoint on localhost for the object-storage tests: moto's standalone server in a
process of its own (nothing is mocked inside the test process), on a free port, with dummy
credentials in the environment.  One server per test session; one fresh bucket per test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("boto3", reason="the object-storage tests need boto3 (pip install -e '.[test]')")
pytest.importorskip("moto.server", reason="the object-storage tests need moto[server] (pip install -e '.[test]')")

DUMMY_KEY_ID = "AKIADSMTESTKEYID0001"
DUMMY_SECRET = "dsm-test-secret-Zq8Xv3Kp9Lm2Nn4Bb7Cc"  # distinctive: tests check it never shows
_ENV = {
    "AWS_ACCESS_KEY_ID": DUMMY_KEY_ID,
    "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET,
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class S3Server:
    """The moto server process: ``endpoint`` is its URL; :meth:`stop` ends it (by its pid)."""

    def __init__(self, log_path: str) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **_ENV}
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 120
        while not _answers(self.port):  # polls a condition with a deadline: the server is up or it failed
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moto server did not start on port {self.port}; see {log_path}")
            time.sleep(0.05)

    def client(self):
        import boto3

        return boto3.session.Session(
            aws_access_key_id=DUMMY_KEY_ID, aws_secret_access_key=DUMMY_SECRET, region_name="us-east-1"
        ).client("s3", endpoint_url=self.endpoint)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = S3Server(str(tmp_path_factory.mktemp("moto") / "server.log"))
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The environment a job sees: dummy credentials and the local endpoint (``AWS_ENDPOINT_URL``)."""
    for k, v in {**_ENV, "AWS_ENDPOINT_URL": s3_server.endpoint}.items():
        monkeypatch.setenv(k, v)
    return s3_server


@pytest.fixture
def bucket(s3_env) -> str:
    """A fresh, empty bucket on the local server."""
    name = f"dsm-{uuid.uuid4().hex[:16]}"
    s3_env.client().create_bucket(Bucket=name)
    return name
