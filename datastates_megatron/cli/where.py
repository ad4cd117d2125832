"""``datastates-ckpt where [NAME]``: where the installed package keeps its data (launch scripts,
presets, patches).  Stdlib only: it runs without torch, numpy or numba."""

from __future__ import annotations

import argparse
import os

from .common import EXIT_OK, CliUsageError, emit

__all__ = ["package_data", "run"]

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # datastates_megatron/


def package_data() -> dict[str, str]:
    """The installed package and its data directories (launch scripts, presets, patches: every
    directory of the package that is not a Python package), by name; the ``where --json`` document."""
    found = {"package": PACKAGE}
    for top, dirs, _ in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for d in dirs:
            path = os.path.join(top, d)
            if not os.path.exists(os.path.join(path, "__init__.py")):
                found.setdefault(d, path)
    return found


def run(args: argparse.Namespace) -> int:
    found = package_data()
    if args.name is not None:
        if args.name not in found:
            raise CliUsageError(f"no package data named {args.name!r} (there is: {', '.join(sorted(found))})")
        print(found[args.name])
    elif args.json:
        emit(found)
    else:
        width = max(map(len, found))
        for key, path in found.items():
            print(f"{key:<{width}}  {path}")
    return EXIT_OK
