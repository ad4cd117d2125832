"""launch/lib.sh builds the pretrain_gpt.py command line that our flag parser then accepts."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _megatron_args(tmp_path, **env) -> list[str]:
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    script = ('source launch/lib.sh; DSM_REPO_DIR=. dsm_load_preset gpt-7b-8gpu >/dev/null; '
              'dsm_megatron_args 8 >/dev/null; printf "%s\\n" "${MEGATRON_ARGS[@]}"')
    mlm = tmp_path / "Megatron-LM"  # lib.sh only checks that pretrain_gpt.py exists
    mlm.mkdir(exist_ok=True)
    (mlm / "pretrain_gpt.py").write_text("")
    out = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SAVE_DIR": str(tmp_path / "save"), "MEGATRON_LM_DIR": str(mlm), **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_local_tier_variables_become_flags(tmp_path):
    argv = _megatron_args(tmp_path, LAZY_CKPT_LOCAL_DIR="/dev/shm/ckpt", LAZY_CKPT_LOCAL_FALLBACK="rank")
    assert _value(argv, "--lazy-ckpt-local-dir") == "/dev/shm/ckpt"
    assert _value(argv, "--lazy-ckpt-persist-interval") == "10"
    assert _value(argv, "--lazy-ckpt-local-fallback") == "rank"
    assert _value(argv, "--save") == str(tmp_path / "save")

    import argparse

    from datastates_megatron.megatron.args import add_lazy_ckpt_args, config_from_args, validate_lazy_ckpt_args

    parser = add_lazy_ckpt_args(argparse.ArgumentParser())
    parser.add_argument("--save")
    lazy = [a for i, a in enumerate(argv) if a.startswith("--lazy-ckpt") or
            (i and argv[i - 1].startswith("--lazy-ckpt") and not a.startswith("--"))]
    args = parser.parse_args([*lazy, "--save", str(tmp_path / "save")])
    validate_lazy_ckpt_args(args)
    config = config_from_args(args)
    assert config.local_dir == "/dev/shm/ckpt" and config.persist_interval == 10 and config.local_fallback == "rank"


def test_no_local_tier_without_the_variable(tmp_path):
    argv = _megatron_args(tmp_path)
    assert "--lazy-ckpt" in argv and not any(a.startswith("--lazy-ckpt-local") for a in argv)
