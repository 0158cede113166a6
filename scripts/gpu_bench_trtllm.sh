#!/usr/bin/env bash
# TensorRT-LLM's published FP8 table for Llama-3.1-8B, shape by shape, beside ours:
# llama-3.1-8b (dummy weights) with FP8 weights and FP8 KV cache, and bf16 in the same run.
#
#   PYTHONPATH=. bash scripts/gpu_bench_trtllm.sh                  # H200; results under $OUT
#   TRTLLM_SCALE=0.1 PYTHONPATH=. bash scripts/gpu_bench_trtllm.sh # a tenth of the requests
#   GPU_BENCH_DRY=1 PYTHONPATH=. bash scripts/gpu_bench_trtllm.sh  # CPU, tiny sizes: the plumbing
#
# The shapes (prompt/output tokens x requests, TRT-LLM's output tok/s): 128/128 x 30,000
# (27,911), 2048/128 x 3,000 (3,538), 1000/1000 x 3,000 (17,744), 500/2000 x 3,000
# (20,770), 2048/2048 x 1,500 (12,194); the table lives in scripts/gpu_bench_trtllm.py.
# Each request has random prompt token ids and ignores EOS; all are submitted at once
# (bench throughput --shapes: one engine per dtype runs every shape in turn, started and
# warmed up once, with --step-timing).
#
# Steps (each under its own time limit, the H200 records' prediction twice over plus
# start-up; a failed step is recorded and the next one runs):
#   fp8      every shape with --quantization fp8 --kv-cache-dtype fp8
#   bf16     every shape with bf16 weights and cache
#   report   trtllm-<in>-<out>.json per shape (ours per dtype, TRT-LLM's, the ratios, the
#            scale) and <date>-<h200|h100>-trtllm.json, and the table printed last
# Settings:
#   TRTLLM_SCALE   fraction of each shape's request count to send (default 1.0; full runs
#                  take about 28 minutes of H200 time for FP8 and 34 for bf16); recorded
#   TRTLLM_SHAPES  the shapes to run, e.g. "128/128 1000/1000" (default: all five)
#   TRTLLM_DTYPES  the columns, "fp8 bf16" (default), "fp8" or "bf16"
#   TRTLLM_ARGS    engine flags for every run, e.g. "--max-num-seqs 1024" (printed in the table)
#   TRTLLM_REFERENCE  TRT-LLM's table to compare with: auto (default: its H100 table on an
#                  H100, else its H200 one, issue 26's target), h200 or h100
# Files under $OUT: log.txt (everything printed), steps.txt, trtllm-<dtype>.json (the bench
# records), one JSON per shape, the report; on the GPU machine all but log.txt packed into
# results.tgz (gpu_bench_common.sh).
set -u -o pipefail

source "$(dirname "$0")/gpu_bench_common.sh"  # PY OUT DRY DATE LOG, step NAME LIMIT_S COMMAND...
HELPER=scripts/gpu_bench_trtllm.py
SCALE=${TRTLLM_SCALE:-1.0}
SHAPES=${TRTLLM_SHAPES:-}
DTYPES=${TRTLLM_DTYPES:-fp8 bf16}
read -r -a ENGINE_FLAGS <<<"${TRTLLM_ARGS:-}"
STEPS=$DTYPES
BIG=llama-3.1-8b
[ "$DRY" = "1" ] && BIG=pagedllm-demo

{
    echo "date $DATE, dry=$DRY, scale $SCALE, shapes: ${SHAPES:-all}, dtypes: $DTYPES, engine flags: ${TRTLLM_ARGS:-none}"
    $PY -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__); print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")' 2>&1
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null || true
} | tee -a "$LOG"

for dtype in $DTYPES; do
    plan=$($PY "$HELPER" plan --dtype "$dtype" --scale "$SCALE" --shapes "$SHAPES" --dry "$DRY") \
        || exit 2
    read -r shapes limit <<<"$plan"
    flags=()
    [ "$dtype" = "fp8" ] && flags=(--quantization fp8 --kv-cache-dtype fp8)
    step "$dtype" "$limit" $PY -m pagedllm.benchmarks.throughput --model "$BIG" \
        --load-format dummy --shapes "$shapes" --seed 0 --step-timing "${flags[@]}" \
        "${ENGINE_FLAGS[@]}" --output-json "$OUT/trtllm-$dtype.json"
done

$PY "$HELPER" report --dir "$OUT" --date "$DATE" --scale "$SCALE" --dry "$DRY" \
    --dtypes "$DTYPES" --engine-flags "${TRTLLM_ARGS:-}" \
    --reference "${TRTLLM_REFERENCE:-auto}" 2>&1 | tee -a "$LOG"
