#!/usr/bin/env bash
# Create (or reuse) .venv and install the package with everything the tests, demo and benchmarks need.
# Pinned here, not in pyproject.toml (which only bounds them, so that a cluster keeps its own torch):
# torch 2.13.0 (a CPU build is on disk here; a bare `torch` would pull a multi-GB CUDA build), megatron-core 0.16.1,
# and what Megatron-LM's own training code needs (scripts/requirements-megatron-lm.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v make >/dev/null || ! command -v g++ >/dev/null || ! command -v strace >/dev/null; then
  # Megatron-LM builds its dataset helpers with make and g++ at start-up; strace counts a commit's
  # system calls (tests/faults/test_commit_metadata.py)
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq make g++ strace >/dev/null
  else
    echo "warning: make and g++ are needed for the Megatron-LM tests (they will fail without them), strace to count a commit's system calls (skipped without it)" >&2
  fi
fi
if ! command -v fusermount3 >/dev/null || ! ldconfig -p 2>/dev/null | grep libfuse3 >/dev/null; then
  # the fault filesystem of the tests (tests/fusefs: mfusepy over libfuse3, mounted with fusermount3)
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq fuse3 >/dev/null
  else
    echo "warning: fuse3 (libfuse3, fusermount3) is needed for the fault-filesystem tests (they skip without it)" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.dsm-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/requirements-megatron-lm.txt -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[megatron,test,bench]" "megatron-core==0.16.1" "ruff==0.14.8" \
    "mfusepy==3.1.1" "boto3==1.44.18" "botocore==1.44.18" "moto[server]==5.2.6" "multi-storage-client==1.3.1" \
    "safetensors==0.8.0" "transformers==5.25.0" \
    -r scripts/requirements-megatron-lm.txt
  # nvidia-resiliency-ext (the [resiliency] extra: Megatron-LM's --inprocess-restart) in a folder of its own,
  # not in .venv: core_v0.19 and main assert NVRx >= 0.6.0 when megatron.core is imported with NVRx present
  # (megatron/core/dist_checkpointing/strategies/nvrx.py), and 0.4.1 (cp311) is the newest in the registry.
  # tests/integration/test_inprocess_restart.py puts it on its core_v0.16.1 ranks' PYTHONPATH.
  rm -rf .venv-resiliency
  python -m pip install -q --no-deps --target .venv-resiliency \
    "nvidia-resiliency-ext==0.4.1" "nvidia-ml-py==13.615.71" "defusedxml==0.7.1"
  touch "$stamp"
fi
