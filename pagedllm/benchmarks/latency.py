"""``pagedllm bench latency``: batch-1 decode latency (L1) and prefill throughput (P1).

* L1: ``--batch-size`` prompts of ``--input-len`` random tokens generate ``--output-len``
  tokens each (greedy, EOS ignored). ``ms_per_token`` is the wall time of the whole request
  over the output length (prefill included); ``tpot_ms`` leaves the first token out
  (time from first to last token over ``output_len - 1``).
* P1: ``--prefill-batch`` prompts of ``--prefill-len`` tokens with ``max_tokens=1``:
  ``prompt_tok_s`` is prompt tokens over wall time.

Each iteration draws fresh prompts (and the prefix cache is reset), so no run is served
from an earlier one's cache; ``--num-iters-warmup`` untimed runs come first and medians
are reported over ``--num-iters``. ``ms_per_token`` and ``prompt_tok_s`` are derived from
the reported median latency (``latency_s_median``). Prompts are random token ids, or with
``--prompt-files`` windows of real text (speculation needs text a draft can predict).

    pagedllm bench latency --model llama-3.1-8b --load-format dummy --output-json lat.json

With speculative decoding flags (``--speculative-model``, ``--speculative-method ngram``,
...) L1 runs on the speculative engine and, iteration by iteration on the same prompts,
on the same engine without speculation; ``--speculative-k-values 1,2,3`` repeats that
for each K. Each record adds acceptance, step costs and the predicted and measured
speedup (``speculative.py``); a table per K is printed.

    pagedllm bench latency --workload L1 --speculative-model pagedllm-demo-draft \
        --speculative-k-values 1,2,3,4,5 --prompt-files held_out/*.py --max-num-seqs 4
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time

from pagedllm.benchmarks.common import (
    host_table,
    kernel_table,
    parallel_sizes,
    reported_seconds,
    result_record,
    synthetic_requests,
    text_prompts,
    write_json,
)
from pagedllm.engine.arg_utils import EngineArgs, HelpFormatter

WORKLOADS = ("L1", "P1")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all",
                        help="Which workloads to run.")
    parser.add_argument("--batch-size", type=int, default=1, help="L1: prompts per iteration.")
    parser.add_argument("--input-len", type=int, default=128, help="L1: prompt tokens.")
    parser.add_argument("--output-len", type=int, default=256, help="L1: generated tokens.")
    parser.add_argument("--prefill-batch", type=int, default=4, help="P1: prompts per iteration.")
    parser.add_argument("--prefill-len", type=int, default=2048, help="P1: tokens per prompt.")
    parser.add_argument("--num-iters-warmup", type=int, default=2,
                        help="Untimed iterations first.")
    parser.add_argument("--num-iters", type=int, default=5,
                        help="Timed iterations (the median is reported).")
    parser.add_argument("--torch-profile", action="store_true",
                        help="Run one more iteration of each workload under torch.profiler and "
                             "record its top kernels by device time.")
    parser.add_argument("--host-profile", action="store_true",
                        help="Run one more prefill of each workload's shape (one output token) "
                             "under cProfile and record the host functions that took longest.")
    parser.add_argument("--step-timing", action="store_true",
                        help="Split L1's step time into host phases and device wait.")
    parser.add_argument("--prompt-files", nargs="+", default=None, metavar="FILE",
                        help="Prompts are --input-len-token windows of these text files at "
                             "random offsets, tokenized with the model's tokenizer (default: "
                             "random token ids).")
    parser.add_argument("--speculative-k-values", type=_parse_ks, default=None,
                        metavar="K,K,...",
                        help="With speculative decoding: measure L1 once per K (default: "
                             "--num-speculative-tokens).")
    parser.add_argument("--output-json", default=None, help="Write the result records here.")
    EngineArgs.add_cli_args(parser)


def _parse_ks(text: str) -> list[int]:
    ks = [int(k) for k in text.split(",") if k.strip()]
    if not ks or min(ks) < 1:
        raise ValueError(f"--speculative-k-values takes K >= 1, comma-separated, got {text!r}.")
    return ks


def run(args: argparse.Namespace) -> list[dict]:
    """Run the selected workloads on one engine; returns one record per workload."""
    from pagedllm import LLM
    from pagedllm.benchmarks.speculative import is_speculative

    for name in ("batch_size", "input_len", "output_len", "prefill_batch", "prefill_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    engine_args = EngineArgs.from_cli_args(args)
    if is_speculative(engine_args):
        return _run_speculative(args, engine_args)
    if args.speculative_k_values:
        raise ValueError("--speculative-k-values needs speculative decoding: add "
                         "--speculative-model DRAFT or --speculative-method ngram.")
    llm = LLM(**vars(engine_args))
    config = llm.llm_engine.config
    common = dict(model=config.model_config.path.name, device=config.device,
                  **parallel_sizes(config))
    records = []
    if args.workload in ("L1", "all"):
        records.append(result_record(workload="L1", **common, **measure_decode_latency(llm, args)))
    if args.workload in ("P1", "all"):
        records.append(result_record(workload="P1", **common, **measure_prefill(llm, args)))
    write_json(args.output_json, records)  # before the diagnostics, which may be slow
    for record in records:
        l1 = record["workload"] == "L1"
        shape = ((args.batch_size, args.input_len, args.output_len) if l1
                 else (args.prefill_batch, args.prefill_len, 1))
        if args.step_timing and l1:
            record["step_timing"] = _step_timing(llm, args, *shape)
        if args.torch_profile:
            # A shorter L1 iteration: 32 decode steps show the per-step kernels well enough.
            profile_shape = (shape[0], shape[1], min(shape[2], 32))
            record["profile"] = _torch_profile(llm, args, *profile_shape)
        if args.host_profile:
            record["host_profile"] = host_table(
                lambda: _one_iteration(llm, args, shape[0], shape[1], 1))
    print(f"{'workload':>8} {'shape':>18} {'ms/token':>9} {'TPOT ms':>8} {'prompt tok/s':>13}")
    for r in records:
        if r["workload"] == "L1":
            shape = f"{r['batch_size']} x {r['input_len']}+{r['output_len']}"
            print(f"{'L1':>8} {shape:>18} {r['ms_per_token']:>9} {r['tpot_ms']:>8} {'-':>13}")
        else:
            shape = f"{r['batch_size']} x {r['prompt_len']}"
            print(f"{'P1':>8} {shape:>18} {'-':>9} {'-':>8} {r['prompt_tok_s']:>13}")
    write_json(args.output_json, records)
    return records


def _iterations(llm, args: argparse.Namespace, num_prompts: int, prompt_len: int,
                max_tokens: int, temperature: float) -> list[tuple[float, list]]:
    """(wall seconds, outputs) of each timed iteration, fresh prompts each time."""
    from pagedllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature)
    results = []
    for i in range(args.num_iters_warmup + args.num_iters):
        prompts = _prompts(llm, args, num_prompts, prompt_len, seed=args.seed + 1000 * (i + 1))
        elapsed, outputs, end = _timed_generate(llm, prompts, params)
        if i >= args.num_iters_warmup:
            results.append((elapsed, [(o, end) for o in outputs]))
    return results


def _timed_generate(llm, prompts: list[dict], params) -> tuple[float, list, float]:
    """(wall seconds, outputs, monotonic end) of one generate call on a cold prefix cache."""
    llm.llm_engine.engine_core.scheduler.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs, time.monotonic()


def _prompts(llm, args: argparse.Namespace, num_prompts: int, prompt_len: int,
             seed: int) -> list[dict]:
    """Random token ids, or windows of ``--prompt-files``."""
    if not args.prompt_files:
        vocab = llm.llm_engine.config.model_config.vocab_size
        requests = synthetic_requests(num_prompts, (prompt_len, prompt_len), (1, 1), vocab,
                                      seed=seed)
        return [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    tokenizer = llm.llm_engine.tokenizer
    if tokenizer is None:
        raise ValueError("--prompt-files needs the model's tokenizer: give one with --tokenizer.")
    if getattr(args, "_file_tokens", None) is None:
        from pathlib import Path

        args._file_tokens = [tokenizer.encode(Path(f).read_text(errors="replace"))
                             for f in args.prompt_files]
    return [{"prompt_token_ids": ids}
            for ids in text_prompts(args._file_tokens, num_prompts, prompt_len, seed)]


def _one_iteration(llm, args: argparse.Namespace, num_prompts: int, prompt_len: int,
                   max_tokens: int) -> None:
    from pagedllm import SamplingParams

    vocab = llm.llm_engine.config.model_config.vocab_size
    requests = synthetic_requests(num_prompts, (prompt_len, prompt_len), (1, 1), vocab,
                                  seed=args.seed + 7)
    llm.llm_engine.engine_core.scheduler.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                 SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                 use_tqdm=False)


def _step_timing(llm, args, num_prompts: int, prompt_len: int, max_tokens: int) -> dict:
    from pagedllm.benchmarks.step_timing import StepTimer, format_summary

    with StepTimer(llm) as timer:
        _one_iteration(llm, args, num_prompts, prompt_len, max_tokens)
    summary = timer.summary()
    print(format_summary(summary), flush=True)
    return summary


def _torch_profile(llm, args, num_prompts: int, prompt_len: int, max_tokens: int) -> str:
    """The top kernels of one iteration by device time (a text table)."""
    return kernel_table(lambda: _one_iteration(llm, args, num_prompts, prompt_len, max_tokens))


def measure_decode_latency(llm, args: argparse.Namespace) -> dict:
    """L1: see the module docstring."""
    return _decode_figures(
        _iterations(llm, args, args.batch_size, args.input_len, args.output_len, 0.0), args)


def _decode_figures(runs: list[tuple[float, list]], args: argparse.Namespace) -> dict:
    """L1's figures from its timed iterations."""
    latencies = [elapsed for elapsed, _ in runs]
    tpots = []
    for _, outputs in runs:
        for output, end in outputs:
            first = output.metrics.get("first_token_time") if output.metrics else None
            if first is not None and args.output_len > 1:
                tpots.append((end - first) / (args.output_len - 1))
    median = reported_seconds(statistics.median(latencies))
    return {
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "latency_s_median": median,
        "latencies_s": [reported_seconds(x) for x in latencies],
        "ms_per_token": round(median / args.output_len * 1e3, 3),
        "tpot_ms": round(statistics.median(tpots) * 1e3, 3) if tpots else None,
    }


def _run_speculative(args: argparse.Namespace, engine_args: EngineArgs) -> list[dict]:
    """L1 on the speculative engine beside the same engine without speculation, per K."""
    import gc

    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.speculative import (
        StepCosts,
        acceptance,
        format_table,
        speculation_report,
        with_num_speculative_tokens,
        without_speculation,
    )

    if args.workload == "P1":
        raise ValueError("Speculative decoding does not change P1 (prefill): run L1.")
    plain = LLM(**vars(without_speculation(engine_args)))
    config = plain.llm_engine.config
    common = dict(model=config.model_config.path.name, device=config.device,
                  **parallel_sizes(config))
    ks = args.speculative_k_values or [
        engine_args.create_engine_config().speculative_config.num_speculative_tokens]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    records, reports = [], []
    for k in ks:
        speculative = LLM(**vars(with_num_speculative_tokens(engine_args, k)))
        spec_config = speculative.llm_engine.config.speculative_config
        stats = speculative.llm_engine.engine_core.scheduler.spec_decoding_stats
        plain_runs, spec_runs, timed_prompts = [], [], []
        before = None
        costs = StepCosts(speculative)
        # On the CPU the timers cost microseconds a step: they ride on the timed runs. On a
        # GPU they synchronise, so the timed prompts run again under them afterwards.
        timed_costs = config.device == "cpu"
        for i in range(args.num_iters_warmup + args.num_iters):
            prompts = _prompts(plain, args, args.batch_size, args.input_len,
                               seed=args.seed + 1000 * (i + 1))
            timed = i >= args.num_iters_warmup
            if i == args.num_iters_warmup:
                before = stats.copy()
            elapsed, outputs, end = _timed_generate(plain, prompts, params)
            if timed:
                plain_runs.append((elapsed, [(o, end) for o in outputs]))
                timed_prompts.append(prompts)
            with costs if timed and timed_costs else contextlib.nullcontext():
                elapsed, outputs, end = _timed_generate(speculative, prompts, params)
            if timed:
                spec_runs.append((elapsed, [(o, end) for o in outputs]))
        accepted = acceptance(before, stats)
        if not timed_costs:
            with costs:
                for prompts in timed_prompts:
                    _timed_generate(speculative, prompts, params)
        plain_figures = _decode_figures(plain_runs, args)
        spec_figures = _decode_figures(spec_runs, args)
        report = speculation_report(
            k, costs.summary(), accepted, target_step_ms=plain_figures["tpot_ms"],
            plain_ms_per_token=plain_figures["ms_per_token"],
            speculative_ms_per_token=spec_figures["ms_per_token"])
        report["method"] = spec_config.method
        reports.append(report)
        records.append(result_record(workload="L1", **common, **spec_figures,
                                     prompt_files=args.prompt_files, speculative=report))
        write_json(args.output_json, records)
        del speculative, costs  # both hold the engine: its memory goes back before the next K
        gc.collect()
    print(format_table(reports))
    write_json(args.output_json, records)
    return records


def measure_prefill(llm, args: argparse.Namespace) -> dict:
    """P1: see the module docstring."""
    runs = _iterations(llm, args, args.prefill_batch, args.prefill_len, 1, 0.0)
    latencies = [elapsed for elapsed, _ in runs]
    median = reported_seconds(statistics.median(latencies))
    tokens = args.prefill_batch * args.prefill_len
    return {
        "batch_size": args.prefill_batch,
        "prompt_len": args.prefill_len,
        "num_iters": args.num_iters,
        "latency_s_median": median,
        "latencies_s": [reported_seconds(x) for x in latencies],
        "prompt_tok_s": round(tokens / median, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedllm.benchmarks.latency``: the command without the CLI's other
    subcommands (and their imports)."""
    parser = argparse.ArgumentParser(prog="pagedllm bench latency", description=__doc__,
                                     formatter_class=HelpFormatter)
    add_cli_args(parser)
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
