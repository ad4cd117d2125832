#!/usr/bin/env bash
# The test command: sets itself up, then runs every test that this machine can run (GPU tests skip
# without CUDA). Megatron-LM tests use MEGATRON_LM_DIR (a patched checkout) when it is set; otherwise
# a fresh copy of core_v0.16.1 from ../shared/megatron-lm is unpacked and patched for this run, and
# core_v0.19.0 and main-2026-08-22 are added (MEGATRON_LM_DIRS: the patch/argument tests; main also
# runs pretrain_gpt.py end to end). Unpatched copies of all three (MEGATRON_LM_PRISTINE_DIRS, unless
# set) are what the runtime-hook tests train. The trees are the rows of datastates_megatron/megatron/megatron_lm/versions.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ -d ../shared/megatron-lm ] && { [ -z "${MEGATRON_LM_DIR:-}" ] || [ -z "${MEGATRON_LM_PRISTINE_DIRS:-}" ]; }; then
  trees=$(mktemp -d /tmp/dsm-megatron-lm.XXXXXX)
  trap 'rm -rf "$trees"' EXIT
fi
if [ -z "${MEGATRON_LM_DIR:-}" ] && [ -d ../shared/megatron-lm ]; then
  MEGATRON_LM_DIR=$(bash scripts/megatron_lm_tree.sh 0.16.1 "$trees")
  MEGATRON_LM_DIRS="$MEGATRON_LM_DIR:$(bash scripts/megatron_lm_tree.sh 0.19.0 "$trees"):$(
    bash scripts/megatron_lm_tree.sh main-2026-08-22 "$trees")"
  export MEGATRON_LM_DIR MEGATRON_LM_DIRS
fi
if [ -z "${MEGATRON_LM_PRISTINE_DIRS:-}" ] && [ -d ../shared/megatron-lm ]; then
  MEGATRON_LM_PRISTINE_DIRS="$(bash scripts/megatron_lm_tree.sh --no-patch 0.16.1 "$trees/pristine"):$(
    bash scripts/megatron_lm_tree.sh --no-patch 0.19.0 "$trees/pristine"):$(
    bash scripts/megatron_lm_tree.sh --no-patch main-2026-08-22 "$trees/pristine")"
  export MEGATRON_LM_PRISTINE_DIRS
fi
python -m pytest -m "not slow" --durations=40 "$@"
