"""``datastates-ckpt export``'s usage errors: one line, exit 2, before anything starts or is written."""

from __future__ import annotations

import pytest

from tests.managers import one_checkpoint, stand_in_megatron_lm

from datastates_megatron.cli import EXIT_USAGE, main
from datastates_megatron.megatron.export.exporter import rank_command


@pytest.fixture
def saved(tmp_path):
    return one_checkpoint(tmp_path / "ckpt", numel=4)


@pytest.fixture
def tree(tmp_path):
    return stand_in_megatron_lm(tmp_path / "megatron-lm", script="")


CASES = {
    "no tree": ([], "pass --megatron-lm DIR (a Megatron-LM checkout) or set MEGATRON_LM_DIR"),
    "not a checkout": (["--megatron-lm", "{tmp}"], "not a Megatron-LM checkout (no megatron/)"),
    "no script": (["--megatron-lm", "{tree}", "--script", "pretrain_t5.py"], "no training script"),
    "no processes": (["--nproc", "0"], "export --nproc must be at least 1, got 0"),
    "torch with flags": (["--format", "torch", "--", "--num-layers", "2"], "runs no Megatron-LM"),
    "safetensors with flags": (["--format", "safetensors", "--", "--num-layers", "2"], "runs no Megatron-LM"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_export_usage_errors_are_one_line(case, saved, tree, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MEGATRON_LM_DIR", raising=False)
    args, message = CASES[case]
    args = [a.format(tmp=tmp_path, tree=tree) for a in args]
    if case in ("no tree", "not a checkout", "no script"):
        args += ["--", "--num-layers", "2"]
    out = tmp_path / "out"
    assert main(["export", str(saved), str(out), *args]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_the_tree_comes_from_megatron_lm_dir(saved, tree, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGATRON_LM_DIR", str(tmp_path / "elsewhere"))
    assert main(["export", str(saved), str(tmp_path / "out"), "--", "--num-layers", "2"]) == EXIT_USAGE
    assert f"MEGATRON_LM_DIR={tmp_path / 'elsewhere'}: not a Megatron-LM checkout" in capsys.readouterr().err


def test_other_commands_take_nothing_after_the_separator(saved, capsys):
    with pytest.raises(SystemExit) as e:
        main(["ls", str(saved), "--", "--num-layers", "2"])
    assert e.value.code == EXIT_USAGE and "ls takes no arguments after --" in capsys.readouterr().err


def test_the_conversion_flags_come_after_the_runs_own(tmp_path):
    """argparse keeps an option's last value: --load, --save and the conversion target are the export's."""
    cmd = rank_command("/m/pretrain_gpt.py", ["--load", "/old", "--save", "/old"], "/ckpt", 7, str(tmp_path), True)
    i = cmd.index("/m/pretrain_gpt.py")
    flags = cmd[i + 1 :]
    last = {flag: flags[len(flags) - 1 - flags[::-1].index(flag) + 1] for flag in ("--load", "--save", "--ckpt-step")}
    assert last == {"--load": "/ckpt", "--save": str(tmp_path / "scratch"), "--ckpt-step": "7"}
    assert flags[-2:] == ["--lazy-ckpt-convert-to", str(tmp_path / "converted")] and "--lazy-ckpt" in flags
    assert flags[flags.index("--distributed-backend") + 1] == "gloo"


@pytest.mark.parametrize("fmt", ["safetensors", "torch_dist"])
def test_a_checkpoint_without_global_coordinates_is_refused_naming_the_fallback(fmt, saved, tmp_path, capsys):
    """Not a Megatron checkpoint (no parameter identity): refused in one line, before any process starts."""
    out = tmp_path / "out"
    assert main(["export", str(saved), str(out), "--format", fmt]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no parameter with a global identity in this checkpoint" in err, err
    assert "--format torch_dist --megatron-lm DIR -- TRAINING_FLAGS" in err, err
    assert not out.exists() or not any(out.iterdir())
