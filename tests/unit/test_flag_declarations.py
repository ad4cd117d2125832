"""One declaration per option: the argparse flags, the config fields and the docs table agree."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from datastates_megatron.megatron.megatron_lm import flag_table
from datastates_megatron.megatron.megatron_lm.args import add_lazy_ckpt_args, all_options, config_from_args
from datastates_megatron.megatron.checkpointing.config import LazyCkptConfig
from datastates_megatron.megatron.checkpointing.flag_spec import default_text, option, options_of


def test_docs_flag_tables_are_generated_from_the_declarations():
    text = flag_table.DOC.read_text(encoding="utf-8")
    assert flag_table.render(text) == text, (
        "docs/megatron.md drifted from the option declarations: run "
        "python -m datastates_megatron.megatron.megatron_lm.flag_table --write"
    )


def test_check_fails_on_a_drifted_table(tmp_path, capsys):
    doc = tmp_path / "megatron.md"
    doc.write_text(flag_table.DOC.read_text(encoding="utf-8").replace("| 0 (keep all) |", "| 2 |"))
    assert flag_table.main(["--check", "--doc", str(doc)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert flag_table.main(["--write", "--doc", str(doc)]) == 0
    assert flag_table.main(["--check", "--doc", str(doc)]) == 0
    doc.write_text("no markers")
    assert flag_table.main(["--check", "--doc", str(doc)]) == 2


def test_every_flag_is_in_the_table_and_in_help(capsys):
    table = flag_table.flags_table()
    parser = add_lazy_ckpt_args(argparse.ArgumentParser(allow_abbrev=False))
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for opt in all_options():
        for spelling in opt.spellings:
            assert f"`{spelling}" in table and spelling in help_text, spelling
    assert "--lazy-ckpt-mapped-writes" in table and "{node}" in table


def test_every_config_field_is_declared_with_its_flag_or_source():
    by_field = {o.field: o for o in options_of(LazyCkptConfig)}
    assert list(by_field) == [f.name for f in dataclasses.fields(LazyCkptConfig)]
    assert all(o.flag or o.megatron for o in by_field.values())

    @dataclasses.dataclass(frozen=True)
    class Undeclared:
        a: int = option(1, "--a", help="a")
        b: int = 2

    with pytest.raises(TypeError, match="Undeclared.b is declared without option"):
        options_of(Undeclared)


def test_parsed_defaults_are_the_config_defaults_and_help_says_them(tmp_path):
    parser = add_lazy_ckpt_args(argparse.ArgumentParser())
    parser.add_argument("--save")
    assert config_from_args(parser.parse_args(["--save", str(tmp_path)])) == LazyCkptConfig(save_dir=str(tmp_path))
    by_flag = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    for opt in all_options():
        if opt.kind != "switch":
            assert by_flag[opt.flag].help.endswith(f"(default: {default_text(opt)})"), opt.flag
    assert LazyCkptConfig(save_dir=str(tmp_path)).keep_last == 0  # --save keeps every checkpoint
