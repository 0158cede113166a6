#!/usr/bin/env bash
# One run on the GPU machine: correctness first, then the benchmark workloads.
#
#   PYTHONPATH=. bash scripts/gpu_bench.sh                  # H200; results under $OUT
#   GPU_BENCH_DRY=1 PYTHONPATH=. bash scripts/gpu_bench.sh  # CPU, tiny sizes: the plumbing
#
# The GPU machine lacks the server's packages: scripts/fetch_gpu_wheels.sh fetches them as
# wheels (uvloop included, as users have it) to carry there.
#
# Steps (each under its own time limit, so a slow one cannot eat the whole run; a failed
# step is recorded and the next one runs):
#   tests    pytest of the kernels, fused ops, CUDA graphs, models, engine and structured
#            outputs (natively; on a GPU the masks of refused rows are filled ahead)
#   kernels  scripts/check_kernels_gpu.py: Triton attention vs the torch reference, timed
#   w1       W1 on llama-3.1-8b (dummy bf16): pagedllm on all 256 requests, and pagedllm
#            and the peers $HF_BACKENDS (default: HF static batching and HF continuous
#            batching; HF_BACKENDS="" for none) side by side on the first $HF_PROMPTS (the
#            peers are slow; each stops at $HF_LIMIT_S seconds and is credited with what
#            it produced)
#   latency  L1 (batch 1, 128 + 256 tokens) and P1 (4 x 2048 prompt tokens) on llama-3.1-8b
#   long     P2 (one 32,000-token prompt) and L2 (batch-1 decode at 32,000 tokens of context)
#            on llama-3.1-8b, then P2 again in chunks of each of $LONG_CHUNKS tokens
#            (--max-num-batched-tokens; default "8192 16384"); P2 and P1 again with each
#            setting of $LONG_AB (space-separated VAR=value; default
#            "PAGEDLLM_DENSE_PREFILL=off", set and empty for none); and check_kernels_gpu.py
#            --long-context: long prompts through the Triton kernel and a library's fused
#            attention, prefill attention of long prompts over tiles and tile order,
#            decode attention at long contexts over splits and tiles
#   w1-small W1 on qwen3-0.6b (the host-overhead-bound regime)
#   sync     W1 on both models again with --no-async-scheduling: what hiding the host's
#            work behind the GPU gains, measured in the same run
#   structured W1 on both models, unconstrained and with every request constrained to a
#            JSON schema (bench throughput --structured-output json), side by side, then
#            again with $STRUCTURED_AB (VAR=value..., default PAGEDLLM_GRAMMAR_FILL=rows,
#            set and empty for none) into structured-ab-w1-<model>.json; the
#            config-only models get a tokenizer of their vocabulary size first
#            (pagedllm.benchmarks.bench_tokenizer); for qwen3-0.6b also the host's masks
#            alone (scripts/bench_structured_masks.py, $STRUCTURED_MASK_ROWS rows over
#            $STRUCTURED_MASK_STEPS steps) on 1, 4 and the engine's fill threads, and the
#            engine's threads taking rows from one queue (PAGEDLLM_GRAMMAR_FILL=rows), into
#            structured-masks-<1|4|default|rows>.txt
#   fp8      W1 and L1/P1 on llama-3.1-8b with --quantization fp8 (compare with w1 and
#            latency, bf16, in the same run); W1 again with --kv-cache-dtype fp8 as well
#            (the report gives both runs' KV capacity in tokens and their ratio); and
#            tests/quantization/test_fp8_kv_cache.py on the GPU (greedy tokens against HF
#            with FP8 keys and values, held-out perplexity within 1%); and
#            check_kernels_gpu.py --fp8-kv (the kernels over an FP8 cache at real sizes
#            against the torch reference; decode over bf16 and FP8 caches by tile), and
#            decode_step_sweep.py --parts widen (the FP8 cache's tiles widened at the
#            products' operand loads or before them, PAGEDLLM_FP8_KV_WIDEN, by tile); and
#            scripts/gemv_quant_sweep.py --kinds fp8 (the small-batch product's tiles);
#            then W1 and L1/P1 with block-wise FP8 weights (Qwen3's and DeepSeek-V3's
#            128 x 128 layout, given to the dummy weights by --hf-overrides) into
#            fp8-block-*.json, beside the per-channel runs above
#   w4a16    W1 and L1/P1 on llama-3.1-8b with dummy 4-bit weights (--quantization gptq
#            --load-format dummy: groups of 128, the W4A16 kernels of layers/int_matmul.py
#            and the small-batch product); the report sets each beside the bf16 record of
#            the w1 and latency steps; and scripts/gemv_quant_sweep.py --kinds int4 (the
#            small-batch and int_matmul tiles, in CUDA graphs); then W1 and L1 with INT8
#            W8A8 weights (compressed-tensors int-quantized, per-token int8 inputs, given to
#            the dummy weights by --hf-overrides) into int8-w8a8-*.json, and
#            gemv_quant_sweep.py --kinds int8 --int8-gemm-rows 64,256 (INT8's small-batch
#            and int8_matmul tiles beside torch._int_mm and bf16); then W1 and L1 with
#            bitsandbytes NF4 (--quantization bitsandbytes: quantized at load, the codebook
#            path of the integer kernels) into bnb-nf4-*.json, and with bitsandbytes 8-bit
#            (LLM.int8 by --hf-overrides: int8 sums on the tensor cores, the outliers as two
#            more int8 rows) into bnb-int8-*.json
#   spec     scripts/spec_decode_costs.py: verification and draft costs of llama-3.1-8b with
#            llama-3.2-1b (K = 4) against a decode step, at batch 1, 8, 32 and 128
#   moe      L1, P1 and W1 on $MOE (mixtral-8x7b, dummy bf16) and W1 on $MOE_SMALL
#            (qwen3-30b-a3b): the report sets Mixtral's W1 beside llama-3.1-8b's of the same
#            run (target: at least 0.6x); and scripts/bench_fused_moe.py --sweep: the grouped
#            MoE GEMM's tiles against the loop over experts at both models' expert shapes;
#            and W1 on $MOE_SMALL with FP8 experts, per channel (--quantization fp8) and
#            block-wise (--hf-overrides) into moe-fp8-w1-*.json and moe-fp8-block-w1-*.json,
#            and with 4-bit experts (--quantization gptq, groups of 128) into
#            moe-w4a16-w1-*.json, INT8 W8A8 experts (--hf-overrides) into
#            moe-int8-w8a8-w1-*.json and bitsandbytes NF4 ones into moe-bnb-nf4-w1-*.json;
#            bench_fused_moe.py --fp8 channel|block and --int-bits 4: the FP8 and 4-bit
#            grouped GEMMs beside bf16's
#   serve    the HTTP path beside the offline engine on both models (scripts/gpu_bench_serve.py):
#            bench throughput, then pagedllm serve and bench serve (streaming, all at once)
#            on the same $SERVE_ARGS workload (1,000 requests of 1,024 prompt and 128 output
#            tokens), with one API server process and with two (--api-server-count), two
#            rounds interleaved (a prefill step's time moves by 15% between runs); target
#            HTTP >= 0.97x offline; the CPU seconds of the API processes, the engine core and
#            the client, and (py-spy on PATH) their profiles
#   ab       for each setting in $GPU_BENCH_AB (space-separated VAR=value, e.g.
#            "PAGEDLLM_DECODE_LONGEST_FIRST=0 PAGEDLLM_MIXED_GRAPHS=1"), L1 and W1 on llama-3.1-8b
#            (or each model of $GPU_BENCH_AB_MODELS, e.g. "qwen3-0.6b llama-3.1-8b") with
#            the setting, beside the same commands without it, into $OUT/ab.txt
#            (only when GPU_BENCH_AB is set; $GPU_BENCH_AB_ARGS, e.g. "--quantization fp8",
#            goes to every command of the step); and for each revision in $GPU_BENCH_AB_REVS
#            (extracted by scripts/ab_prepare.sh into .ab/<rev>, carried to the machine),
#            L1 and W1 on that revision and on the working tree, in $GPU_BENCH_AB_ROUNDS
#            (default 2) interleaved rounds; with no revisions and GPU_BENCH_AB_ROUNDS
#            set, that many rounds of the working tree alone (its run-to-run spread);
#            $GPU_BENCH_AB_BATCH_SIZES (e.g. "1 2 4 8"): L1 at each of these batch sizes
#            (decode batches of a few sequences), $GPU_BENCH_AB_W1=0: no W1
#   report   $OUT/<date>-h200.json: one record per workload, and a table printed last
# GPU_BENCH_STEPS="w1 latency" runs a subset of the steps (default: all); GPU_BENCH_TESTS
# the test paths of the tests step.
# Files under $OUT: log.txt (everything printed), steps.txt, one JSON per step, the report;
# on the GPU machine all but log.txt packed into results.tgz (gpu_bench_common.sh).
set -u -o pipefail

source "$(dirname "$0")/gpu_bench_common.sh"  # PY OUT DRY DATE LOG, step NAME LIMIT_S COMMAND...

if [ "$DRY" = "1" ]; then
    BIG=pagedllm-demo SMALL=pagedllm-demo MOE=pagedllm-demo MOE_SMALL=pagedllm-demo
    TESTS=(tests/worker tests/layers)
    W1_ARGS=(--num-prompts 8 --input-len 16:64 --output-len 8:32)
    HF_PROMPTS=4 HF_LIMIT_S=30
    LAT_ARGS=(--input-len 16 --output-len 8 --prefill-len 64 --num-iters 2 --num-iters-warmup 1)
    LIMIT_TESTS=300 LIMIT_KERNELS=10 LIMIT_W1=300 LIMIT_LAT=120 LIMIT_SMALL=120 LIMIT_SYNC=300
    LIMIT_AB=300 LIMIT_STRUCTURED=300 LIMIT_FP8_KERNELS=0 LIMIT_SERVE=300 LIMIT_SWEEP=0
    STRUCTURED_MASK_ROWS=8 STRUCTURED_MASK_STEPS=3
    SERVE_ARGS=(--num-prompts 8 --input-len 16 --output-len 8 --api-server-counts 1,2)
    LONG_ARGS=(--input-len 200 --output-len 8 --prefill-batch 1 --prefill-len 300 --num-iters 1
               --num-iters-warmup 1) LONG_CHUNKS=${LONG_CHUNKS-128} LIMIT_LONG=120
    LONG_AB=${LONG_AB-PAGEDLLM_DENSE_PREFILL=off}
    FP8_BLOCK=32  # the demo model's fused shards start on blocks of 32
else
    BIG=llama-3.1-8b SMALL=qwen3-0.6b MOE=mixtral-8x7b MOE_SMALL=qwen3-30b-a3b
    read -r -a TESTS <<<"${GPU_BENCH_TESTS:-tests/worker tests/layers tests/kernels tests/models tests/engine tests/structured}"
    W1_ARGS=(--num-prompts 256 --input-len 100:1024 --output-len 100:1024 --seed 0)
    HF_PROMPTS=${HF_PROMPTS:-64} HF_LIMIT_S=${HF_LIMIT_S:-35}
    LIMIT_SYNC=${LIMIT_SYNC:-60}
    LAT_ARGS=()
    LIMIT_TESTS=${LIMIT_TESTS:-360} LIMIT_KERNELS=40 LIMIT_W1=${LIMIT_W1:-220}
    LIMIT_LAT=${LIMIT_LAT:-60} LIMIT_SMALL=50
    LIMIT_FP8_KERNELS=${LIMIT_FP8_KERNELS:-150} LIMIT_SWEEP=${LIMIT_SWEEP:-200}
    LIMIT_AB=${LIMIT_AB:-200} LIMIT_STRUCTURED=${LIMIT_STRUCTURED:-240} LIMIT_SERVE=${LIMIT_SERVE:-420}
    SERVE_ARGS=(--num-prompts 1000 --input-len 1024 --output-len 128 --api-server-counts 1,2
                --rounds 2 --py-spy-seconds 8)
    LONG_ARGS=(--input-len 32000 --output-len 128 --prefill-batch 1 --prefill-len 32000
               --num-iters 3 --num-iters-warmup 1)
    LONG_CHUNKS=${LONG_CHUNKS-8192 16384} LIMIT_LONG=${LIMIT_LONG:-150}
    LONG_AB=${LONG_AB-PAGEDLLM_DENSE_PREFILL=off}
    FP8_BLOCK=128
fi
BLOCK_FP8_CONFIG="{\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [$FP8_BLOCK, $FP8_BLOCK]}}"
INT8_ARGS='{"num_bits": 8, "type": "int", "symmetric": true'
BNB8_CONFIG='{"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": true}}'
W8A8_CONFIG="{\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"format\": \"int-quantized\", \"ignore\": [\"lm_head\"], \"config_groups\": {\"group_0\": {\"targets\": [\"Linear\"], \"weights\": $INT8_ARGS, \"strategy\": \"channel\"}, \"input_activations\": $INT8_ARGS, \"strategy\": \"token\", \"dynamic\": true}}}}}"

HF_BACKENDS=${HF_BACKENDS-hf,hf-cb}  # set and empty: no peers
STRUCTURED_AB=${STRUCTURED_AB-PAGEDLLM_GRAMMAR_FILL=rows}  # set and empty: no second run
STRUCTURED_MASK_ROWS=${STRUCTURED_MASK_ROWS:-128} STRUCTURED_MASK_STEPS=${STRUCTURED_MASK_STEPS:-30}
STEPS=${GPU_BENCH_STEPS:-tests kernels w1 latency long w1-small sync fp8 w4a16 spec moe structured serve ab}
read -r -a AB_SETTINGS <<<"${GPU_BENCH_AB:-}"

{
    echo "date $DATE, dry=$DRY, python $($PY -c 'import sys; print(sys.version.split()[0])')"
    $PY -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__); print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")' 2>&1
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null || true
} | tee -a "$LOG"

step tests "$LIMIT_TESTS" $PY -m pytest -q -x -p no:cacheprovider "${TESTS[@]}"

if [ "$DRY" = "1" ]; then
    echo "=== kernels: skipped in a dry run (needs CUDA)" | tee -a "$LOG"
else
    step kernels "$LIMIT_KERNELS" $PY scripts/check_kernels_gpu.py --out "$OUT/kernels.json"
fi

step w1 "$LIMIT_W1" $PY -m pagedllm.benchmarks.throughput --model "$BIG" --load-format dummy \
    "${W1_ARGS[@]}" --backend "$HF_BACKENDS,pagedllm" --hf-num-prompts "$HF_PROMPTS" \
    --hf-time-limit-s "$HF_LIMIT_S" --step-timing --output-json "$OUT/w1-$BIG.json"

step latency "$LIMIT_LAT" $PY -m pagedllm.benchmarks.latency --model "$BIG" --load-format dummy \
    "${LAT_ARGS[@]}" --step-timing --torch-profile --output-json "$OUT/latency-$BIG.json"

step long "$LIMIT_LONG" $PY -m pagedllm.benchmarks.latency --model "$BIG" --load-format dummy \
    "${LONG_ARGS[@]}" --batch-size 1 --step-timing --torch-profile --output-json "$OUT/long-$BIG.json"
for chunk in $LONG_CHUNKS; do
    step long "$LIMIT_LONG" $PY -m pagedllm.benchmarks.latency --model "$BIG" --load-format dummy \
        "${LONG_ARGS[@]}" --workload P1 --max-num-batched-tokens "$chunk" \
        --output-json "$OUT/long-chunk$chunk-$BIG.json"
done
read -r -a LONG_AB_SETTINGS <<<"$LONG_AB"
for i in "${!LONG_AB_SETTINGS[@]}"; do
    echo "${LONG_AB_SETTINGS[$i]}" >"$OUT/long-ab$i.setting"
    step long "$LIMIT_LONG" env "${LONG_AB_SETTINGS[$i]}" $PY -m pagedllm.benchmarks.latency \
        --model "$BIG" --load-format dummy "${LONG_ARGS[@]}" --workload P1 \
        --output-json "$OUT/long-ab$i-P2-$BIG.json"
    step long "$LIMIT_LONG" env "${LONG_AB_SETTINGS[$i]}" $PY -m pagedllm.benchmarks.latency \
        --model "$BIG" --load-format dummy "${LAT_ARGS[@]}" --workload P1 \
        --output-json "$OUT/long-ab$i-P1-$BIG.json"
done
if [ "$DRY" != "1" ]; then
    step long "$LIMIT_SWEEP" $PY scripts/check_kernels_gpu.py --skip-checks --long-context \
        --sweep-budget-s 110 --out "$OUT/kernels-long.json"
fi

step w1-small "$LIMIT_SMALL" $PY -m pagedllm.benchmarks.throughput --model "$SMALL" \
    --load-format dummy "${W1_ARGS[@]}" --step-timing --output-json "$OUT/w1-small-$SMALL.json"

for model in "$BIG" "$SMALL"; do
    step sync "$LIMIT_SYNC" $PY -m pagedllm.benchmarks.throughput --model "$model" \
        --load-format dummy "${W1_ARGS[@]}" --no-async-scheduling \
        --output-json "$OUT/sync-w1-$model.json"
done

step fp8 "$LIMIT_W1" $PY -m pagedllm.benchmarks.throughput --model "$BIG" --load-format dummy \
    "${W1_ARGS[@]}" --quantization fp8 --output-json "$OUT/fp8-w1-$BIG.json"
step fp8 "$LIMIT_W1" $PY -m pagedllm.benchmarks.throughput --model "$BIG" --load-format dummy \
    "${W1_ARGS[@]}" --quantization fp8 --kv-cache-dtype fp8 --output-json "$OUT/fp8-kv-w1-$BIG.json"
step fp8 "$LIMIT_TESTS" $PY -m pytest -q -x -p no:cacheprovider tests/quantization/test_fp8_kv_cache.py
if [ "$DRY" != "1" ]; then
    step fp8 "$LIMIT_FP8_KERNELS" $PY scripts/check_kernels_gpu.py --skip-checks --fp8-kv \
        --out "$OUT/kernels-fp8-kv.json"
    step fp8 "$LIMIT_SWEEP" $PY scripts/decode_step_sweep.py --parts widen \
        --out "$OUT/decode-fp8-widen.json"
fi
step fp8 "$LIMIT_LAT" $PY -m pagedllm.benchmarks.latency --model "$BIG" --load-format dummy \
    "${LAT_ARGS[@]}" --quantization fp8 --output-json "$OUT/fp8-latency-$BIG.json"
if [ "$DRY" != "1" ]; then
    step fp8 "$LIMIT_SWEEP" $PY scripts/gemv_quant_sweep.py --kinds fp8 --rows 1,4 \
        --budget-s 100 --out "$OUT/gemv-fp8.json"
fi
step fp8 "$LIMIT_W1" $PY -m pagedllm.benchmarks.throughput --model "$BIG" --load-format dummy \
    "${W1_ARGS[@]}" --hf-overrides "$BLOCK_FP8_CONFIG" --output-json "$OUT/fp8-block-w1-$BIG.json"
step fp8 "$LIMIT_LAT" $PY -m pagedllm.benchmarks.latency --model "$BIG" --load-format dummy \
    "${LAT_ARGS[@]}" --hf-overrides "$BLOCK_FP8_CONFIG" \
    --output-json "$OUT/fp8-block-latency-$BIG.json"

step w4a16 "$LIMIT_LAT" $PY -m pagedllm.benchmarks.latency --model "$BIG" --load-format dummy \
    "${LAT_ARGS[@]}" --quantization gptq --step-timing --torch-profile \
    --output-json "$OUT/w4a16-latency-$BIG.json"
step w4a16 "$LIMIT_W1" $PY -m pagedllm.benchmarks.throughput --model "$BIG" --load-format dummy \
    "${W1_ARGS[@]}" --quantization gptq --output-json "$OUT/w4a16-w1-$BIG.json"
if [ "$DRY" != "1" ]; then
    step w4a16 "$LIMIT_SWEEP" $PY scripts/gemv_quant_sweep.py --kinds int4 --rows 1,4 \
        --budget-s 100 --int-gemm-rows 64,256 --int-gemm-budget-s 60 --out "$OUT/gemv-int4.json"
fi
step w4a16 "$LIMIT_W1" $PY -m pagedllm.benchmarks.throughput --model "$BIG" --load-format dummy \
    "${W1_ARGS[@]}" --hf-overrides "$W8A8_CONFIG" --output-json "$OUT/int8-w8a8-w1-$BIG.json"
step w4a16 "$LIMIT_LAT" $PY -m pagedllm.benchmarks.latency --model "$BIG" --load-format dummy \
    "${LAT_ARGS[@]}" --hf-overrides "$W8A8_CONFIG" --output-json "$OUT/int8-w8a8-latency-$BIG.json"
if [ "$DRY" != "1" ]; then
    step w4a16 "$LIMIT_SWEEP" $PY scripts/gemv_quant_sweep.py --kinds int8 --rows 1,4 \
        --budget-s 80 --int8-gemm-rows 64,256 --int8-gemm-budget-s 60 --out "$OUT/gemv-int8.json"
fi
step w4a16 "$LIMIT_W1" $PY -m pagedllm.benchmarks.throughput --model "$BIG" --load-format dummy \
    "${W1_ARGS[@]}" --quantization bitsandbytes --output-json "$OUT/bnb-nf4-w1-$BIG.json"
step w4a16 "$LIMIT_LAT" $PY -m pagedllm.benchmarks.latency --model "$BIG" --load-format dummy \
    "${LAT_ARGS[@]}" --quantization bitsandbytes --output-json "$OUT/bnb-nf4-latency-$BIG.json"
step w4a16 "$LIMIT_W1" $PY -m pagedllm.benchmarks.throughput --model "$BIG" --load-format dummy \
    "${W1_ARGS[@]}" --hf-overrides "$BNB8_CONFIG" --output-json "$OUT/bnb-int8-w1-$BIG.json"
step w4a16 "$LIMIT_LAT" $PY -m pagedllm.benchmarks.latency --model "$BIG" --load-format dummy \
    "${LAT_ARGS[@]}" --hf-overrides "$BNB8_CONFIG" --output-json "$OUT/bnb-int8-latency-$BIG.json"

if [ "$DRY" != "1" ]; then
    step spec "$LIMIT_SWEEP" $PY scripts/spec_decode_costs.py --model "$BIG" --draft llama-3.2-1b \
        --load-format dummy --batch-sizes 1,8,32,128 --k 4 --output-json "$OUT/spec-costs.json"
fi

step moe "$LIMIT_LAT" $PY -m pagedllm.benchmarks.latency --model "$MOE" --load-format dummy \
    "${LAT_ARGS[@]}" --step-timing --torch-profile --output-json "$OUT/moe-latency-$MOE.json"
step moe "$LIMIT_W1" $PY -m pagedllm.benchmarks.throughput --model "$MOE" --load-format dummy \
    "${W1_ARGS[@]}" --output-json "$OUT/moe-w1-$MOE.json"
step moe "$LIMIT_W1" $PY -m pagedllm.benchmarks.throughput --model "$MOE_SMALL" \
    --load-format dummy "${W1_ARGS[@]}" --output-json "$OUT/moe-w1-$MOE_SMALL.json"
if [ "$DRY" != "1" ]; then
    step moe "$LIMIT_SWEEP" $PY scripts/bench_fused_moe.py --sweep --budget-s 120 \
        --out "$OUT/moe-tiles.json"
    for kind in channel block; do  # FP8 experts beside bf16's, printed into log.txt
        step moe "$LIMIT_LAT" $PY scripts/bench_fused_moe.py --fp8 "$kind" --tokens 1,64,1024
    done
    step moe "$LIMIT_LAT" $PY scripts/bench_fused_moe.py --int-bits 4 --tokens 1,64,1024
fi
moe_w1() {  # moe_w1 NAME ARGS...: W1 on $MOE_SMALL with ARGS into moe-NAME-w1-$MOE_SMALL.json
    local name=$1
    shift
    step moe "$LIMIT_W1" $PY -m pagedllm.benchmarks.throughput --model "$MOE_SMALL" \
        --load-format dummy "${W1_ARGS[@]}" "$@" --output-json "$OUT/moe-$name-w1-$MOE_SMALL.json"
}
moe_w1 fp8 --quantization fp8
moe_w1 fp8-block --hf-overrides "$BLOCK_FP8_CONFIG"
moe_w1 w4a16 --quantization gptq
moe_w1 int8-w8a8 --hf-overrides "$W8A8_CONFIG"
moe_w1 bnb-nf4 --quantization bitsandbytes

for model in "$BIG" "$SMALL"; do
    tokenizer=()
    case " $STEPS " in *" structured "*) ;; *) continue ;; esac
    if [ "$DRY" != "1" ]; then  # the built-in configs carry no tokenizer
        tokenizer=(--tokenizer "${TMPDIR:-/tmp}/pagedllm-tokenizer-$model")
        $PY -m pagedllm.benchmarks.bench_tokenizer --model "$model" --out "${tokenizer[1]}" 2>&1 \
            | tee -a "$LOG"
    fi
    step structured "$LIMIT_STRUCTURED" $PY -m pagedllm.benchmarks.throughput --model "$model" \
        --load-format dummy "${W1_ARGS[@]}" "${tokenizer[@]}" --structured-output json --step-timing \
        --output-json "$OUT/structured-w1-$model.json"
    if [ -n "$STRUCTURED_AB" ]; then
        step structured "$LIMIT_STRUCTURED" env $STRUCTURED_AB $PY -m pagedllm.benchmarks.throughput \
            --model "$model" --load-format dummy "${W1_ARGS[@]}" "${tokenizer[@]}" \
            --structured-output json --step-timing --output-json "$OUT/structured-ab-w1-$model.json"
    fi
done
# The host's masks alone, row by row beside the fill threads, with the small model's
# tokenizer (its step is the one the fill outlasts): 1 and 4 threads, the engine's default,
# and the default threads taking the rows from one queue.
masks_tokenizer=pagedllm/model_files/pagedllm-demo
[ "$DRY" = "1" ] || masks_tokenizer="${TMPDIR:-/tmp}/pagedllm-tokenizer-$SMALL"
for threads in 1 4 default rows; do
    case " $STEPS " in *" structured "*) ;; *) break ;; esac
    case $threads in
        default) fill_env=() ;;
        rows) fill_env=(PAGEDLLM_GRAMMAR_FILL=rows) ;;
        *) fill_env=(PAGEDLLM_GRAMMAR_FILL_THREADS="$threads") ;;
    esac
    step structured "$LIMIT_STRUCTURED" env "${fill_env[@]}" $PY \
        scripts/bench_structured_masks.py --tokenizer "$masks_tokenizer" \
        --rows "$STRUCTURED_MASK_ROWS" --steps "$STRUCTURED_MASK_STEPS" \
        | tee "$OUT/structured-masks-$threads.txt"
done

for model in "$BIG" "$SMALL"; do
    step serve "$LIMIT_SERVE" $PY scripts/gpu_bench_serve.py --model "$model" "${SERVE_ARGS[@]}" \
        --out "$OUT"
    [ "$BIG" != "$SMALL" ] || break
done

# ab_run LABEL DIR [VAR=value ...]: L1 and W1 of the package in DIR, with the settings, on
# each model of $GPU_BENCH_AB_MODELS (default: $BIG), under the ab time limit each, one
# line each into ab.txt.
read -r -a AB_MODELS <<<"${GPU_BENCH_AB_MODELS:-$BIG}"
read -r -a AB_ARGS <<<"${GPU_BENCH_AB_ARGS:-}"
read -r -a AB_BATCHES <<<"${GPU_BENCH_AB_BATCH_SIZES:-1}"
ab_run() {
    local label=$1 dir=$2 model batch
    shift 2
    for model in "${AB_MODELS[@]}"; do
        echo "--- $label ($model)" | tee -a "$OUT/ab.txt"
        for batch in "${AB_BATCHES[@]}"; do
            (cd "$dir" && PYTHONPATH=. timeout -k 10 "$LIMIT_AB" env "$@" $PY -m pagedllm.benchmarks.latency \
                --model "$model" --load-format dummy --workload L1 --batch-size "$batch" \
                "${LAT_ARGS[@]}" "${AB_ARGS[@]}" 2>&1) \
                | tee -a "$LOG" | grep -A1 "ms/token" | tail -1 | tee -a "$OUT/ab.txt"
        done
        [ "${GPU_BENCH_AB_W1:-1}" = 0 ] && continue
        (cd "$dir" && PYTHONPATH=. timeout -k 10 "$LIMIT_AB" env "$@" $PY -m pagedllm.benchmarks.throughput \
            --model "$model" --load-format dummy "${W1_ARGS[@]}" "${AB_ARGS[@]}" 2>&1) \
            | tee -a "$LOG" | grep -E "^ *pagedllm " | tee -a "$OUT/ab.txt"
    done
}
case " $STEPS " in
    *" ab "*)
        start=$SECONDS
        for setting in "${AB_SETTINGS[@]}"; do
            echo "=== ab: $setting" | tee -a "$LOG"
            ab_run "$setting: without" .
            ab_run "$setting: with" . "$setting"
        done
        read -r -a AB_REVS <<<"${GPU_BENCH_AB_REVS:-}"
        for ((round = 1; round <= ${GPU_BENCH_AB_ROUNDS:-2}; round++)); do
            # No revisions: rounds of the working tree alone, when asked for (its spread).
            [ ${#AB_REVS[@]} -gt 0 ] || [ -n "${GPU_BENCH_AB_ROUNDS:-}" ] || break
            for rev in "${AB_REVS[@]}"; do
                if [ -d ".ab/$rev/pagedllm" ]; then
                    ab_run "revision $rev, round $round" ".ab/$rev"
                else
                    echo "--- revision $rev: .ab/$rev is missing (run scripts/ab_prepare.sh $rev and carry .ab)" | tee -a "$OUT/ab.txt"
                fi
            done
            ab_run "working tree, round $round" .
        done
        echo "ab 0 $((SECONDS - start))" >>"$OUT/steps.txt"
        ;;
esac

$PY scripts/gpu_bench_report.py --dir "$OUT" --date "$DATE" --dry "$DRY" \
    --big "$BIG" --small "$SMALL" --moe "$MOE" --moe-small "$MOE_SMALL" \
    --hf-prompts "$HF_PROMPTS" 2>&1 | tee -a "$LOG"
