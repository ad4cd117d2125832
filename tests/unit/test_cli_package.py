"""``datastates-ckpt`` is one module per command (``datastates_megatron/cli/<command>.py``, each with
``run``), its parser in ``cli/parser.py``; the console script and ``python -m datastates_megatron.cli``
both reach ``main``."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from datastates_megatron import __version__
from datastates_megatron.cli.parser import build_parser

ROOT = Path(__file__).resolve().parents[2]


def test_every_command_of_the_parser_is_a_module_with_run():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    assert set(sub.choices) == {"ls", "inspect", "verify", "export", "where", "patch"}
    for command in sub.choices:
        module = importlib.import_module(f"datastates_megatron.cli.{command}")
        assert callable(module.run), command


def test_the_console_script_and_python_m_reach_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["datastates-ckpt"].partition(":")
    assert callable(getattr(importlib.import_module(module), name))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "datastates_megatron.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0 and r.stdout == f"datastates-ckpt (datastates-megatron) {__version__}\n", r
