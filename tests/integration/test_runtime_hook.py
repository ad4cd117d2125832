"""The runtime hook (:mod:`datastates_megatron.megatron.megatron_lm.hook`, :mod:`~datastates_megatron.megatron.megatron_lm.run`)
on Megatron-LM trees that do NOT carry our patch.

Part 1 (``MEGATRON_LM_DIRS``/``MEGATRON_LM_DIR``): ``megatron/`` of each tree is copied and the
patch reverted; in a subprocess the hook is installed and Megatron's own ``parse_args`` takes and
validates the ``--lazy-ckpt`` flags, and the names ``megatron.training.training`` imported
(``save_checkpoint``, ``load_checkpoint``, ``maybe_finalize_async_save``) reach the glue with the
arguments the patch passes. The patched tree itself is left alone by the hook. A signature
mismatch and a partly patched tree are refused before anything is replaced.

Part 2 (``MEGATRON_LM_PRISTINE_DIRS``: unpatched trees, set by scripts/test.sh and .ci/run with
``scripts/megatron_lm_tree.sh --no-patch``): the real ``pretrain_gpt.py`` of each tree trains and
saves through ``cpu_launch`` (the CPU shim + the hook), then a second run resumes from an older
checkpoint and trains on to the bit as the first did.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration.megatron_lm_runs import LAZY, assert_same_training, latest, launch
from tests.integration.megatron_lm_driver import apply_patches, copy_megatron, drive, result
from tests.integration.megatron_lm_source import parameters


def _dirs(var: str, fallback: str | None = None) -> list[str]:
    value = os.environ.get(var) or (os.environ.get(fallback) if fallback else None) or ""
    return [d for d in value.split(os.pathsep) if d]


TREES = _dirs("MEGATRON_LM_DIRS", "MEGATRON_LM_DIR")
PRISTINE = _dirs("MEGATRON_LM_PRISTINE_DIRS")
PATCHED_FILES = (
    "megatron/training/arguments.py",
    "megatron/training/checkpointing.py",
    "megatron/training/async_utils.py",
)


def _name(d: str | None) -> str:
    return os.path.basename(d.rstrip("/")) if d else "none"


@pytest.fixture(scope="module", params=TREES or [None], ids=_name)
def unpatched_copy(request, tmp_path_factory):
    """``megatron/`` of one tree, copied with our patch reverted (the tree itself is not touched)."""
    if request.param is None:
        pytest.skip("MEGATRON_LM_DIR(S) is not set (scripts/test.sh unpacks trees from ../shared/megatron-lm)")
    copy = tmp_path_factory.mktemp("unpatched")
    copy_megatron(request.param, copy)
    for rel in PATCHED_FILES:
        assert "datastates_megatron" not in (copy / rel).read_text(), rel
    return Path(request.param), copy


@pytest.fixture(scope="module")
def driven(unpatched_copy, tmp_path_factory):
    _, copy = unpatched_copy
    jobs = {"hook-route": [], "hook-refuse": [], "hook-newparam": []}
    return drive(copy, tmp_path_factory.mktemp("driver"), jobs, prepare="cpu_launch")


def test_the_hook_routes_an_unpatched_tree(driven, unpatched_copy):
    out, _ = result(driven, "hook-route")
    _, copy = unpatched_copy
    save_kw = sorted(parameters(copy, "save_checkpoint")[6:])  # every one: call_params says what each does
    load_kw = sorted(parameters(copy, "load_checkpoint")[3:])
    assert out["install"] == ["hooked", "already"]
    assert all(out["sites"].values()), out["sites"]
    assert out["wrapped_once"]
    assert out["parsed"] == [True, 3.0, 7]  # our flags and the caller's extra_args_provider
    assert "--lazy-ckpt cannot be combined with --async-save" in out["validated"]
    assert out["load_returned"] == [100, 12.5]
    assert out["calls"] == [  # what the patch passes (tests/integration/test_megatron_lm_patch.py)
        ["save", 100, True, True, True, 12.5, save_kw],
        ["load", True, True, True, load_kw],
        ["finalize", False, False],
        ["finalize", True, True],
    ]


def test_a_mismatch_or_a_partial_patch_is_refused_before_anything_is_replaced(driven):
    out, _ = result(driven, "hook-refuse")
    missing, required, partial = out["errors"]
    where = f"Megatron-LM {out['version']}: megatron.training.checkpointing.save_checkpoint("
    assert missing.startswith(where) and "(no parameter opt_param_scheduler)" in missing and "\n" not in missing
    assert required.startswith(where) and "new required parameter must" in required, required
    assert "partly patched (megatron.training.async_utils.maybe_finalize_async_save only)" in partial, partial
    assert not any(out["sites"].values()), out["sites"]


def test_a_new_optional_parameter_is_refused_when_given_never_dropped(driven):
    out, _ = result(driven, "hook-newparam")
    assert out["install"] == "hooked"
    assert out["calls"] == [[6, ["release"]]]  # future_knob at its default: not passed, nothing lost
    assert "save_checkpoint was called with future_knob, which --lazy-ckpt does not handle" in out["refused"]
    assert "tested Megatron-LM (0.16.1 (core_v0.16.1)" in out["refused"]


def test_a_patched_tree_is_left_alone(unpatched_copy, tmp_path):
    tree, _ = unpatched_copy
    if apply_patches(tree, "--check").stdout.startswith("applies cleanly:"):
        pytest.skip(f"{tree} is not patched")
    out, _ = result(drive(tree, tmp_path, {"hook-patched": []}, prepare="cpu_launch"), "hook-patched")
    assert out["install"] == "patched"
    assert not any(out["sites"].values()), out["sites"]


# --------------------------------------------------------------------------- #
# part 2: the real pretrain_gpt.py of an unpatched tree, trained, saved and resumed
# --------------------------------------------------------------------------- #
ITERS = 6


@pytest.mark.parametrize("tree", PRISTINE or [None], ids=_name)
def test_pretrain_gpt_of_an_unpatched_tree_saves_and_resumes(tmp_path, tree):
    if tree is None:
        pytest.skip("MEGATRON_LM_PRISTINE_DIRS is not set (scripts/megatron_lm_tree.sh --no-patch)")
    for rel in PATCHED_FILES:
        assert "datastates_megatron" not in Path(tree, rel).read_text(), f"{tree}/{rel} is patched"
    save = tmp_path / "ckpt"
    args = ["--train-iters", str(ITERS), "--save", str(save), "--load", str(save), "--save-interval", "2", *LAZY]
    first = launch(tmp_path, "first", args, nproc=1, megatron_lm_dir=tree)
    assert first.returncode == 0, first.describe()
    assert "checkpointing routed by the datastates_megatron runtime hook" in first.log, first.describe()
    assert "scheduled lazy checkpoint of iteration 4" in first.log and latest(save) == ITERS
    resumed = launch(tmp_path, "resumed", [*args, "--ckpt-step", "4"], nproc=1, megatron_lm_dir=tree)
    assert resumed.returncode == 0, resumed.describe()
    assert "loaded lazy checkpoint of iteration 4" in resumed.log, resumed.describe()
    assert_same_training(resumed, first, range(5, ITERS + 1), ranks=1)
