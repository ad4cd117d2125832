#!/usr/bin/env bash
# Create (or reuse) .venv and install the package with everything the tests, demo and benchmarks need.
# Pinned: torch 2.13.0 (a CPU build is on disk here; a bare `torch` would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.dsm-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[megatron,test,bench]"
  touch "$stamp"
fi
