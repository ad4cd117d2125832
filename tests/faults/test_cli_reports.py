"""What the CLI says about unreadable files (issue 33, finding 6): permission denied is reported as
such, never as a "damaged manifest"; an unreadable tracker beside no checkpoint never "agrees".
Permission faults are injected (we run as root: ``chmod`` would not deny anything)."""

from __future__ import annotations

import errno
import os

import pytest

from datastates_megatron.cli import main
from datastates_megatron.engine import EngineOptions
from datastates_megatron.engine.manager import CheckpointManager
from datastates_megatron.engine.format.manifest import MANIFEST_NAME, TRACKER_NAME, iter_dir
from datastates_megatron.engine.tiers import tier as tier_module
from datastates_megatron.engine.tiers.tier import latest_committed

from tests.workers.fault_worker import fill, make_state


@pytest.fixture
def saved(tmp_path):
    root = tmp_path / "ckpt"
    ts = make_state(0, 5_000)
    with CheckpointManager(str(root), EngineOptions(cache_bytes=256 << 10, timeout_s=30), keep_last=0) as mgr:
        for n, t in ts.items():
            mgr.register(n, t)
        for it in (1, 2):
            fill(ts, 0, it)
            mgr.save(it, {"iteration": it})
            mgr.wait()
    return root


def _deny(monkeypatch, path: str) -> None:
    """Opening ``path`` fails with EACCES, as for a file this user may not read."""
    real = os.open

    def fake_open(p, *a, **kw):
        if os.fspath(p) == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), p)
        return real(p, *a, **kw)

    monkeypatch.setattr(os, "open", fake_open)
    # a reader is another process: the manifests the fixture's writer put in this process's cache
    # (the writer never reads back what it wrote) are not what a reader holds
    monkeypatch.setattr(tier_module._MANIFESTS, "_entries", {})


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_a_manifest_we_may_not_read_is_permission_denied_not_damaged(saved, monkeypatch, capsys, command):
    manifest = os.path.join(iter_dir(str(saved), 2), MANIFEST_NAME)
    _deny(monkeypatch, manifest)
    code = main([command, iter_dir(str(saved), 2)])
    err = capsys.readouterr().err
    assert code != 0 and "permission denied" in err.lower() and "damaged" not in err.lower(), err
    assert "Traceback" not in err


def test_ls_says_permission_denied_for_a_manifest_we_may_not_read(saved, monkeypatch, capsys):
    _deny(monkeypatch, os.path.join(iter_dir(str(saved), 2), MANIFEST_NAME))
    assert main(["ls", str(saved)]) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.split()[:1] == ["2"])
    assert "UNREADABLE" in row and "DAMAGED" not in row, out
    assert "permission denied" in out


def test_an_unreadable_tracker_with_no_checkpoint_does_not_agree(tmp_path, capsys):
    root = tmp_path / "ckpt"
    root.mkdir()
    os.symlink("/dev/zero", root / TRACKER_NAME)
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "agrees" not in out and "unreadable" in out, out


def test_loading_with_a_manifest_we_may_not_read_names_the_permission(saved, monkeypatch):
    _deny(monkeypatch, os.path.join(iter_dir(str(saved), 2), MANIFEST_NAME))
    with pytest.raises(PermissionError, match="permission denied"):
        latest_committed(str(saved))
