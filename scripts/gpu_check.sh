#!/usr/bin/env bash
# The device check: one prepared script for a session that is lent a GPU (one H200; <= 8 minutes).
#
# On the development machine (network to the package registry), once:
#     bash scripts/gpu_check.sh --prepare
# writes .gpu/ (ignored by git): the wheels the device image lacks (megatron-core, pydantic, tqdm,
# for Python 3.12) and a patched Megatron-LM core_v0.16.1 tree as a tarball. Then, with the device tool:
#     run(command="bash scripts/gpu_check.sh", carry=[".gpu"], timeout_s=540)
# On the device it installs the wheels into /tmp/site, then runs, each step under its own time limit:
#   1. tests/gpu (CUDA snapshots);
#   2. the demo on 1 GPU, bf16, killed with kill -9 mid-run and resumed bit-exactly;
#   3. Megatron-LM's pretrain_gpt.py: kill -9 / resume (fp32, bf16), SIGTERM final save, a native
#      checkpoint refused (tests/integration/test_pretrain_gpt.py, on CUDA);
#   4. the torch_dist bridge: Megatron's own checkpoint imported, exported and imported again,
#      bit-exact (tests/integration/test_torch_dist_bridge.py, fp32, 1 GPU, torch Adam: no TE);
#   5. bench_peers.py on the GPU workload of docs/BENCHMARKS.md (every engine, one round);
#   6. partner replication (ours_replicated) and a lost node, on the node's CPUs: two ranks as two
#      "nodes" (one GPU cannot hold two NCCL ranks; replication streams host files anyway);
# and prints one summary: a PASS/FAIL line per step and the benchmark table. Logs and the benchmark
# JSON go to $OUT (the device tool brings them back), or to .gpu/out.
set -uo pipefail
cd "$(dirname "$0")/.."
GPU_DIR=.gpu
MLM_TAG=core_v0.16.1

prepare() {
    set -e
    mkdir -p "$GPU_DIR/wheels"
    grep -qx "/$GPU_DIR/" .git/info/exclude 2>/dev/null || echo "/$GPU_DIR/" >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
        -d "$GPU_DIR/wheels" megatron-core==0.16.1 pydantic pydantic-core annotated-types \
        typing-inspection tqdm
    local trees
    trees=$(mktemp -d)
    bash scripts/megatron_lm_tree.sh "${MLM_TAG#core_v}" "$trees" >/dev/null
    tar -czf "$GPU_DIR/megatron-lm-$MLM_TAG-patched.tar.gz" -C "$trees" "$MLM_TAG"
    rm -rf "$trees"
    du -sh "$GPU_DIR"
    echo "prepared $GPU_DIR: carry it with the device tool (carry=[\"$GPU_DIR\"])"
}

if [ "${1:-}" = --prepare ]; then
    prepare
    exit
fi

OUT=${OUT:-$GPU_DIR/out}
mkdir -p "$OUT"
summary=()
step() {  # step NAME SECONDS CMD...: run CMD with a time limit, log to $OUT/NAME.log
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout --signal=INT --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    local verdict=PASS
    [ $rc -eq 0 ] || verdict="FAIL (rc $rc)"
    summary+=("$(printf '%-10s %-14s %4d s' "$name" "$verdict" $((SECONDS - start)))")
    tail -n 3 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$GPU_DIR"/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/mlm && tar -xzf "$GPU_DIR/megatron-lm-$MLM_TAG-patched.tar.gz" -C /tmp/mlm || exit 1
export MEGATRON_LM_DIR=/tmp/mlm/$MLM_TAG

step gpu-tests 90 python3 -m pytest -q -p no:cacheprovider tests/gpu
step demo 150 python3 -m datastates_megatron.demo.run_demo --nproc 1 --bf16 --iters 40 --kill-after 10 \
    --workdir /tmp/dsm-demo
step megatron 210 python3 -m pytest -q -p no:cacheprovider tests/integration/test_pretrain_gpt.py \
    -k "kill_9 or sigterm or native"
step bridge 120 python3 -m pytest -q -p no:cacheprovider tests/integration/test_torch_dist_bridge.py \
    -k "bit_exact and fp32"
step bench 240 torchrun --nproc-per-node 1 scripts/bench_peers.py --layers 24 --hidden 1024 --heads 16 \
    --seq-len 1024 --vocab 32000 --micro-batch 8 --bf16 --iters 20 --warmup 2 --rounds 1 --interval 10 \
    --sweep-engines '' --restore-repeats 1 --host-cache-gb 12 --dir /tmp/bench \
    --local-dir /dev/shm/dsm-local --no-progress --json "$OUT/bench.json"
step replication 150 env CUDA_VISIBLE_DEVICES= torchrun --nproc-per-node 2 scripts/bench_peers.py \
    --engines baseline,ours_local,ours_replicated --sweep-engines '' --rounds 1 --iters 8 --persist-interval 4 \
    --dir /tmp/bench-repl --local-dir /dev/shm/dsm-repl --no-progress --json "$OUT/replication.json"

echo
echo "==== gpu_check summary ($(cat "$OUT/gpu.txt" 2>/dev/null | head -n 1)) ===="
printf '%s\n' "${summary[@]}"
echo "---- bench_peers (last lines of $OUT/bench.log) ----"
tail -n 25 "$OUT/bench.log"
echo "---- replication (last lines of $OUT/replication.log) ----"
tail -n 8 "$OUT/replication.log"
