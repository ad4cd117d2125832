# Shared helpers for the datastates_megatron/launch/*.sbatch scripts: sourced, never executed.
#
# Slurm copies a batch script to its spool directory before running it, so the scripts cannot find
# this file through $0; they use $DSM_LAUNCH_DIR (default: datastates_megatron/launch of the checkout
# $DSM_REPO_DIR, itself by default the directory sbatch was called from; else the installed
# package's, `datastates-ckpt where launch`).  Presets are in the configs/ directory beside it.
#
# Pre-emption protocol (identical in every script):
#   1. Slurm sends SIGUSR1 to the batch shell ahead of the time limit or a pre-emption
#      (`#SBATCH --signal=B:USR1@<seconds>`; a site's PreemptMode may send it too).
#   2. dsm_run_step's trap sends SIGTERM to every task of the job's steps
#      (`scancel --signal=TERM <job>`, which signals and does not cancel). torchrun forwards SIGTERM
#      to its workers and waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds before SIGKILL; a rank
#      launched directly by srun gets it itself.
#   3. The trainer (Megatron-LM with --exit-signal-handler, or our demo) saves a final checkpoint,
#      waits until it is committed and exits.
#   4. The batch shell requeues the job (`scontrol requeue`; the job must be submitted with
#      --requeue) and exits 0. The next run passes --load = --save and resumes from that checkpoint.
# A plain `scancel` (SIGTERM to everything, then SIGKILL) does not requeue.

dsm_log() {
    echo "[$(date '+%F %T')] dsm-launch job=${SLURM_JOB_ID:-none} restart=${SLURM_RESTART_COUNT:-0}: $*"
}

dsm_die() {
    dsm_log "ERROR: $*" >&2
    exit 1
}

# dsm_load_preset NAME_OR_PATH: source configs/NAME.env beside $DSM_LAUNCH_DIR (or a path). Presets assign with
# VAR=${VAR:-default}, so a variable already set in the environment wins over the preset.
dsm_load_preset() {
    local preset="$1" path
    if [ -f "$preset" ]; then
        path="$preset"
    else
        path="$(dirname "$DSM_LAUNCH_DIR")/configs/${preset%.env}.env"
    fi
    [ -f "$path" ] || dsm_die "preset '$preset' not found (looked for $path)"
    # shellcheck disable=SC1090
    source "$path"
    dsm_log "loaded preset $path"
}

# dsm_rendezvous: MASTER_ADDR = first node of the allocation, MASTER_PORT from the job id, so that
# two jobs sharing a node do not collide and a requeued job reuses its port.
dsm_rendezvous() {
    MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"
    MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
    [ -n "$MASTER_ADDR" ] || dsm_die "cannot resolve the first node of '$SLURM_JOB_NODELIST'"
    export MASTER_ADDR MASTER_PORT
}

_dsm_on_preempt() {
    DSM_PREEMPTED=1
    if [ -z "${DSM_STEP_PID:-}" ]; then
        dsm_log "SIGUSR1: pre-emption or time limit ahead, before training started"
    else
        _dsm_forward_term
    fi
}

_dsm_forward_term() {  # once per step
    [ "$DSM_FORWARDED" = 0 ] || return 0
    DSM_FORWARDED=1
    dsm_log "SIGUSR1: pre-emption or time limit ahead; sending SIGTERM to the tasks of job $SLURM_JOB_ID"
    scancel --signal=TERM "$SLURM_JOB_ID" \
        || { dsm_log "scancel --signal failed; signalling srun (pid $DSM_STEP_PID) instead"; \
             kill -TERM "$DSM_STEP_PID" 2>/dev/null || true; }
}

_dsm_requeue() {
    dsm_log "requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" || dsm_die "scontrol requeue $SLURM_JOB_ID failed (submitted without --requeue?)"
    exit 0
}

# From the moment this file is sourced a SIGUSR1 is remembered instead of killing the batch shell.
DSM_PREEMPTED=0
DSM_FORWARDED=0
DSM_STEP_PID=
trap _dsm_on_preempt USR1

# dsm_run_step CMD...: run CMD (an srun command line) in the background so that the USR1 trap
# fires at once, wait for it, and requeue the job if it was pre-empted. Returns CMD's status
# otherwise; exits 0 after a requeue.
dsm_run_step() {
    [ "$DSM_PREEMPTED" = 0 ] || _dsm_requeue
    "$@" &
    DSM_STEP_PID=$!
    local rc=0
    while :; do
        # a SIGUSR1 that came while $! was being read has not been forwarded yet
        [ "$DSM_PREEMPTED" = 0 ] || _dsm_forward_term
        # `wait` returns >128 when a trapped signal interrupts it; keep waiting while the step lives
        wait "$DSM_STEP_PID" && rc=0 || rc=$?
        kill -0 "$DSM_STEP_PID" 2>/dev/null || break
    done
    DSM_STEP_PID=
    if [ "$DSM_PREEMPTED" = 1 ]; then
        # torchrun exits non-zero after forwarding a signal even when every worker saved and
        # exited cleanly, so the step's status says little here; the trainer's log says more.
        dsm_log "step ended (status $rc) after the pre-emption signal"
        _dsm_requeue
    fi
    dsm_log "step ended with status $rc"
    return "$rc"
}

# dsm_pretrain_entry: fill the array PRETRAIN_ENTRY with what follows the interpreter (or torchrun's
# options) to start pretrain_gpt.py. DSM_CPU=1 (a dry run of a GPU script on a laptop, login node or
# CI, no GPU) starts it through datastates_megatron.megatron.cpu.launch; dsm_megatron_args then adds
# the CPU-only flags. DSM_RUNTIME_HOOK=1 (an unpatched Megatron-LM) starts it through
# datastates_megatron.megatron.megatron_lm.run. Everything else is what a GPU job runs.
dsm_pretrain_entry() {
    if [ "${DSM_CPU:-0}" = 1 ]; then
        PRETRAIN_ENTRY=(-m datastates_megatron.megatron.cpu.launch "$MEGATRON_LM_DIR/pretrain_gpt.py")
    elif [ "${DSM_RUNTIME_HOOK:-0}" = 1 ]; then
        PRETRAIN_ENTRY=(-m datastates_megatron.megatron.megatron_lm.run "$MEGATRON_LM_DIR/pretrain_gpt.py")
    else
        PRETRAIN_ENTRY=("$MEGATRON_LM_DIR/pretrain_gpt.py")
    fi
}

# dsm_megatron_args WORLD_SIZE: validate the preset against the allocation and fill the array
# MEGATRON_ARGS for Megatron-LM's pretrain_gpt.py. Reads the preset variables (NUM_LAYERS, TP, ...),
# SAVE_DIR, optional DATA_PATH / TOKENIZER_TYPE / TOKENIZER_MODEL (default: --mock-data with the
# NullTokenizer), optional LAZY_CKPT_LOCAL_DIR (a node-local tier, e.g. /dev/shm/ckpt or local NVMe;
# with LAZY_CKPT_PERSIST_INTERVAL, in iterations, default 10 x SAVE_INTERVAL: the local checkpoints at
# its multiples are promoted to SAVE_DIR, the same iterations after a requeue; LAZY_CKPT_LOCAL_FALLBACK, default all, and
# LAZY_CKPT_REPLICAS, partner nodes keeping a copy, default: 1 when the nodes pair up),
# TENSORBOARD_DIR (default $SAVE_DIR/tensorboard; empty or "none": no TensorBoard), WANDB_PROJECT (set:
# log to Weights & Biases, run name WANDB_EXP_NAME or the job name, files in WANDB_SAVE_DIR, default
# $SAVE_DIR/wandb), LAZY_CKPT_KEEP_LAST (checkpoints kept in SAVE_DIR, default 2: bounded, unlike
# Megatron-LM's and --lazy-ckpt's keep-all default; 0 keeps all) and MEGATRON_EXTRA_ARGS (appended
# verbatim, word-split).
dsm_megatron_args() {
    local world="$1" v
    for v in NUM_LAYERS HIDDEN_SIZE FFN_HIDDEN_SIZE NUM_ATTENTION_HEADS NUM_QUERY_GROUPS SEQ_LENGTH \
             VOCAB_SIZE TP PP MICRO_BATCH_SIZE GLOBAL_BATCH_SIZE TRAIN_ITERS SAVE_INTERVAL \
             LAZY_CKPT_HOST_CACHE_GB LAZY_CKPT_FLUSH_THREADS; do
        [ -n "${!v:-}" ] || dsm_die "$v is not set (preset or environment)"
    done
    [ -n "${SAVE_DIR:-}" ] || dsm_die "set SAVE_DIR to a checkpoint directory on a file system every node sees"
    [ -n "${MEGATRON_LM_DIR:-}" ] || dsm_die "set MEGATRON_LM_DIR to the patched Megatron-LM checkout (datastates-ckpt patch DIR)"
    [ -f "$MEGATRON_LM_DIR/pretrain_gpt.py" ] || dsm_die "no pretrain_gpt.py in MEGATRON_LM_DIR=$MEGATRON_LM_DIR"

    (( world % (TP * PP) == 0 )) || dsm_die "world size $world is not a multiple of TP $TP x PP $PP"
    local dp=$(( world / (TP * PP) ))
    (( GLOBAL_BATCH_SIZE % (MICRO_BATCH_SIZE * dp) == 0 )) \
        || dsm_die "GLOBAL_BATCH_SIZE $GLOBAL_BATCH_SIZE is not a multiple of MICRO_BATCH_SIZE $MICRO_BATCH_SIZE x DP $dp"
    (( NUM_LAYERS % PP == 0 )) || dsm_die "NUM_LAYERS $NUM_LAYERS is not a multiple of PP $PP"
    if [ -n "${NUM_NODES:-}" ] && [ "$NUM_NODES" != "$SLURM_JOB_NUM_NODES" ]; then
        dsm_log "WARNING: the preset expects $NUM_NODES nodes, the job has $SLURM_JOB_NUM_NODES;" \
                "DP is $dp and the per-rank checkpoint shard (host cache sizing) changes accordingly"
    fi
    dsm_log "world=$world TP=$TP PP=$PP DP=$dp micro=$MICRO_BATCH_SIZE global=$GLOBAL_BATCH_SIZE" \
            "host-cache=${LAZY_CKPT_HOST_CACHE_GB}GiB/rank flush-threads=$LAZY_CKPT_FLUSH_THREADS save=$SAVE_DIR"

    MEGATRON_ARGS=(
        --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --ffn-hidden-size "$FFN_HIDDEN_SIZE"
        --num-attention-heads "$NUM_ATTENTION_HEADS"
        --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
        --position-embedding-type rope --normalization RMSNorm --swiglu
        --untie-embeddings-and-output-weights --disable-bias-linear
        --attention-dropout 0.0 --hidden-dropout 0.0
        --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
        --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --bf16
        --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
        --train-iters "$TRAIN_ITERS"
        --lr "${LR:-3.0e-4}" --min-lr "${MIN_LR:-3.0e-5}" --lr-decay-style cosine
        --lr-warmup-iters "${LR_WARMUP_ITERS:-100}" --weight-decay 0.1 --clip-grad 1.0
        --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std "${INIT_METHOD_STD:-0.02}"
        --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-1000}"
        --eval-iters "${EVAL_ITERS:-10}"
        --distributed-timeout-minutes "${DISTRIBUTED_TIMEOUT_MINUTES:-30}"
        # checkpointing: save every SAVE_INTERVAL, resume from the same directory after a requeue,
        # and save a final checkpoint on SIGTERM (sent by the pre-emption protocol in this file)
        --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval "$SAVE_INTERVAL"
        --exit-signal-handler
        --lazy-ckpt
        --lazy-ckpt-host-cache-gb "$LAZY_CKPT_HOST_CACHE_GB"
        --lazy-ckpt-flush-threads "$LAZY_CKPT_FLUSH_THREADS"
        --lazy-ckpt-keep-last "${LAZY_CKPT_KEEP_LAST:-2}"
    )
    if [ "${DSM_CPU:-0}" = 1 ]; then
        dsm_log "DSM_CPU=1: CPU ranks (gloo, local transformer), for a dry run without GPUs"
        MEGATRON_ARGS+=(--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion
                        --no-persist-layer-norm --no-masked-softmax-fusion --no-rope-fusion)
    fi
    if [ -n "${LAZY_CKPT_LOCAL_DIR:-}" ]; then
        MEGATRON_ARGS+=(--lazy-ckpt-local-dir "$LAZY_CKPT_LOCAL_DIR"
                        --lazy-ckpt-persist-interval "${LAZY_CKPT_PERSIST_INTERVAL:-$((10 * SAVE_INTERVAL))}"
                        --lazy-ckpt-local-fallback "${LAZY_CKPT_LOCAL_FALLBACK:-all}")
        if [ -n "${LAZY_CKPT_REPLICAS:-}" ]; then
            MEGATRON_ARGS+=(--lazy-ckpt-replicas "$LAZY_CKPT_REPLICAS")
        fi
    fi
    local tb="${TENSORBOARD_DIR-$SAVE_DIR/tensorboard}"
    if [ -n "$tb" ] && [ "$tb" != none ]; then
        MEGATRON_ARGS+=(--tensorboard-dir "$tb")
    fi
    if [ -n "${WANDB_PROJECT:-}" ]; then
        MEGATRON_ARGS+=(--wandb-project "$WANDB_PROJECT"
                        --wandb-exp-name "${WANDB_EXP_NAME:-${SLURM_JOB_NAME:-dsm-megatron}}"
                        --wandb-save-dir "${WANDB_SAVE_DIR:-$SAVE_DIR/wandb}")
    fi
    if [ "$NUM_QUERY_GROUPS" != "$NUM_ATTENTION_HEADS" ]; then
        MEGATRON_ARGS+=(--group-query-attention --num-query-groups "$NUM_QUERY_GROUPS")
    fi
    if (( TP > 1 )); then
        MEGATRON_ARGS+=(--sequence-parallel)
    fi
    if [ -n "${DATA_PATH:-}" ]; then
        # shellcheck disable=SC2206  # DATA_PATH may be a blend "w1 prefix1 w2 prefix2": word-split
        MEGATRON_ARGS+=(--data-path $DATA_PATH --split "${DATA_SPLIT:-949,50,1}"
                        --tokenizer-type "${TOKENIZER_TYPE:-HuggingFaceTokenizer}")
        [ -z "${TOKENIZER_MODEL:-}" ] || MEGATRON_ARGS+=(--tokenizer-model "$TOKENIZER_MODEL")
    else
        dsm_log "DATA_PATH is not set: training on --mock-data"
        MEGATRON_ARGS+=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB_SIZE")
    fi
    # shellcheck disable=SC2206  # word-split on purpose
    MEGATRON_ARGS+=(${MEGATRON_EXTRA_ARGS:-})
}
