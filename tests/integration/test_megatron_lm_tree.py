"""``bash scripts/megatron_lm_tree.sh [--no-patch] VERSION DEST`` (docs/megatron.md; scripts/test.sh
unpacks every tested tree with it): a fresh tree checked against SHA256SUMS, patched unless
``--no-patch``, its path printed; an existing tree is never overwritten."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("DSM_SHARED_DIR", REPO.parent / "shared")) / "megatron-lm"
TREE = REPO / "scripts" / "megatron_lm_tree.sh"

pytestmark = pytest.mark.skipif(
    not (SHARED / "megatron-lm-core_v0.16.1.tar.gz").is_file(), reason=f"no Megatron-LM tarballs in {SHARED}"
)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(TREE), *args], capture_output=True, text=True, timeout=120)


def _check(tree: str) -> str:
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "apply_patches.sh"), tree, "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.stdout


def test_a_fresh_tree_patched_or_not_and_never_over_an_existing_one(tmp_path):
    done = _run("0.16.1", str(tmp_path / "patched"))
    assert done.returncode == 0, done.stderr
    tree = done.stdout.strip()
    assert tree == str(tmp_path / "patched" / "core_v0.16.1")
    assert (Path(tree) / "pretrain_gpt.py").is_file() and _check(tree).startswith("already applied:"), _check(tree)
    plain = _run("--no-patch", "0.16.1", str(tmp_path / "plain"))
    assert plain.returncode == 0 and not _check(plain.stdout.strip()).startswith("already applied:"), plain.stderr
    again = _run("0.16.1", str(tmp_path / "patched"))
    assert again.returncode == 2 and f"{tree} exists; pass an empty DEST" in again.stderr
    assert _run("0.0.0", str(tmp_path / "none")).returncode == 2
