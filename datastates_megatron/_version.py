"""The package version, in one place: ``pyproject.toml`` reads it (``[tool.setuptools.dynamic]``), a
manifest records it as its writer's version, and ``datastates-ckpt --version`` prints it."""

import re

__version__ = "0.1.0"
# what a manifest's ``writer_version`` may hold (a PEP 440 version, local part included): anything else
# read from a file is not shown
VERSION_RE = re.compile(r"^[A-Za-z0-9.+!_-]{1,64}\Z")  # \Z: "$" also matches before a final newline
