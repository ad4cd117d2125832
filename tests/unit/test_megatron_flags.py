"""Megatron-LM's own checkpoint flags with --lazy-ckpt: its local checkpoints mapped onto our
node-local tier, its format flags named in one warning, the rest refused."""

from __future__ import annotations

import argparse
import logging

import pytest

from datastates_megatron.megatron.megatron_lm.args import LazyCkptArgsError, add_lazy_ckpt_args, config_from_args
from datastates_megatron.megatron.megatron_lm.args import validate_lazy_ckpt_args

LOGGER = "datastates_megatron.megatron.megatron_lm.megatron_flags"


def _parser() -> argparse.ArgumentParser:
    """Megatron-LM's checkpoint flags as its parser declares them (names, types, defaults)."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--save-interval", "--persistent-save-interval", type=int)
    p.add_argument("--non-persistent-save-interval", type=int)
    p.add_argument("--non-persistent-ckpt-type", choices=["global", "local", "in_memory"])
    p.add_argument("--non-persistent-local-ckpt-dir")
    p.add_argument("--replication", action="store_true")
    p.add_argument("--replication-jump", type=int)
    p.add_argument("--replication-factor", type=int, default=2)
    p.add_argument("--ckpt-format", default="torch_dist")
    p.add_argument("--no-ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save", action="store_false")
    p.add_argument("--ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save_deprecated", action="store_true")
    return add_lazy_ckpt_args(p)


def _validated(argv: list[str]) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    validate_lazy_ckpt_args(args, argv=argv)
    return args


def _problems(argv: list[str]) -> str:
    with pytest.raises(LazyCkptArgsError) as info:
        _validated(argv)
    return str(info.value)


LOCAL = ["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir"]


def test_megatrons_local_checkpoints_are_the_node_local_tier(tmp_path):
    argv = ["--lazy-ckpt", "--save", str(tmp_path / "s"), "--save-interval", "100"]
    argv += ["--non-persistent-save-interval", "10", *LOCAL, str(tmp_path / "local")]
    args = _validated(argv)
    config = config_from_args(args)
    assert (config.local_dir, config.persist_interval) == (str(tmp_path / "local"), 100)
    assert args.non_persistent_save_interval == 10  # Megatron's loop still saves (non-persistently) every 10
    assert args.non_persistent_ckpt_type is None  # Megatron starts no LocalCheckpointManager of its own
    validate_lazy_ckpt_args(args, argv=argv)  # again, as the glue does when the checkpointer starts
    assert config_from_args(args) == config


def test_megatrons_replication_is_our_partner_replication(tmp_path):
    argv = ["--lazy-ckpt", "--save", str(tmp_path / "s"), "--save-interval", "100", *LOCAL, str(tmp_path / "l")]
    args = _validated([*argv, "--replication", "--replication-jump", "8", "--replication-factor", "3"])
    assert args.replication is False  # Megatron would require its own local checkpoints for it
    opts = config_from_args(args).manager_options()
    assert (opts.replicas, opts.replication_jump) == (2, 8)


def test_replication_without_a_node_local_tier_is_refused(tmp_path):
    message = _problems(["--lazy-ckpt", "--save", str(tmp_path), "--replication", "--replication-jump", "8"])
    assert "--replication replicates node-local checkpoints" in message


def test_our_flags_may_repeat_megatrons_but_not_contradict_them(tmp_path):
    base = ["--lazy-ckpt", "--save", str(tmp_path / "s"), "--save-interval", "100"]
    base += ["--non-persistent-save-interval", "10", *LOCAL, str(tmp_path / "l")]
    same = _validated([*base, "--lazy-ckpt-local-dir", str(tmp_path / "l"), "--lazy-ckpt-persist-interval", "100"])
    assert config_from_args(same).persist_interval == 100
    message = _problems([*base, "--lazy-ckpt-persist-interval", "30"])
    assert "--lazy-ckpt-persist-interval 30 and --save-interval 100" in message
    message = _problems([*base, "--lazy-ckpt-local-dir", str(tmp_path / "other")])
    assert "--non-persistent-local-ckpt-dir" in message and "give one of them" in message


@pytest.mark.parametrize(
    "extra, text",
    [
        (["--non-persistent-save-interval", "10"], "needs a node-local tier"),
        (["--non-persistent-ckpt-type", "global", "--non-persistent-save-interval", "10"], "type global"),
        (["--non-persistent-ckpt-type", "local", "--non-persistent-save-interval", "10"], "--non-persistent-local"),
    ],
)
def test_non_persistent_checkpoints_without_a_node_local_tier_are_refused(tmp_path, extra, text):
    message = _problems(["--lazy-ckpt", "--save", str(tmp_path / "s"), "--save-interval", "100", *extra])
    assert text in message


def test_without_a_save_interval_nothing_says_when_to_persist(tmp_path):
    message = _problems(["--lazy-ckpt", "--save", str(tmp_path), "--non-persistent-save-interval", "5", *LOCAL, "x"])
    assert "need --save-interval" in message


def test_megatrons_format_flags_are_named_in_one_warning(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    argv = ["--lazy-ckpt", "--save", str(tmp_path), "--ckpt-format", "torch_dist", "--ckpt-fully-parallel-save"]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        args = _validated(argv)
        validate_lazy_ckpt_args(args, argv=argv)  # the second validation (checkpointer start) says nothing
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("--ckpt-format, --ckpt-fully-parallel-save: ignored with --lazy-ckpt")


def test_only_rank_0_warns(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _validated(["--lazy-ckpt", "--save", str(tmp_path), "--ckpt-format", "torch"])
    assert caplog.records == []


def test_no_warning_when_no_format_flag_is_given(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _validated(["--lazy-ckpt", "--save", str(tmp_path), "--save-interval", "10"])
    assert caplog.records == []
