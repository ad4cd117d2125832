#!/usr/bin/env bash
# docs/BENCHMARKS.md, "Export to Hugging Face": a ~1.2 GB (fp32) Llama-style GPT trained 1 iteration by
# Megatron-LM's pretrain_gpt.py --lazy-ckpt at PP2 on 2 gloo CPU ranks, then exported by
# `datastates-ckpt export --format hf` and `--format safetensors`; prints each export's wall time and
# its peak anonymous and file-backed RSS (/proc/PID/status polled every 20 ms).
# Usage: MEGATRON_LM_DIR=<patched tree> scripts/bench_export_hf.sh WORK_DIR   (WORK_DIR: ~5 GB free)
set -euo pipefail
D=${1:?usage: MEGATRON_LM_DIR=... $0 WORK_DIR}
: "${MEGATRON_LM_DIR:?set MEGATRON_LM_DIR to a Megatron-LM tree (scripts/megatron_lm_tree.sh)}"
export OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONWARNINGS=ignore
mkdir -p "$D"
if [ ! -e "$D/ckpt" ]; then
  torchrun --nproc-per-node 2 --master-port "${PORT:-29731}" -m datastates_megatron.megatron.cpu.launch \
    "$MEGATRON_LM_DIR/pretrain_gpt.py" \
    --distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion \
    --no-persist-layer-norm --no-masked-softmax-fusion \
    --num-layers 20 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16 \
    --group-query-attention --num-query-groups 4 --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 1 --global-batch-size 2 --position-embedding-type rope --no-rope-fusion \
    --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --lr 1e-4 --train-iters 1 \
    --eval-iters 0 --eval-interval 1000 --pipeline-model-parallel-size 2 --use-distributed-optimizer \
    --log-interval 1 --save "$D/ckpt" --save-interval 1 --lazy-ckpt --lazy-ckpt-host-cache-gb 1 >"$D/train.log" 2>&1
fi
echo "checkpoint: $(du -sb "$D/ckpt" | cut -f1) bytes; $(uptime)"
for fmt in hf safetensors; do
  rm -rf "$D/out-$fmt"
  python - "$fmt" "$D" <<'PY'
import re, subprocess, sys, time
fmt, d = sys.argv[1:]
t0 = time.monotonic()
p = subprocess.Popen([sys.executable, "-m", "datastates_megatron.cli", "export", f"{d}/ckpt", f"{d}/out-{fmt}", "--format", fmt])
peak = dict.fromkeys(("RssAnon", "RssFile", "VmHWM"), 0)
while p.poll() is None:
    try:
        status = open(f"/proc/{p.pid}/status").read()
    except OSError:
        break
    for k in peak:
        m = re.search(k + r":\s+(\d+)", status)
        peak[k] = max(peak[k], int(m.group(1)) // 1024) if m else peak[k]
    time.sleep(0.02)
p.wait()
print(f"{fmt}: rc={p.returncode} wall={time.monotonic() - t0:.1f} s peak MiB {peak}")
PY
  echo "  $(uptime)"
done
