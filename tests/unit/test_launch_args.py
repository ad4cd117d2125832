"""datastates_megatron/launch/lib.sh builds the pretrain_gpt.py command line that our flag parser then accepts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _megatron_args(tmp_path, **env) -> list[str]:
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    script = (
        "source datastates_megatron/launch/lib.sh; DSM_LAUNCH_DIR=datastates_megatron/launch "
        "dsm_load_preset gpt-7b-8gpu >/dev/null; "
        'dsm_megatron_args 8 >/dev/null; printf "%s\\n" "${MEGATRON_ARGS[@]}"'
    )
    mlm = tmp_path / "Megatron-LM"  # lib.sh only checks that pretrain_gpt.py exists
    mlm.mkdir(exist_ok=True)
    (mlm / "pretrain_gpt.py").write_text("")
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORBOARD_", "WANDB_", "SLURM_"))}
    out = subprocess.run(
        ["bash", "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**inherited, "SAVE_DIR": str(tmp_path / "save"), "MEGATRON_LM_DIR": str(mlm), **env},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_local_tier_variables_become_flags(tmp_path):
    argv = _megatron_args(tmp_path, LAZY_CKPT_LOCAL_DIR="/dev/shm/ckpt", LAZY_CKPT_LOCAL_FALLBACK="rank")
    assert _value(argv, "--lazy-ckpt-local-dir") == "/dev/shm/ckpt"
    assert _value(argv, "--lazy-ckpt-persist-interval") == "1000"  # iterations: 10 x the preset's --save-interval
    assert _value(argv, "--lazy-ckpt-local-fallback") == "rank"
    assert _value(argv, "--save") == str(tmp_path / "save")

    import argparse

    from datastates_megatron.megatron.megatron_lm.args import (
        add_lazy_ckpt_args,
        config_from_args,
        validate_lazy_ckpt_args,
    )

    parser = add_lazy_ckpt_args(argparse.ArgumentParser())
    parser.add_argument("--save")
    lazy = [
        a
        for i, a in enumerate(argv)
        if a.startswith("--lazy-ckpt") or (i and argv[i - 1].startswith("--lazy-ckpt") and not a.startswith("--"))
    ]
    args = parser.parse_args([*lazy, "--save", str(tmp_path / "save")])
    validate_lazy_ckpt_args(args)
    config = config_from_args(args)
    assert config.local_dir == "/dev/shm/ckpt" and config.persist_interval == 1000 and config.local_fallback == "rank"
    assert config.keep_last == 2  # the launch scripts bound --save explicitly (LAZY_CKPT_KEEP_LAST)


def test_no_local_tier_without_the_variable(tmp_path):
    argv = _megatron_args(tmp_path)
    assert "--lazy-ckpt" in argv and not any(a.startswith("--lazy-ckpt-local") for a in argv)


def test_tensorboard_by_default_under_the_save_dir_and_can_be_turned_off(tmp_path):
    argv = _megatron_args(tmp_path)
    assert _value(argv, "--tensorboard-dir") == str(tmp_path / "save" / "tensorboard")
    assert _value(_megatron_args(tmp_path, TENSORBOARD_DIR="/scratch/tb"), "--tensorboard-dir") == "/scratch/tb"
    for off in ("none", ""):
        assert "--tensorboard-dir" not in _megatron_args(tmp_path, TENSORBOARD_DIR=off)


def test_wandb_only_when_a_project_is_named(tmp_path):
    assert not any(a.startswith("--wandb") for a in _megatron_args(tmp_path))
    argv = _megatron_args(tmp_path, WANDB_PROJECT="lazy", SLURM_JOB_NAME="gpt7b")
    assert _value(argv, "--wandb-project") == "lazy" and _value(argv, "--wandb-exp-name") == "gpt7b"
    assert _value(argv, "--wandb-save-dir") == str(tmp_path / "save" / "wandb")
    argv = _megatron_args(tmp_path, WANDB_PROJECT="lazy", WANDB_EXP_NAME="run-3", WANDB_SAVE_DIR="/scratch/wb")
    assert _value(argv, "--wandb-exp-name") == "run-3" and _value(argv, "--wandb-save-dir") == "/scratch/wb"


@pytest.mark.parametrize(
    "env, module",
    [({}, None), ({"DSM_RUNTIME_HOOK": "1"}, "megatron_lm.run"), ({"DSM_CPU": "1"}, "cpu.launch")],
    ids=["patched", "runtime-hook", "cpu"],
)
def test_pretrain_entry_picks_the_runner(tmp_path, env, module):
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    script = (
        'source datastates_megatron/launch/lib.sh >/dev/null; dsm_pretrain_entry; printf "%s\\n" "${PRETRAIN_ENTRY[@]}"'
    )
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("DSM_")}
    out = subprocess.run(
        ["bash", "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**inherited, "MEGATRON_LM_DIR": "/mlm", **env},
    )
    assert out.returncode == 0, out.stderr
    script_path = "/mlm/pretrain_gpt.py"
    want = [script_path] if module is None else ["-m", f"datastates_megatron.megatron.{module}", script_path]
    assert out.stdout.splitlines() == want


def _preamble(script: str) -> str:
    """The lines of a launch script up to its preset: how it finds lib.sh and the presets."""
    lines = (Path(REPO) / "datastates_megatron" / "launch" / script).read_text().splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("dsm_load_preset"))
    return "\n".join(lines[: end + 1]) + '\necho "LAUNCH_DIR=$DSM_LAUNCH_DIR"\n'


@pytest.mark.parametrize("script", ["cpu_demo.sbatch", "gpu_multinode.sbatch", "gpu_per_task.sbatch"])
@pytest.mark.parametrize("where", ["checkout", "installed"])
def test_a_launch_script_finds_lib_sh_and_presets_from_a_checkout_or_an_install(tmp_path, script, where):
    """Slurm runs a copy of the script: it finds lib.sh through the checkout it was submitted from, or
    else through ``datastates-ckpt where launch`` (an installed package; here the CLI of this tree)."""
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    spool = tmp_path / "spool"  # as Slurm's copy: nothing beside it
    spool.mkdir()
    (spool / script).write_text(_preamble(script))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "datastates-ckpt"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m datastates_megatron.cli "$@"\n')
    shim.chmod(0o755)
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("DSM_", "SLURM_"))}
    env = {**inherited, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": REPO}
    submit = REPO if where == "checkout" else str(tmp_path)  # the submit directory: a checkout, or not
    out = subprocess.run(
        ["bash", str(spool / script)],
        cwd=submit,
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "SLURM_SUBMIT_DIR": submit},
    )
    assert out.returncode == 0, out.stderr
    launch = os.path.join(REPO, "datastates_megatron", "launch")
    assert f"LAUNCH_DIR={launch}" in out.stdout, out.stdout
    assert f"loaded preset {os.path.join(REPO, 'datastates_megatron', 'configs')}/" in out.stdout, out.stdout
