#!/usr/bin/env bash
# The test command: sets itself up, then runs every test that this machine can run
# (GPU tests skip without CUDA; Megatron-LM patch tests skip without MEGATRON_LM_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -m "not slow" --durations=15 "$@"
