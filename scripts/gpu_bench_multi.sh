#!/usr/bin/env bash
# One run on a machine of several GPUs: tensor- and pipeline-parallel correctness first,
# then scaling against one GPU of the same machine.
#
#   PYTHONPATH=. bash scripts/gpu_bench_multi.sh                  # 2, 4 or 8 H200s; results under $OUT
#   GPU_BENCH_DRY=1 PYTHONPATH=. bash scripts/gpu_bench_multi.sh  # CPU, tiny sizes: the plumbing
#
# It counts the GPUs (torch.cuda.device_count(); GPU_BENCH_DRY_GPUS in a dry run, default
# 2, whose "GPUs" are CPU processes over gloo) and skips, with a line saying so, every step
# that needs more. Tensor-parallel sizes: those of $GPU_BENCH_TP (default "2 4 8") that fit
# (a dry run uses 2 alone: the demo model has two heads). NVLink multicast stays off in
# every process: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1.
#
# Steps (each under its own time limit; a failed step is recorded and the next one runs):
#   correctness  greedy tokens of $BIG (llama-3.1-8b, dummy weights) on W1's requests at
#                each tensor-parallel size against TP=1 (scripts/gpu_bench_multi.py greedy,
#                one process per layout, then compare): in float32 every sequence equal; in
#                bf16 a sequence may diverge only at a near-tie (both runs' log
#                probabilities of the two tokens within $NEAR_TIE nats, default 0.01)
#   scaling      W1 (bench throughput) and L1/P1 (bench latency) on $BIG, dummy bf16, at
#                TP=1 and each tensor-parallel size; the report sets each beside TP=1 with the
#                targets at TP=2: W1 at least 1.7x, L1 at most 0.6x TP=1's ms/token
#   pipeline     PP=2 (2 GPUs) and TP=2 x PP=2 (4 GPUs): float32 greedy tokens equal TP=1's,
#                and W1 in bf16
#   70b          $BIG70 (llama-3.1-70b, dummy bf16, about 141 GB) at TP=8, or TP=4 with 4-7
#                GPUs: W1, L1 and P1; and with --quantization fp8 at TP=2: W1, L1 and P1
#   report       $OUT/<date>-h200x<N>.json (N: the GPUs counted): correctness per layout,
#                W1/L1/P1 per model, weights and layout beside TP=1, a table printed last
# GPU_BENCH_STEPS="correctness scaling" runs a subset of the steps (default: all).
# Files under $OUT: log.txt (everything printed), steps.txt, one JSON per run
# (KIND-MODEL-VARIANT-tpT-ppP.json, see scripts/gpu_bench_multi.py), the report; on the GPU
# machine all but log.txt packed into results.tgz (gpu_bench_common.sh).
set -u -o pipefail

source "$(dirname "$0")/gpu_bench_common.sh"  # PY OUT DRY DATE LOG, step NAME LIMIT_S COMMAND...
HELPER=scripts/gpu_bench_multi.py
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if [ "$DRY" = "1" ]; then
    NGPU=${GPU_BENCH_DRY_GPUS:-2}
    BIG=pagedllm-demo BIG70=pagedllm-demo-draft  # two bundled models: two sets of files
    W1_ARGS=(--num-prompts 8 --input-len 16:64 --output-len 8:32 --seed 0)
    LAT_ARGS=(--input-len 16 --output-len 8 --prefill-len 64 --num-iters 2 --num-iters-warmup 1)
    TP_WANTED="2"
    LIMIT_GREEDY=300 LIMIT_W1=300 LIMIT_LAT=300 LIMIT_70B=300
else
    NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
    BIG=llama-3.1-8b BIG70=llama-3.1-70b
    W1_ARGS=(--num-prompts 256 --input-len 100:1024 --output-len 100:1024 --seed 0)
    LAT_ARGS=()
    TP_WANTED=${GPU_BENCH_TP:-2 4 8}
    LIMIT_GREEDY=${LIMIT_GREEDY:-420} LIMIT_W1=${LIMIT_W1:-300} LIMIT_LAT=${LIMIT_LAT:-180}
    LIMIT_70B=${LIMIT_70B:-600}
fi
NEAR_TIE=${NEAR_TIE:-0.01}
STEPS=${GPU_BENCH_STEPS:-correctness scaling pipeline 70b}
TP_SIZES=()
for tp in $TP_WANTED; do
    [ "$tp" -le "$NGPU" ] && TP_SIZES+=("$tp")
done

# needs NAME GPUS WHAT: whether this machine has GPUS; says so when it does not.
needs() {
    [ "$NGPU" -ge "$2" ] && return 0
    echo "=== $1: $3 skipped (needs $2 GPUs, this machine has $NGPU)" | tee -a "$LOG"
    return 1
}

# greedy STEP DTYPE TP PP: greedy tokens of $BIG on W1's requests in one layout (once).
greedy() {
    local file="$OUT/greedy-$BIG-$2-tp$3-pp$4.json"
    [ -f "$file" ] && return
    step "$1" "$LIMIT_GREEDY" $PY "$HELPER" greedy --model "$BIG" --load-format dummy \
        --dtype "$2" -tp "$3" -pp "$4" "${W1_ARGS[@]}" --out "$file"
}

# correct STEP DTYPE TP PP: that layout's greedy tokens against TP=1's.
correct() {
    local rule=(--exact)
    [ "$2" = "float32" ] || rule=(--near-tie "$NEAR_TIE")
    greedy "$1" "$2" 1 1
    greedy "$1" "$2" "$3" "$4"
    step "$1" 60 $PY "$HELPER" compare --reference "$OUT/greedy-$BIG-$2-tp1-pp1.json" \
        --candidate "$OUT/greedy-$BIG-$2-tp$3-pp$4.json" "${rule[@]}" \
        --out "$OUT/correct-$BIG-$2-tp$3-pp$4.json"
}

# bench KIND STEP MODEL VARIANT TP PP [FLAGS...]: KIND w1 (bench throughput: W1) or lat
# (bench latency: L1 and P1) of MODEL, dummy bf16 weights, in one layout.
bench() {
    local kind=$1 name=$2 model=$3 variant=$4 tp=$5 pp=$6 limit=$LIMIT_W1
    shift 6
    local command=(-m pagedllm.benchmarks.throughput "${W1_ARGS[@]}")
    if [ "$kind" = "lat" ]; then
        command=(-m pagedllm.benchmarks.latency "${LAT_ARGS[@]}")
        limit=$LIMIT_LAT
    fi
    [ "$name" = "70b" ] && limit=$LIMIT_70B
    step "$name" "$limit" $PY "${command[@]}" --model "$model" --load-format dummy \
        --dtype bfloat16 -tp "$tp" -pp "$pp" "$@" --output-json "$OUT/$kind-$model-$variant-tp$tp-pp$pp.json"
}

{
    echo "date $DATE, dry=$DRY, GPUs: $NGPU, tensor-parallel sizes: ${TP_SIZES[*]:-none}, python $($PY -c 'import sys; print(sys.version.split()[0])')"
    $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else "-")' 2>&1
    nvidia-smi --query-gpu=index,name,memory.total --format=csv 2>/dev/null || true
    nvidia-smi topo -m 2>/dev/null || true
    echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS"
} | tee -a "$LOG"
[ ${#TP_SIZES[@]} -gt 0 ] || echo "=== fewer than 2 GPUs: only the TP=1 runs" | tee -a "$LOG"

case " $STEPS " in *" correctness "*)
    for tp in "${TP_SIZES[@]}"; do correct correctness float32 "$tp" 1; done
    for tp in "${TP_SIZES[@]}"; do correct correctness bfloat16 "$tp" 1; done ;;
esac

case " $STEPS " in *" scaling "*)
    for tp in 1 "${TP_SIZES[@]}"; do
        bench w1 scaling "$BIG" bf16 "$tp" 1
        bench lat scaling "$BIG" bf16 "$tp" 1
    done ;;
esac

case " $STEPS " in *" pipeline "*)
    if needs pipeline 2 "PP=2"; then
        correct pipeline float32 1 2
        bench w1 pipeline "$BIG" bf16 1 2
    fi
    if needs pipeline 4 "TP=2 x PP=2"; then
        correct pipeline float32 2 2
        bench w1 pipeline "$BIG" bf16 2 2
    fi ;;
esac

case " $STEPS " in *" 70b "*)
    tp70=8
    [ "$NGPU" -ge 8 ] || tp70=4
    [ "$DRY" = "1" ] && tp70=2  # the demo model's two heads
    if needs 70b 4 "$BIG70 in bf16"; then
        bench w1 70b "$BIG70" bf16 "$tp70" 1
        bench lat 70b "$BIG70" bf16 "$tp70" 1
    fi
    if needs 70b 2 "$BIG70 with FP8 weights"; then
        bench w1 70b "$BIG70" fp8 2 1 --quantization fp8
        bench lat 70b "$BIG70" fp8 2 1 --quantization fp8
    fi ;;
esac

$PY "$HELPER" report --dir "$OUT" --date "$DATE" --gpus "$NGPU" --dry "$DRY" --big "$BIG" 2>&1 \
    | tee -a "$LOG"
