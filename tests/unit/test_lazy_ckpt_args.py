"""The --lazy-ckpt flags: parsing on a plain parser, start-up validation messages, config_from_args."""

from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest

from datastates_megatron.engine.errors import CheckpointError
from datastates_megatron.megatron.megatron_lm import megatron_flags
from datastates_megatron.megatron.megatron_lm.args import (
    UNSUPPORTED_MEGATRON_FLAGS,
    LazyCkptArgsError,
    add_lazy_ckpt_args,
    check_host_cache_fits,
    config_from_args,
    validate_lazy_ckpt_args,
)
from datastates_megatron.engine.errors import OptionsError
from datastates_megatron.engine.options import EngineOptions, ManagerOptions
from datastates_megatron.megatron.checkpointing.config import LazyCkptConfig


def _parser() -> argparse.ArgumentParser:
    """A plain parser with the Megatron-like flags the CPU demo uses."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--save-interval", type=int)
    p.add_argument("--train-iters", type=int)
    return add_lazy_ckpt_args(p)


def _parse(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(list(argv))


def _error(*argv: str, **extra) -> str:
    args = _parse(*argv)
    for k, v in extra.items():
        setattr(args, k, v)
    with pytest.raises(LazyCkptArgsError) as info:
        validate_lazy_ckpt_args(args)
    return str(info.value)


def test_defaults_match_the_config_defaults(tmp_path):
    args = _parse("--save", str(tmp_path))
    assert args.lazy_ckpt is False
    cfg = config_from_args(args)
    defaults = LazyCkptConfig(save_dir=str(tmp_path))
    assert cfg == defaults
    assert args.lazy_ckpt_host_cache_gb == defaults.host_cache_gb
    assert args.lazy_ckpt_verify_on_load is True and args.lazy_ckpt_streaming is True


def test_every_flag_reaches_the_config(tmp_path):
    save, load, local = tmp_path / "save", tmp_path / "load", tmp_path / "local"
    args = _parse(
        "--lazy-ckpt",
        "--save",
        str(save),
        "--load",
        str(load),
        "--save-interval",
        "50",
        "--train-iters",
        "200",
        "--lazy-ckpt-host-cache-gb",
        "1.5",
        "--lazy-ckpt-flush-threads",
        "4",
        "--lazy-ckpt-max-inflight",
        "3",
        "--lazy-ckpt-keep-last",
        "5",
        "--lazy-ckpt-keep-every",
        "100",
        "--no-lazy-ckpt-verify-on-load",
        "--lazy-ckpt-on-error",
        "warn",
        "--lazy-ckpt-no-streaming",
        "--lazy-ckpt-direct-io",
        "off",
        "--lazy-ckpt-source-writes",
        "on",
        "--lazy-ckpt-timeout-s",
        "30",
        "--lazy-ckpt-local-dir",
        str(local),
        "--lazy-ckpt-persist-interval",
        "4",
        "--lazy-ckpt-local-keep-last",
        "3",
        "--lazy-ckpt-local-fallback",
        "rank",
        "--lazy-ckpt-recycle-files",
        "all",
        "--no-lazy-ckpt-mapped-writes",
    )
    validate_lazy_ckpt_args(args)
    assert args.lazy_ckpt and args.save_interval == 50 and args.train_iters == 200
    assert config_from_args(args) == LazyCkptConfig(
        save_dir=str(save),
        load_dir=str(load),
        host_cache_gb=1.5,
        flush_threads=4,
        max_inflight=3,
        keep_last=5,
        keep_every=100,
        verify_on_load=False,
        on_error="warn",
        streaming=False,
        direct_io=False,
        source_writes=True,
        timeout_s=30.0,
        local_dir=str(local),
        persist_interval=4,
        local_keep_last=3,
        local_fallback="rank",
        recycle_files="all",
        mapped_writes=False,
    )


@pytest.mark.parametrize(
    "flag, expected", [("--lazy-ckpt-verify-on-load", True), ("--no-lazy-ckpt-verify-on-load", False)]
)
def test_verify_on_load_has_both_spellings(tmp_path, flag, expected):
    assert config_from_args(_parse("--save", str(tmp_path), flag)).verify_on_load is expected


@pytest.mark.parametrize("choice, expected", [("auto", "auto"), ("on", True), ("off", False)])
@pytest.mark.parametrize(
    "flag, field", [("--lazy-ckpt-direct-io", "direct_io"), ("--lazy-ckpt-source-writes", "source_writes")]
)
def test_on_off_auto_choices(tmp_path, flag, field, choice, expected):
    args = _parse("--save", str(tmp_path), flag, choice)
    assert getattr(config_from_args(args), field) == expected


def test_recycling_defaults_to_the_local_tier_and_rejects_unknown_values(tmp_path, capsys):
    assert config_from_args(_parse("--save", str(tmp_path))).recycle_files == "local"
    assert config_from_args(_parse("--save", str(tmp_path), "--lazy-ckpt-recycle-files", "off")).recycle_files == "off"
    with pytest.raises(SystemExit):
        _parse("--save", str(tmp_path), "--lazy-ckpt-recycle-files", "yes")
    assert "--lazy-ckpt-recycle-files" in capsys.readouterr().err
    with pytest.raises(ValueError, match="recycle_files"):
        LazyCkptConfig(save_dir=str(tmp_path), recycle_files=True)


def test_config_reports_every_problem_under_its_own_names(tmp_path):
    with pytest.raises(OptionsError) as info:
        LazyCkptConfig(save_dir=str(tmp_path), host_cache_gb=1e-9, flush_threads=0, on_error="ignore")
    fields = [field for field, _ in info.value.problems]
    assert fields == ["host_cache_gb", "flush_threads", "on_error"]  # cache_bytes reported as host_cache_gb


def test_every_config_field_reaches_the_engine(tmp_path):
    cfg = LazyCkptConfig(save_dir=str(tmp_path), host_cache_gb=0.5, flush_threads=3, keep_last=7, recycle_files="off")
    passed = {f.name for f in dataclasses.fields(EngineOptions)} | {f.name for f in dataclasses.fields(ManagerOptions)}
    paths = {"save_dir", "load_dir", "local_dir", "host_cache_gb"}  # given to the manager as arguments
    planner = {"allow_vocab_change"}  # given to the load's planner (reshard.ReshardPlanner)
    assert {f.name for f in dataclasses.fields(LazyCkptConfig)} - paths - planner <= passed
    assert cfg.engine_options().cache_bytes == 1 << 29 and cfg.engine_options().flush_threads == 3
    assert cfg.manager_options() == ManagerOptions(keep_last=7, recycle_files="off")


def test_allow_vocab_change_is_off_unless_asked_for(tmp_path):
    assert config_from_args(_parse("--lazy-ckpt", "--save", str(tmp_path))).allow_vocab_change is False
    cfg = config_from_args(_parse("--lazy-ckpt", "--save", str(tmp_path), "--lazy-ckpt-allow-vocab-change"))
    assert cfg.allow_vocab_change is True


def test_load_defaults_to_save(tmp_path):
    cfg = config_from_args(_parse("--lazy-ckpt", "--save", str(tmp_path)))
    assert cfg.load_dir is None and cfg.effective_load_dir == str(tmp_path)


def test_bad_choice_is_an_argparse_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _parse("--save", str(tmp_path), "--lazy-ckpt-on-error", "ignore")
    assert "--lazy-ckpt-on-error" in capsys.readouterr().err


def test_adding_twice_is_a_no_op():
    p = _parser()
    assert add_lazy_ckpt_args(p) is p
    assert p.parse_args(["--lazy-ckpt"]).lazy_ckpt is True


def test_config_from_a_namespace_without_the_group(tmp_path):
    cfg = config_from_args(argparse.Namespace(save=str(tmp_path), load=None))
    assert cfg == LazyCkptConfig(save_dir=str(tmp_path))


def test_requires_save():
    msg = _error("--lazy-ckpt")
    assert "--lazy-ckpt requires --save" in msg


def test_rejects_async_save(tmp_path):
    msg = _error("--lazy-ckpt", "--save", str(tmp_path), async_save=True)
    assert "--lazy-ckpt cannot be combined with --async-save" in msg


def test_reports_every_problem_at_once():
    msg = _error("--lazy-ckpt", "--lazy-ckpt-flush-threads", "0", async_save=True)
    assert "--save" in msg and "--async-save" in msg and "--lazy-ckpt-flush-threads must be >= 1" in msg


@pytest.mark.parametrize("attr, flag, _hint", UNSUPPORTED_MEGATRON_FLAGS)
def test_rejects_megatron_flags_it_cannot_honour(tmp_path, attr, flag, _hint):
    msg = _error("--lazy-ckpt", "--save", str(tmp_path), **{attr: 1 if "interval" in attr else True})
    assert f"cannot be combined with {flag}" in msg


def test_megatron_flags_at_their_defaults_are_fine(tmp_path):
    args = _parse("--lazy-ckpt", "--save", str(tmp_path))
    for attr, _, _ in UNSUPPORTED_MEGATRON_FLAGS:  # Megatron's defaults are None or False
        setattr(args, attr, None if "interval" in attr else False)
    validate_lazy_ckpt_args(args)


def test_override_iteration_zero_counts_as_given(tmp_path):
    msg = _error("--lazy-ckpt", "--save", str(tmp_path), override_ckpt_iteration=0)
    assert "--override-ckpt-iteration" in msg


@pytest.mark.parametrize(
    "argv, text",
    [
        (("--lazy-ckpt-host-cache-gb", "0"), "--lazy-ckpt-host-cache-gb must be > 0"),
        (("--lazy-ckpt-flush-threads", "0"), "--lazy-ckpt-flush-threads must be >= 1"),
        (("--lazy-ckpt-max-inflight", "0"), "--lazy-ckpt-max-inflight must be >= 1"),
        (("--lazy-ckpt-keep-last", "-1"), "--lazy-ckpt-keep-last must be >= 0"),
        (("--lazy-ckpt-keep-every", "-2"), "--lazy-ckpt-keep-every must be >= 0"),
        (("--lazy-ckpt-timeout-s", "0"), "--lazy-ckpt-timeout-s must be > 0"),
        (("--lazy-ckpt-keep-every", "5"), "--lazy-ckpt-keep-every needs --lazy-ckpt-keep-last >= 1"),
    ],
)
def test_numeric_bounds_name_the_flag(tmp_path, argv, text):
    assert text in _error("--lazy-ckpt", "--save", str(tmp_path), *argv)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (("--lazy-ckpt-persist-interval", "5"), "--lazy-ckpt-persist-interval"),
        (("--lazy-ckpt-local-keep-last", "4"), "--lazy-ckpt-local-keep-last"),
        (("--lazy-ckpt-local-fallback", "rank"), "--lazy-ckpt-local-fallback"),
    ],
)
def test_local_tier_flags_need_a_local_dir(tmp_path, argv, flag):
    msg = _error("--lazy-ckpt", "--save", str(tmp_path), *argv)
    assert f"{flag} only applies to a local tier: it requires --lazy-ckpt-local-dir" in msg


@pytest.mark.parametrize(
    "field, value",
    [
        ("persist_interval", 5),
        ("local_keep_last", 4),
        ("local_fallback", "rank"),
        ("replicas", 1),
        ("promote_slots", 0),
        ("promote_mbps", 10.0),
    ],
)
def test_the_config_refuses_local_tier_options_without_a_local_dir(tmp_path, field, value):
    """Checked where the options are (the config, for every front end), not only by the flags."""
    with pytest.raises(OptionsError) as got:
        LazyCkptConfig(save_dir=str(tmp_path), **{field: value})
    assert (field, "only applies to a local tier: it requires local_dir") in got.value.problems
    assert (
        getattr(LazyCkptConfig(save_dir=str(tmp_path), local_dir=str(tmp_path / "l"), **{field: value}), field) == value
    )


def test_local_dir_must_differ_from_save(tmp_path):
    msg = _error("--lazy-ckpt", "--save", str(tmp_path), "--lazy-ckpt-local-dir", str(tmp_path / "."))
    assert "--lazy-ckpt-local-dir and --save must differ" in msg


def test_error_type(tmp_path):
    with pytest.raises(ValueError):
        validate_lazy_ckpt_args(_parse("--lazy-ckpt"))
    assert issubclass(LazyCkptArgsError, CheckpointError)


def test_without_lazy_ckpt_nothing_is_checked_but_ignored_flags_warn(caplog):
    args = _parse("--lazy-ckpt-host-cache-gb", "0", "--lazy-ckpt-direct-io", "on")
    with caplog.at_level(logging.WARNING, logger="datastates_megatron.megatron.megatron_lm.args"):
        validate_lazy_ckpt_args(args)
    assert "--lazy-ckpt-host-cache-gb" in caplog.text and "--lazy-ckpt-direct-io" in caplog.text
    assert "without --lazy-ckpt" in caplog.text


def test_without_lazy_ckpt_and_defaults_there_is_no_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="datastates_megatron.megatron.megatron_lm.args"):
        validate_lazy_ckpt_args(_parse())
    assert caplog.text == ""


def test_host_cache_check_only_applies_without_streaming(tmp_path):
    gib = 1 << 30
    streaming = LazyCkptConfig(save_dir=str(tmp_path), host_cache_gb=1.0)
    check_host_cache_fits(streaming, 10 * gib)  # streamed in chunks: fine
    fixed = dataclasses.replace(streaming, streaming=False)
    check_host_cache_fits(fixed, gib)  # exactly fits
    with pytest.raises(LazyCkptArgsError) as info:
        check_host_cache_fits(fixed, gib + 1, what="largest optimizer shard")
    msg = str(info.value)
    assert "--lazy-ckpt-no-streaming" in msg and "--lazy-ckpt-host-cache-gb" in msg
    assert "largest optimizer shard" in msg and str(gib + 1) in msg


def test_help_lists_the_group(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "lazy-ckpt:" in out and "--no-lazy-ckpt-verify-on-load" in out


def test_commit_telemetry_goes_to_megatron_writers(monkeypatch):
    import sys
    import types

    from datastates_megatron.engine.tiers.commit import CommitRecord
    from datastates_megatron.megatron.megatron_lm import checkpointing as megatron_lm

    got = {"tb": [], "wb": []}

    class TB:
        def add_scalar(self, name, value, step):
            got["tb"].append((name, value, step))

    class WB:
        def log(self, metrics, step):
            got["wb"].append((metrics, step))

    gv = types.ModuleType("megatron.training.global_vars")
    gv.get_tensorboard_writer = lambda: TB()
    gv.get_wandb_writer = lambda: WB()
    monkeypatch.setitem(sys.modules, "megatron.training", types.ModuleType("megatron.training"))
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", gv)
    rec = CommitRecord(
        iteration=7,
        total_bytes=4_000_000,
        bytes_per_rank=(2_000_000, 2_000_000),
        save_call_s=1e-4,
        copy_s=0.01,
        flush_s=0.02,
        commit_s=0.05,
    )
    megatron_lm.log_commit_to_writers(rec, 0.002)
    names = {n for n, _, step in got["tb"] if step == 7}
    assert {"lazy-ckpt/stall-ms", "lazy-ckpt/flush-GBps", "lazy-ckpt/bytes-total"} <= names
    assert got["wb"][0][1] == 7 and got["wb"][0][0]["lazy-ckpt/d2h-GBps"] == 2_000_000 / 0.01 / 1e9


def test_convert_to_needs_a_load_and_a_directory_of_its_own(tmp_path):
    save, out = str(tmp_path / "save"), str(tmp_path / "out")
    assert "--lazy-ckpt-convert-to requires --load" in _error(
        "--lazy-ckpt", "--save", save, "--lazy-ckpt-convert-to", out
    )
    message = _error("--lazy-ckpt", "--save", save, "--load", save, "--lazy-ckpt-convert-to", save + "/")
    assert "--lazy-ckpt-convert-to must be another directory than --save and --load" in message
    validate_lazy_ckpt_args(_parse("--lazy-ckpt", "--save", save, "--load", save, "--lazy-ckpt-convert-to", out))


def test_convert_to_implies_lazy_ckpt(tmp_path):
    """Without --lazy-ckpt a patched Megatron-LM never reaches our glue: it would train instead."""
    args = _parse("--save", str(tmp_path), "--load", str(tmp_path), "--lazy-ckpt-convert-to", str(tmp_path / "out"))
    assert args.lazy_ckpt is True and args.lazy_ckpt_convert_to == str(tmp_path / "out")
    assert _parse("--save", str(tmp_path)).lazy_ckpt is False


def test_replicas_flag_and_megatrons_replication_flags(tmp_path):
    local = ["--save", str(tmp_path / "s"), "--lazy-ckpt-local-dir", str(tmp_path / "l")]
    assert config_from_args(_parse(*local)).manager_options().replicas is None  # auto
    assert config_from_args(_parse(*local, "--lazy-ckpt-replicas", "2")).manager_options().replicas == 2
    assert "--lazy-ckpt-replicas only applies to a local tier" in _error(
        "--save", str(tmp_path / "s"), "--lazy-ckpt-replicas", "1", lazy_ckpt=True
    )
    # Megatron-LM's own flags of its local checkpoints' replication mean the same
    args = _parse(*local)
    args.replication, args.replication_jump, args.replication_factor = True, 8, 3
    opts = config_from_args(args).manager_options()
    assert (opts.replicas, opts.replication_jump) == (2, 8)
    args = _parse(*local, "--lazy-ckpt-replicas", "1")
    args.replication, args.replication_jump, args.replication_factor = True, 8, 3
    with pytest.raises(OptionsError, match="--replication-factor 3 means 2"):
        config_from_args(args)


def test_promotion_throttle_flags(tmp_path):
    local = ("--lazy-ckpt-local-dir", str(tmp_path / "local"))
    args = _parse("--save", str(tmp_path), *local, "--lazy-ckpt-promote-slots", "1", "--lazy-ckpt-promote-mbps", "250")
    config = config_from_args(args)
    assert (config.promote_slots, config.promote_mbps) == (1, 250.0)
    assert (config.manager_options().promote_slots, config.manager_options().promote_mbps) == (1, 250.0)
    assert LazyCkptConfig(save_dir=str(tmp_path)).manager_options().promote_slots == 2  # capped by default
    with pytest.raises(LazyCkptArgsError, match="--lazy-ckpt-promote-slots"):
        validate_lazy_ckpt_args(
            _parse("--lazy-ckpt", "--save", str(tmp_path), *local, "--lazy-ckpt-promote-slots", "-1")
        )


@pytest.mark.parametrize("attr, flag, _why", megatron_flags.LOCAL_PATH_UNDER_SAVE)
def test_save_on_object_storage_refuses_megatron_flags_that_write_under_save(tmp_path, attr, flag, _why):
    url = "s3://bucket/run"
    msg = _error("--lazy-ckpt", "--save", url, "--lazy-ckpt-local-dir", str(tmp_path), **{attr: 1})
    assert f"--save {url} is on object storage but {flag} is given" in msg
    args = _parse("--lazy-ckpt", "--save", str(tmp_path / "ckpt"))  # a directory: Megatron-LM writes there
    setattr(args, attr, 1)
    validate_lazy_ckpt_args(args)


def test_save_on_object_storage_needs_a_wandb_save_dir(tmp_path):
    url = "msc://profile/run"
    argv = ("--lazy-ckpt", "--save", url, "--lazy-ckpt-local-dir", str(tmp_path))
    assert "--wandb-project is given without --wandb-save-dir" in _error(*argv, wandb_project="p", wandb_save_dir=None)
    args = _parse(*argv)
    args.wandb_project, args.wandb_save_dir, args.log_progress = "p", str(tmp_path / "wandb"), False
    validate_lazy_ckpt_args(args)


def test_without_a_tokenizer_the_run_declares_its_vocab_size_flag_or_nothing():
    """Megatron-LM's tokenizer's vocabulary when one is built (tests/integration/test_layout_change.py,
    the vocabulary-padding case); here none is: ``--vocab-size``, or no vocabulary at all."""
    from datastates_megatron.megatron.megatron_lm.checkpointing import run_vocabulary

    assert run_vocabulary(argparse.Namespace(vocab_size=600)) == 600
    assert run_vocabulary(argparse.Namespace(vocab_size=None)) is None
    assert run_vocabulary(argparse.Namespace()) is None
