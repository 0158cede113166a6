"""The cost side of speculative decoding: a verification step against a decode step.

For each batch size, a plain engine and the same engine with a draft model decode the same
random-token prompts (greedy, EOS ignored). The plain engine gives the decode step time
(TPOT); the speculative one, timed with ``pagedllm.benchmarks.speculative.StepCosts``, the
time a decode step spends proposing K tokens with the draft and verifying K + 1 tokens
with the target. From those costs, the speedup an acceptance rate ``a`` would give::

    L(a) = (1 - a^(K+1)) / (1 - a)        tokens a verifying step yields
    speedup(a) = L(a) x T_target / (K x T_draft + T_verify)

Dummy weights decide nothing here but the costs: the draft proposes K tokens every step
whatever the target accepts. Prints a table and writes the records to ``--output-json``.
Each record's ``target_forwards`` counts how the speculative engine's target forwards ran
in the timed run: replays of its ``verify`` graphs (steps of requests computing 1 to K + 1
tokens), ``decode`` or ``prompt`` graphs, or ``eager`` (the steps with several prompts,
or CUDA graphs off).

    python scripts/spec_decode_costs.py --model llama-3.1-8b --draft llama-3.2-1b \\
        --load-format dummy --batch-sizes 1,8,32,128 --k 4 --output-json costs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

ACCEPTANCE_RATES = (0.5, 0.7, 0.9)


def expected_length(rate: float, k: int) -> float:
    """Tokens a verifying step yields when each proposal is accepted with ``rate``."""
    return float(k + 1) if rate >= 1.0 else (1 - rate ** (k + 1)) / (1 - rate)


def measure(llm, batch: int, input_len: int, output_len: int, seed: int, costs=None) -> float:
    """Mean decode step time, ms: (last token - first token) / (output_len - 1), median
    over the batch's requests."""
    from pagedllm import SamplingParams
    from pagedllm.benchmarks.common import synthetic_requests

    vocab = llm.llm_engine.config.model_config.vocab_size
    requests = synthetic_requests(batch, (input_len, input_len), (1, 1), vocab, seed=seed)
    llm.llm_engine.engine_core.scheduler.reset_prefix_cache()
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params,
                           use_tqdm=False)
    end = time.monotonic()
    return 1e3 * statistics.median(
        (end - o.metrics["first_token_time"]) / (output_len - 1) for o in outputs)


class TargetForwards:
    """Context manager: counts the target forwards of a speculative engine by how they ran
    (the kind of graph replayed, or ``eager``)."""

    def __init__(self, llm) -> None:
        self.runner = llm.llm_engine.engine_core.model_runner
        self.counts: Counter[str] = Counter()

    def __enter__(self) -> "TargetForwards":
        runner, original = self.runner, self.runner._run_model

        def run_model(inputs, drafter=None, pending=None):
            if drafter is None:
                graphs = runner.graph_runner
                key = graphs.graph_for(inputs) if graphs is not None else None
                self.counts[key[0] if key is not None else "eager"] += 1
            return original(inputs, drafter, pending)

        runner._run_model = run_model
        return self

    def __exit__(self, *exc) -> None:
        del self.runner._run_model  # back to the class attribute


def main() -> None:
    from pagedllm import LLM
    from pagedllm.benchmarks.speculative import StepCosts

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--draft", default="llama-3.2-1b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--batch-sizes", default="1,8,32,128")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=8.0,
                        help="KV cache of target and draft together: 160 KiB a token for "
                             "llama-3.1-8b with llama-3.2-1b; batch 128 x 192 tokens needs 4 GB")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine = dict(load_format=args.load_format, max_model_len=args.max_model_len,
                  max_num_seqs=max(sizes), kv_cache_memory_gb=args.kv_cache_memory_gb)
    plain = LLM(args.model, **engine)
    speculative = LLM(args.model, speculative_model=args.draft, num_speculative_tokens=args.k,
                      **engine)
    records = []
    for batch in sizes:
        for llm in (plain, speculative):  # warm-up: every kernel variant of this batch
            measure(llm, batch, args.input_len, 8, seed=1)
        target_ms = measure(plain, batch, args.input_len, args.output_len, seed=2)
        with StepCosts(speculative) as timer, TargetForwards(speculative) as forwards:
            measure(speculative, batch, args.input_len, args.output_len, seed=2)
        costs = timer.summary()
        step_ms = costs["proposal_ms"] + costs["verification_ms"]
        record = {"batch_size": batch, "k": args.k, "target_step_ms": round(target_ms, 3),
                  **costs, "verification_over_decode": round(costs["verification_ms"] / target_ms, 3),
                  "target_forwards": dict(forwards.counts),
                  "predicted_speedup": {str(a): round(
                      expected_length(a, args.k) * target_ms / step_ms, 3)
                      for a in ACCEPTANCE_RATES}}
        records.append(record)
        print(json.dumps(record), flush=True)
    print(f"{'batch':>5} {'decode ms':>9} {'verify ms':>9} {'ratio':>6} {'draft ms':>8} "
          + " ".join(f"{'a=' + str(a):>7}" for a in ACCEPTANCE_RATES))
    for r in records:
        print(f"{r['batch_size']:>5} {r['target_step_ms']:>9.3f} {r['verification_ms']:>9.3f} "
              f"{r['verification_over_decode']:>6.2f} {r['draft_step_ms']:>8.3f} "
              + " ".join(f"{r['predicted_speedup'][str(a)]:>6.2f}x" for a in ACCEPTANCE_RATES))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": args.model, "draft": args.draft, "records": records}, f, indent=2)


if __name__ == "__main__":
    main()
