"""``pagedllm bench throughput``: offline generation of a synthetic workload, all submitted at once.

W1 of the project's benchmarks is ``--num-prompts 256 --input-len 100:1024
--output-len 100:1024 --seed 0 --ignore-eos``. Output tokens per wall second include prefill.
"""

from __future__ import annotations

import argparse
import time

from pagedllm.benchmarks.common import parse_range, result_record, synthetic_requests, write_json
from pagedllm.engine.arg_utils import EngineArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=parse_range, default=(100, 1024),
                        help="Prompt length in tokens, 'LOW:HIGH' (uniform) or one number.")
    parser.add_argument("--output-len", type=parse_range, default=(100, 1024),
                        help="Output length in tokens, 'LOW:HIGH' (uniform) or one number.")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="Generate exactly the output length (default on).")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--output-json", default=None, help="Write the result record here.")
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> dict:
    from pagedllm import LLM, SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    model_config = llm.llm_engine.config.model_config
    requests = synthetic_requests(
        args.num_prompts, args.input_len, args.output_len, model_config.vocab_size, args.seed
    )
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=args.ignore_eos,
                             temperature=args.temperature) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    record = result_record(
        workload="throughput", backend="pagedllm", model=model_config.path.name,
        device=llm.llm_engine.config.device, num_prompts=args.num_prompts,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens, elapsed_s=round(elapsed, 3),
        requests_per_s=round(args.num_prompts / elapsed, 3),
        output_tok_s=round(output_tokens / elapsed, 1),
        total_tok_s=round((prompt_tokens + output_tokens) / elapsed, 1),
    )
    print(f"{'requests/s':>14} {'output tok/s':>14} {'total tok/s':>14} {'elapsed s':>10}")
    print(f"{record['requests_per_s']:>14} {record['output_tok_s']:>14} "
          f"{record['total_tok_s']:>14} {record['elapsed_s']:>10}")
    write_json(args.output_json, record)
    return record
