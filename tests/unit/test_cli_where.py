"""``datastates-ckpt where`` and ``--version`` (issue 35): where the launch scripts and presets are,
for a user of an installed wheel; checked here against the source tree, and installed in
``tests/integration/test_packaging.py``."""

from __future__ import annotations

import json
import os

import pytest

import datastates_megatron
from datastates_megatron.cli import EXIT_OK, EXIT_USAGE, main, package_data

PACKAGE = os.path.dirname(os.path.abspath(datastates_megatron.__file__))


def test_where_lists_the_data_directories_and_no_python_package(capsys):
    assert main(["where"]) == EXIT_OK
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert rows["package"] == PACKAGE
    assert rows["launch"] == os.path.join(PACKAGE, "launch") and rows["configs"] == os.path.join(PACKAGE, "configs")
    assert not {"engine", "megatron", "demo", "__pycache__"} & set(rows)
    assert os.path.isfile(os.path.join(rows["launch"], "lib.sh"))
    assert os.path.isfile(os.path.join(rows["configs"], "gpt-7b-8gpu.env"))


def test_where_name_prints_one_path_and_json_the_map(capsys):
    assert main(["where", "launch"]) == EXIT_OK
    assert capsys.readouterr().out == os.path.join(PACKAGE, "launch") + "\n"
    assert main(["where", "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out) == package_data()


def test_where_an_unknown_name_is_one_line_and_exit_2(capsys):
    assert main(["where", "nope"]) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "no package data named 'nope' (there is: " in err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"datastates-ckpt (datastates-megatron) {datastates_megatron.__version__}\n"
