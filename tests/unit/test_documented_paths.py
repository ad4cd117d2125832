"""Every documented path runs on every commit: each ``datastates-ckpt`` subcommand and flag, script
and ``-m datastates_megatron...`` module, ``--lazy-ckpt*`` flag and Python example that README.md and docs/*.md
name (:mod:`tests.doc_paths` extracts them) has an entry in :data:`COVERED` naming the fast tests
(the default set, not ``slow``) that run it.  A newly documented command without an entry fails
here, and so does an entry naming a test that is not there or is slow, or an entry the docs no
longer need.  :data:`NOT_RUN_BY_A_TEST` holds what no test can run, each with the reason."""

from __future__ import annotations

from datastates_megatron.cli.parser import build_parser
from datastates_megatron.megatron.megatron_lm.args import add_lazy_ckpt_args
from tests.doc_paths import documented_paths, why_not_fast

UNIT, FAULTS, INTEGRATION, OBJSTORE = "tests/unit/", "tests/faults/", "tests/integration/", "tests/objstore/"
EVERY_FLAG = UNIT + "test_lazy_ckpt_args.py::test_every_flag_reaches_the_config"
EXPORT = INTEGRATION + "test_export_formats.py::"
HF = INTEGRATION + "test_export_hf.py::"
PRETRAIN_GPT = INTEGRATION + "test_pretrain_gpt.py::test_kill_9_after_a_commit_then_resume_is_bit_exact"

# documented item -> the fast tests that run it
COVERED: dict[str, tuple[str, ...]] = {
    # ------------------------------------------------------------------ the command line
    "datastates-ckpt ls": (UNIT + "test_cli.py::test_ls_lists_committed_uncommitted_latest_and_tracker",),
    "datastates-ckpt inspect": (UNIT + "test_cli.py::test_inspect_shows_manifest_ranks_dtypes_and_objects",),
    "datastates-ckpt verify": (UNIT + "test_cli.py::test_verify_clean_checkpoint",),
    "datastates-ckpt where": (UNIT + "test_cli_where.py::test_where_name_prints_one_path_and_json_the_map",),
    "datastates-ckpt patch": (
        UNIT + "test_deps.py::test_patching_needs_only_python",
        INTEGRATION + "test_megatron_lm_patch.py::test_apply_is_idempotent_and_checkable",
    ),
    "datastates-ckpt patch --check": (UNIT + "test_deps.py::test_patching_needs_only_python",),
    "datastates-ckpt patch --revert": (
        UNIT + "test_deps.py::test_patching_needs_only_python",
        INTEGRATION + "test_megatron_lm_patch.py::test_revert_restores_the_original_files",
    ),
    "datastates-ckpt patch --allow-untested": (
        INTEGRATION
        + "test_megatron_lm_patch.py::test_an_untested_release_of_a_tested_series_is_patched_only_when_allowed",
    ),
    "datastates-ckpt export": (EXPORT + "test_safetensors_export_is_what_the_run_held",),
    "datastates-ckpt export --format": (
        EXPORT + "test_safetensors_export_is_what_the_run_held",
        EXPORT + "test_torch_dist_export_loads_in_megatron_core_as_what_the_run_held",
        EXPORT + "test_torch_export_is_what_the_run_held_model_and_optimizer",
    ),
    "datastates-ckpt export --format safetensors": (EXPORT + "test_safetensors_export_is_what_the_run_held",),
    "datastates-ckpt export --format torch_dist": (
        EXPORT + "test_torch_dist_export_loads_in_megatron_core_as_what_the_run_held",
    ),
    "datastates-ckpt export --format torch": (
        EXPORT + "test_torch_export_is_what_the_run_held_model_and_optimizer",
        EXPORT + "test_torch_export_of_a_tp2_checkpoint_is_refused_in_one_line_naming_the_layout",
    ),
    "datastates-ckpt export --nproc": (
        EXPORT + "test_torch_dist_export_loads_in_megatron_core_as_what_the_run_held",
        UNIT + "test_export_usage.py::test_export_usage_errors_are_one_line",
    ),
    "datastates-ckpt export --format hf": (
        HF + "test_the_export_loads_in_transformers_and_computes_megatron_cores_logits",
        UNIT + "test_export_hf.py::test_the_cli_refuses_in_one_line_and_writes_nothing",
    ),
    "datastates-ckpt export --dry-run": (HF + "test_dry_run_prints_the_mapping_and_the_shards_and_writes_nothing",),
    "datastates-ckpt export --dtype": (HF + "test_a_bf16_export_is_within_bf16_rounding_of_the_fp32_forward",),
    "datastates-ckpt export --max-shard-mb": (
        HF + "test_the_export_loads_in_transformers_and_computes_megatron_cores_logits",
        UNIT + "test_export_hf.py::test_hf_usage_errors_are_one_line",
    ),
    "datastates-ckpt export --iteration": (EXPORT + "test_iteration_picks_a_committed_one_and_refuses_another",),
    "datastates-ckpt export --megatron-lm": (
        INTEGRATION
        + "test_torch_dist_bridge.py::test_megatron_checkpoint_continued_lazily_then_exported_and_continued_is_bit_exact",
        UNIT + "test_export_usage.py::test_export_usage_errors_are_one_line",
    ),
    # ------------------------------------------------------------------ scripts
    "scripts/demo.sh": (
        INTEGRATION + "test_demo_script.py::test_demo_sh_runs_the_demo_module_with_its_arguments",
        INTEGRATION + "test_demo_script.py::test_the_demo_passes_with_a_tiny_model",
    ),
    "scripts/megatron_lm_tree.sh": (
        INTEGRATION + "test_megatron_lm_tree.py::test_a_fresh_tree_patched_or_not_and_never_over_an_existing_one",
    ),
    "scripts/bench_engine.py": (INTEGRATION + "test_bench_engine.py::test_bench_engine_prints_every_measure",),
    "scripts/bench_recovery.py": (
        UNIT
        + "test_bench_recovery_phases.py::test_phases_run_from_the_last_iteration_before_the_fault_to_the_first_after",
        INTEGRATION + "test_inprocess_restart.py::test_exception_in_forward_restarts_in_process_and_resumes_bit_exact",
    ),
    "scripts/bench_host_copy.py": (
        INTEGRATION + "test_bench_host_copy.py::test_bench_host_copy_prints_every_measure_and_restores_from_memory",
    ),
    "scripts/bench_restore.py": (
        INTEGRATION + "test_bench_restore.py::test_bench_restore_prints_every_measure_and_checks_values",
    ),
    "scripts/bench_ckpt_cpu.py": (
        INTEGRATION + "test_bench_ckpt_cpu.py::test_every_mode_prints_a_row_per_rank_with_our_threads_busy",
    ),
    "scripts/bench_paired.py": (
        INTEGRATION + "test_bench_paired.py::test_prints_each_group_and_the_ratios_and_leaves_no_checkpoint_behind",
    ),
    "scripts/bench_peers.py": (INTEGRATION + "test_bench_peers.py::test_fast_engines_report_every_key",),
    "scripts/bench_restart.py": (
        INTEGRATION + "test_bench_restart.py::test_our_restart_alone_reports_every_phase_and_restores_bit_exact",
    ),
    "scripts/bench_memory.py": (INTEGRATION + "test_bench_memory.py::test_ours_over_its_baseline_process",),
    "scripts/bench_stall.py": (
        INTEGRATION + "test_bench_stall.py::test_bench_stall_reports_each_rank_and_the_worst_ratio",
    ),
    "scripts/bench_scale.py": (INTEGRATION + "test_bench_scale.py::test_bench_scale_at_1k_ranks_within_the_bounds",),
    "scripts/bench_s3.py": (
        OBJSTORE + "test_bench_s3.py::test_bench_s3_prints_the_promotion_and_the_restore_against_boto3",
    ),
    # ------------------------------------------------------------------ modules run with -m
    "-m datastates_megatron.megatron.cpu.launch": (PRETRAIN_GPT,),
    "-m datastates_megatron.megatron.megatron_lm.run": (
        UNIT + "test_cpu_launch.py::test_an_untested_megatron_is_refused_with_one_line_naming_the_tested_ones",
        INTEGRATION + "test_runtime_hook.py::test_pretrain_gpt_of_an_unpatched_tree_saves_and_resumes",
    ),
    "-m datastates_megatron.megatron.megatron_lm.flag_table": (
        UNIT + "test_flag_declarations.py::test_check_fails_on_a_drifted_table",
    ),
    # ------------------------------------------------------------------ Python examples
    "python example 1 of README.md": (INTEGRATION + "test_doc_examples.py::test_the_python_examples_run_as_written",),
    "python example 1 of docs/api.md": (INTEGRATION + "test_doc_examples.py::test_the_python_examples_run_as_written",),
    # ------------------------------------------------------------------ --lazy-ckpt flags
    "--lazy-ckpt": (PRETRAIN_GPT, EVERY_FLAG),
    "--lazy-ckpt-host-cache-gb": (PRETRAIN_GPT, EVERY_FLAG),
    "--lazy-ckpt-convert-to": (
        UNIT + "test_lazy_ckpt_args.py::test_convert_to_needs_a_load_and_a_directory_of_its_own",
        INTEGRATION + "test_layout_change.py::test_layout_change_on_a_plain_load_equals_the_torch_dist_conversion",
    ),
    "--lazy-ckpt-allow-vocab-change": (
        UNIT + "test_lazy_ckpt_args.py::test_allow_vocab_change_is_off_unless_asked_for",
        INTEGRATION + "test_reshard.py::test_another_vocabulary_loads_with_the_flag_and_its_new_rows_start_at_zero",
    ),
    "--lazy-ckpt-host-copy": (
        EVERY_FLAG,
        INTEGRATION + "test_inprocess_restart.py::test_exception_in_forward_restarts_in_process_and_resumes_bit_exact",
        INTEGRATION + "test_inprocess_restart.py::test_with_a_node_local_tier_the_restart_reads_nothing_from_save",
    ),
    "--lazy-ckpt-direct-io": (EVERY_FLAG,),
    "--lazy-ckpt-flush-threads": (EVERY_FLAG,),
    "--lazy-ckpt-keep-every": (EVERY_FLAG,),
    "--lazy-ckpt-keep-last": (EVERY_FLAG,),
    "--lazy-ckpt-local-dir": (
        EVERY_FLAG,
        INTEGRATION + "test_pretrain_gpt.py::test_node_local_tier_promotes_and_a_lost_node_resumes_from_save",
    ),
    "--lazy-ckpt-local-fallback": (EVERY_FLAG,),
    "--lazy-ckpt-local-keep-last": (EVERY_FLAG,),
    "--lazy-ckpt-mapped-writes": (EVERY_FLAG,),
    "--lazy-ckpt-max-inflight": (EVERY_FLAG,),
    "--lazy-ckpt-no-streaming": (EVERY_FLAG,),
    "--lazy-ckpt-on-error": (EVERY_FLAG,),
    "--lazy-ckpt-persist-interval": (EVERY_FLAG,),
    "--lazy-ckpt-promote-mbps": (UNIT + "test_lazy_ckpt_args.py::test_promotion_throttle_flags",),
    "--lazy-ckpt-promote-slots": (UNIT + "test_lazy_ckpt_args.py::test_promotion_throttle_flags",),
    "--lazy-ckpt-recycle-files": (EVERY_FLAG,),
    "--lazy-ckpt-replicas": (UNIT + "test_lazy_ckpt_args.py::test_replicas_flag_and_megatrons_replication_flags",),
    "--lazy-ckpt-source-writes": (EVERY_FLAG,),
    "--lazy-ckpt-timeout-s": (EVERY_FLAG,),
    "--lazy-ckpt-verify-on-load": (UNIT + "test_lazy_ckpt_args.py::test_verify_on_load_has_both_spellings",),
    "--lazy-ckpt-when-behind": (
        INTEGRATION + "test_pretrain_gpt.py::test_node_local_tier_promotes_and_a_lost_node_resumes_from_save",
    ),
}
# documented, and run on every commit, but not by a test of the suite
NOT_RUN_BY_A_TEST = {
    "scripts/test.sh": "the test command itself: CI runs it on every commit",
}


def _subcommands() -> set[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return set(sub.choices)


def _documented() -> dict[str, list[str]]:
    return documented_paths(_subcommands())


def test_every_documented_path_names_the_fast_tests_that_run_it():
    documented = _documented()
    missing = [
        f"{item} (documented at {', '.join(where[:2])})"
        for item, where in sorted(documented.items())
        if item not in COVERED and item not in NOT_RUN_BY_A_TEST
    ]
    assert not missing, "documented but no test named in COVERED: " + "; ".join(missing)
    stale = sorted((set(COVERED) | set(NOT_RUN_BY_A_TEST)) - set(documented))
    assert not stale, f"entries the docs no longer name (remove them): {stale}"


def test_every_named_test_exists_and_runs_in_the_default_set():
    problems = [why for tests in COVERED.values() for t in tests if (why := why_not_fast(t))]
    assert not problems, "; ".join(sorted(set(problems)))


def test_every_documented_lazy_ckpt_flag_is_a_declared_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_lazy_ckpt_args(parser)
    declared = {s for a in parser._actions for s in a.option_strings}
    unknown = [
        f"{item} ({', '.join(where[:2])})"
        for item, where in sorted(_documented().items())
        if item.startswith("--lazy-ckpt") and item not in declared
    ]
    assert not unknown, f"the docs name flags that do not exist: {unknown}"


NEW_MODULE = "datastates_megatron" + ".new"  # made up: spelled apart, so test_dotted_names does not look for it


def test_the_check_finds_a_new_command_and_refuses_a_slow_or_missing_test(tmp_path, monkeypatch):
    """The check itself: a command added to a doc is found, a slow or absent test is named."""
    from tests import doc_paths

    doc = tmp_path / "docs"
    doc.mkdir()
    (tmp_path / "README.md").write_text(
        "Run `datastates-ckpt verify DIR --threads 4 --mode fast X -- --num-layers 2`, then\n"
        "```bash\ntorchrun --nproc-per-node 2 scripts/bench_new.py \\\n  --x 1\npython -m " + NEW_MODULE + "\n```\n"
        "and `--lazy-ckpt-new-flag`.\n```python\nimport datastates_megatron\n```\n"
    )
    monkeypatch.setattr(doc_paths, "ROOT", tmp_path)
    found = doc_paths.documented_paths({"verify"})
    assert sorted(found) == [
        "--lazy-ckpt-new-flag",
        "-m " + NEW_MODULE,
        "datastates-ckpt verify",
        "datastates-ckpt verify --mode",
        "datastates-ckpt verify --mode fast",
        "datastates-ckpt verify --threads",
        "python example 1 of README.md",
        "scripts/bench_new.py",
    ]
    assert doc_paths.python_examples() == {"python example 1 of README.md": "import datastates_megatron\n"}
    assert found["scripts/bench_new.py"] == ["README.md:2"]
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text(
        "import pytest\n"
        "def test_fast(): pass\n"
        "@pytest.mark.slow\ndef test_slow(): pass\n"
        "@pytest.mark.parametrize('a', [pytest.param(1, marks=pytest.mark.slow), 2])\ndef test_partly(a): pass\n"
        "@pytest.mark.parametrize('a', [pytest.param(1, marks=pytest.mark.slow)])\ndef test_all_slow(a): pass\n"
    )
    (tests / "test_y.py").write_text("import pytest\npytestmark = [pytest.mark.slow]\ndef test_fast(): pass\n")
    (tests / "test_w.py").write_text(
        "import pytest\nclass TestW:\n    pytestmark = pytest.mark.slow\n    def test_a(self): pass\n"
    )
    assert "class is marked slow" in doc_paths.why_not_fast("tests/test_w.py::TestW::test_a")
    assert doc_paths.why_not_fast("tests/test_x.py::test_fast") is None
    assert doc_paths.why_not_fast("tests/test_x.py::test_partly") is None
    assert "marked slow" in doc_paths.why_not_fast("tests/test_x.py::test_slow")
    assert "marked slow" in doc_paths.why_not_fast("tests/test_x.py::test_all_slow")
    assert "no such test" in doc_paths.why_not_fast("tests/test_x.py::test_gone")
    assert "module is marked slow" in doc_paths.why_not_fast("tests/test_y.py::test_fast")
    assert "no such test file" in doc_paths.why_not_fast("tests/test_z.py::test_fast")
