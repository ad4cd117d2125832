#!/usr/bin/env bash
# The main job: sets itself up, then trains a small GPT on 2 CPU ranks with a checkpoint every
# iteration, kills it with kill -9, resumes, and checks the trajectory is bit-exact.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m datastates_megatron.demo.run_demo "$@"
