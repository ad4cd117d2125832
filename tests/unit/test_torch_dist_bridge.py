"""The torch_dist bridge's decisions, made before Megatron-LM is called: which Megatron checkpoint a
``--load`` imports, and the refusals that keep what we did not write untouched and lazy
checkpoints from being skipped.  (The conversions themselves: tests/integration/test_torch_dist_bridge.py.)"""

from __future__ import annotations

import os
import re
import types

import pytest

from datastates_megatron.engine.errors import ForeignCheckpointError
from datastates_megatron.engine.names import TRACKER_NAME, iter_dir
from datastates_megatron.megatron.megatron_lm import torch_dist
from tests.unit.test_foreign_checkpoints import _hashes, _native_legacy, _native_torch_dist, _save


def _track(root, text):
    with open(os.path.join(str(root), TRACKER_NAME), "w") as f:
        f.write(text)


def test_the_checkpoint_megatron_would_load_is_imported(tmp_path):
    _native_torch_dist(tmp_path, 100)
    _native_legacy(tmp_path, 200)
    _track(tmp_path, "100")
    found = torch_dist.importable(str(tmp_path))
    assert (found.iteration, found.format) == (100, "torch_dist")
    found = torch_dist.importable(str(tmp_path), ckpt_step=200)  # --ckpt-step wins, as in Megatron
    assert (found.iteration, found.format) == (200, "torch")


def test_nothing_is_imported_without_a_tracker_or_beside_a_lazy_checkpoint(tmp_path):
    _native_torch_dist(tmp_path / "untracked", 100, tracker=False)
    assert torch_dist.importable(str(tmp_path / "untracked")) is None  # Megatron would not load it either
    assert torch_dist.importable(str(tmp_path / "missing")) is None
    _save(tmp_path / "mixed", [10])
    _native_torch_dist(tmp_path / "mixed", 100)
    assert torch_dist.importable(str(tmp_path / "mixed")) is None  # the lazy path decides (and refuses)


def test_a_load_on_object_storage_is_never_read_as_a_local_path(tmp_path, monkeypatch):
    """``--load s3://b/run``: a Megatron checkpoint in a local directory spelled like the URL
    (relative to the working directory) is not imported; the lazy path reads the bucket."""
    monkeypatch.chdir(tmp_path)
    _native_torch_dist(tmp_path / "s3:" / "b" / "run", 100)
    assert os.path.isdir("s3://b/run")
    assert torch_dist.importable("s3://b/run") is None


def test_a_tracked_directory_megatron_cannot_read_is_refused_by_name(tmp_path):
    d = iter_dir(str(tmp_path), 300)
    os.makedirs(d)
    with open(os.path.join(d, "weights.bin"), "wb") as f:
        f.write(b"x")
    _track(tmp_path, "300")
    with pytest.raises(ForeignCheckpointError, match="iter_0000300.*unknown format"):
        torch_dist.importable(str(tmp_path))


def test_no_import_when_the_run_already_has_lazy_checkpoints(tmp_path):
    load, save = tmp_path / "native", tmp_path / "save"
    _native_torch_dist(load, 100)
    _save(save, [120])
    found = torch_dist.importable(str(load))
    args = types.SimpleNamespace(load=str(load), save=str(save))
    before = _hashes(load), _hashes(save)
    with pytest.raises(torch_dist.ConversionError, match=r"--save .*save \(iteration 120\).*pass its --save as --load"):
        torch_dist.import_checkpoint(args, found, model=None, optimizer=None, scheduler=None)
    assert (_hashes(load), _hashes(save)) == before


def test_no_import_when_this_nodes_local_tier_has_lazy_checkpoints(tmp_path):
    load, save, local = tmp_path / "native", tmp_path / "save", tmp_path / "local-node0"
    _native_torch_dist(load, 100)
    _save(local, [130])  # committed locally, killed before its promotion to --save
    args = types.SimpleNamespace(load=str(load), save=str(save))
    found = torch_dist.importable(str(load))
    with pytest.raises(torch_dist.ConversionError, match=r"--lazy-ckpt-local-dir .*local-node0 \(iteration 130\)"):
        torch_dist.import_checkpoint(args, found, None, None, None, local_root=str(local))


@pytest.mark.parametrize("tracker", ["release", "legacy"])
def test_a_ckpt_step_megatron_would_mix_with_the_tracked_checkpoint_is_refused(tmp_path, tracker):
    _native_torch_dist(tmp_path, 100)
    if tracker == "release":
        _native_torch_dist(tmp_path, 300)
        os.rename(iter_dir(str(tmp_path), 300), os.path.join(str(tmp_path), "release"))
        _track(tmp_path, "release")
    else:
        _native_legacy(tmp_path, 200)
        _track(tmp_path, "200")
    with pytest.raises(torch_dist.ConversionError, match="--ckpt-step 100 but the tracker file names"):
        torch_dist.importable(str(tmp_path), ckpt_step=100)


def test_instance_patches_are_undone_and_earlier_ones_kept():
    class Opt:
        def step(self):
            return "class"

    plain, wrapped = Opt(), Opt()
    wrapped.step = lambda: "earlier wrapper"
    with pytest.raises(RuntimeError):
        with torch_dist._patched([plain, wrapped], "step", lambda obj, orig: lambda: "ours " + orig()):
            assert (plain.step(), wrapped.step()) == ("ours class", "ours earlier wrapper")
            raise RuntimeError("a failing load")
    assert (plain.step(), wrapped.step()) == ("class", "earlier wrapper")
    assert "step" not in vars(plain)


@pytest.mark.parametrize("kind", ["not empty", "a file", "a symlink", "a symlink, trailing slash"])
def test_an_export_never_writes_into_a_directory_it_did_not_create(tmp_path, kind):
    target = tmp_path / "out"
    if kind == "not empty":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    elif kind == "a file":
        target.write_text("mine")
    else:
        (tmp_path / "elsewhere").mkdir()  # empty: only the link makes it a refusal
        target.symlink_to(tmp_path / "elsewhere")
    before = _hashes(tmp_path)
    given = str(target) + ("/" if kind.endswith("trailing slash") else "")
    refused = f"--lazy-ckpt-convert-to {re.escape(str(target))}: (is|exists).*Nothing was written"
    with pytest.raises(torch_dist.ConversionError, match=refused):
        torch_dist.export(types.SimpleNamespace(), given, 5, None, None, None, 0)
    assert _hashes(tmp_path) == before
