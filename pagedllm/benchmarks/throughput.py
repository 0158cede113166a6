"""``pagedllm bench throughput``: offline generation of a synthetic workload, all submitted at once.

W1 of the project's benchmarks is ``--num-prompts 256 --input-len 100:1024
--output-len 100:1024 --seed 0 --ignore-eos``: random-token prompts, temperature 1. Output
tokens per wall second include prefill. Requests ask for token ids only
(``detokenize=False``: nothing reads the text; ``--detokenize`` decodes it). Those lengths
are the defaults; on a model whose context is shorter than the longest request (2,048
tokens), the defaulted ranges are scaled down together until it fits, and a line says so.
Lengths given that do not fit are refused.

``--backend`` takes one name or a comma-separated list, run in one process on the same
requests: ``pagedllm``, ``hf`` (transformers ``generate`` in static batches) and ``hf-cb``
(transformers continuous batching); see ``hf_backends.py``. The HF peers run first and free
the GPU before pagedllm starts. Peers are slow, so ``--hf-num-prompts N`` gives them only
the first N requests; pagedllm then runs that subset too (for ratios measured side by side)
as well as the full list. The table ends with pagedllm's ratio to each peer on the same
requests.

    pagedllm bench throughput --model llama-3.1-8b --load-format dummy \\
        --backend hf,hf-cb,pagedllm --hf-num-prompts 64 --output-json w1.json

``--structured-output json`` runs pagedllm twice on the same requests, unconstrained and
then with every request constrained to a JSON schema (``structured_workload.py``), and
reports the ratio and the host time spent on the constrained rows (checking sampled tokens
and filling token masks: per step, per output token, and the share of checked tokens the
grammars refused). The grammar backend (the tokenizer's token trie) is built before the
timed run, as a server builds it once. Constraints need a tokenizer: give a config-only
model one with ``--tokenizer``. The profiles asked for (``--profile-run``, ...) are then of
the constrained workload, beside whose record they are kept.

``--shapes IN/OUTxREQUESTS,...`` runs several fixed-length workloads one after another on
one engine, started and warmed up once (one record each, with its ``shape``), in place of
``--num-prompts``, ``--input-len`` and ``--output-len``: TensorRT-LLM's table of shapes in
one process (``scripts/gpu_bench_trtllm.sh``).

    pagedllm bench throughput --model llama-3.1-8b --load-format dummy \\
        --shapes 128/128x30000,2048/128x3000 --quantization fp8 --kv-cache-dtype fp8

With speculative decoding flags the speculative engine runs the workload, then the same
engine without speculation runs it again; the speculative record adds the acceptance,
the tokens a decode step yields, the step costs and the measured speedup (see
``speculative.py``; the predicted speedup needs batch-1 step costs: ``bench latency``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
import threading
import time

from pagedllm.benchmarks.common import (
    SyntheticRequest,
    kernel_table,
    parallel_sizes,
    parse_range,
    reported_seconds,
    result_record,
    synthetic_requests,
    write_json,
)
from pagedllm.benchmarks.run_profile import profile_run, prompts_pending
from pagedllm.benchmarks.speculative import is_speculative
from pagedllm.engine.arg_utils import EngineArgs, HelpFormatter

logger = logging.getLogger(__name__)
BACKENDS = ("pagedllm", "hf", "hf-cb")
# W1's prompt and output lengths, the defaults of --input-len and --output-len.
DEFAULT_INPUT_LEN = DEFAULT_OUTPUT_LEN = (100, 1024)


def parse_backends(text: str) -> list[str]:
    """``"hf,pagedllm"`` -> ``["hf", "pagedllm"]``; ValueError naming the valid backends."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in BACKENDS]
    if not names or bad:
        raise ValueError(f"--backend takes names from {', '.join(BACKENDS)} (comma-separated), got {text!r}.")
    return list(dict.fromkeys(names))


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"128/128x30000,2048/128x3000"`` -> ``[(128, 128, 30000), (2048, 128, 3000)]``:
    prompt tokens, output tokens and requests of each workload."""
    shapes = []
    for item in text.split(","):
        lengths, _, count = item.strip().partition("x")
        prompt_len, _, output_len = lengths.partition("/")
        try:
            shape = (int(prompt_len), int(output_len), int(count))
        except ValueError:
            shape = (0, 0, 0)
        if min(shape) < 1:
            raise ValueError(f"--shapes takes 'IN/OUTxREQUESTS' items, comma-separated "
                             f"(e.g. 128/128x30000,2048/128x3000), got {item!r}.")
        shapes.append(shape)
    return shapes


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", type=parse_backends, default="pagedllm",
                        help="pagedllm | hf | hf-cb, or a comma-separated list run side by side.")
    parser.add_argument("--num-prompts", type=int, default=256, help="Requests in the workload.")
    parser.add_argument("--input-len", type=parse_range, default=None,
                        help="Prompt length in tokens, 'LOW:HIGH' (uniform) or one number "
                             "(default: 100:1024, scaled down to fit a shorter context).")
    parser.add_argument("--output-len", type=parse_range, default=None,
                        help="Output length in tokens, 'LOW:HIGH' (uniform) or one number "
                             "(default: 100:1024, scaled down to fit a shorter context).")
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="Several fixed-length workloads, run in turn on one engine (one "
                             "record each), in place of --num-prompts, --input-len and "
                             "--output-len: 'IN/OUTxREQUESTS,...', e.g. "
                             "128/128x30000,2048/128x3000.")
    parser.add_argument("--prefix-len", type=int, default=0,
                        help="Tokens of a random prefix shared by every prompt, ahead of its own "
                             "--input-len tokens; the report adds prompt tokens computed against "
                             "sent and the prefix-cache hit rate.")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="Generate exactly the output length (default on).")
    parser.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature.")
    parser.add_argument("--detokenize", action=argparse.BooleanOptionalAction, default=False,
                        help="Decode each output's text (default off: the benchmark reads token "
                             "counts only, so requests ask for token ids, detokenize=False).")
    parser.add_argument("--hf-num-prompts", type=int, default=None,
                        help="Run the HF peers on the first N requests only (pagedllm runs them "
                             "too; default: all of them).")
    parser.add_argument("--hf-batch-size", type=int, default=128,
                        help="Static batch size of the 'hf' backend.")
    parser.add_argument("--hf-time-limit-s", type=float, default=600.0,
                        help="Stop an HF peer after this many seconds and count what it produced.")
    parser.add_argument("--structured-output", choices=("none", "json"), default="none",
                        help="json: also run every request constrained to a JSON schema, "
                             "beside the unconstrained run.")
    parser.add_argument("--step-timing", action="store_true",
                        help="Split pagedllm's step time into host phases and device wait "
                             "(see step_timing.py) on the full run.")
    parser.add_argument("--profile-decode-steps", type=int, default=0,
                        help="After the measured run, submit the workload again and profile "
                             "this many decode steps once every prompt is in (torch.profiler; "
                             "the top kernels are printed and saved as 'decode_profile').")
    parser.add_argument("--profile-prefill-steps", type=int, default=0,
                        help="After the measured run, submit the workload again and profile "
                             "its first this many steps (the prompts' steps; saved as "
                             "'prefill_profile').")
    parser.add_argument("--profile-run", action="store_true",
                        help="After the measured run, submit the workload again and profile "
                             "it to the end: device time by kernel family for the prompt and "
                             "the decode steps, and decode step time by running batch (see "
                             "run_profile.py; saved as 'run_profile').")
    parser.add_argument("--output-json", default=None,
                        help="Write the result here: one record, or a list when several runs.")
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> list[dict]:
    """Run every requested backend; returns one record per measured run."""
    backends = args.backend if isinstance(args.backend, list) else parse_backends(args.backend)
    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config()
    if args.shapes:
        return _run_shapes(args, backends, engine_args, config)
    model_config = config.model_config
    args.input_len, args.output_len, note = fit_lengths(
        args.input_len, args.output_len, model_config.max_model_len)
    if note:
        print(note, flush=True)
    if args.prefix_len < 0:
        raise ValueError(f"--prefix-len must be >= 0, got {args.prefix_len}.")
    longest = args.prefix_len + args.input_len[1] + args.output_len[1]
    if args.prefix_len and longest > model_config.max_model_len:
        raise ValueError(
            f"--prefix-len {args.prefix_len} + --input-len up to {args.input_len[1]} + "
            f"--output-len up to {args.output_len[1]} = {longest} tokens exceed max_model_len "
            f"{model_config.max_model_len}: shorten them or raise --max-model-len.")
    requests = synthetic_requests(
        args.num_prompts, args.input_len, args.output_len, model_config.vocab_size, args.seed,
        prefix_len=args.prefix_len,
    )
    peers = [b for b in backends if b != "pagedllm"]
    hf_count = min(args.hf_num_prompts or len(requests), len(requests))
    subset = requests[:hf_count]
    common = dict(model=model_config.path.name, device=config.device,
                  workload_args=_workload_args(args))
    records: list[dict] = []

    def keep(record: dict) -> None:
        split = parallel_sizes(config) if record["backend"].startswith("pagedllm") else {}
        record = result_record(workload="throughput", **common, **split, **record)
        records.append(record)
        print(_row(record), flush=True)
        _write(args.output_json, records)

    print(_header(), flush=True)
    if peers:
        import torch

        from pagedllm.benchmarks.hf_backends import run_hf_backends
        from pagedllm.models.loader import resolve_dtype

        device = torch.device(config.device)
        run_hf_backends(
            peers, model_config.path, model_config.load_format,
            resolve_dtype(model_config, device), device, args.seed, subset,
            args.hf_batch_size, args.hf_time_limit_s, keep,
        )
    if "pagedllm" in backends and is_speculative(engine_args):
        for record in _run_speculative(engine_args, requests, args):
            keep(record)
    elif "pagedllm" in backends:
        from pagedllm import LLM

        llm = LLM(**vars(engine_args))
        _warm_up(llm)
        if peers and hf_count < len(requests):
            keep(_run_pagedllm(llm, subset, args))
        full = _run_pagedllm(llm, requests, args, step_timing=args.step_timing)
        if args.structured_output == "json":
            keep(full)
            full = _run_pagedllm(llm, requests, args, step_timing=args.step_timing,
                                 constrained=True)
            full["constrained_ratio"] = round(full["output_tok_s"] / records[-1]["output_tok_s"], 3)
        _add_profiles(llm, requests, args, full)
        keep(full)
        del llm
        gc.collect()
    _add_ratios(records)
    if any("ratio_vs_hf_static" in r or "ratio_vs_hf_cb" in r for r in records):
        print()
        for r in records:
            if r.get("backend") == "pagedllm" and ("ratio_vs_hf_static" in r or "ratio_vs_hf_cb" in r):
                print(f"pagedllm on {r['num_prompts']} requests: "
                      f"{r.get('ratio_vs_hf_static', '-')}x HF static, "
                      f"{r.get('ratio_vs_hf_cb', '-')}x HF continuous batching")
    _write(args.output_json, records)
    return records


def _run_shapes(args: argparse.Namespace, backends: list[str], engine_args: EngineArgs,
                config) -> list[dict]:
    """``--shapes``: each fixed-length workload in turn on one engine; one record each."""
    if backends != ["pagedllm"] or is_speculative(engine_args) or args.prefix_len \
            or args.structured_output != "none":
        raise ValueError("--shapes runs pagedllm alone: without --backend peers, speculative "
                         "decoding, --prefix-len or --structured-output.")
    model_config = config.model_config
    for prompt_len, output_len, _ in args.shapes:  # all refused before the engine starts
        fit_lengths((prompt_len, prompt_len), (output_len, output_len), model_config.max_model_len)
    from pagedllm import LLM

    llm = LLM(**vars(engine_args))
    _warm_up(llm)
    records: list[dict] = []
    print(_header(), flush=True)
    for prompt_len, output_len, count in args.shapes:
        shape = argparse.Namespace(**{**vars(args), "num_prompts": count,
                                      "input_len": (prompt_len, prompt_len),
                                      "output_len": (output_len, output_len)})
        requests = synthetic_requests(count, shape.input_len, shape.output_len,
                                      model_config.vocab_size, args.seed)
        record = _run_pagedllm(llm, requests, shape, step_timing=args.step_timing)
        _add_profiles(llm, requests, shape, record)
        records.append(result_record(
            workload="throughput", model=model_config.path.name, device=config.device,
            workload_args=_workload_args(shape), shape=f"{prompt_len}/{output_len}",
            **parallel_sizes(config), **record))
        print(_row(records[-1]), flush=True)
        _write(args.output_json, records)
    del llm
    gc.collect()
    return records


def _add_profiles(llm, requests: list[SyntheticRequest], args: argparse.Namespace,
                  record: dict) -> None:
    """The profiles asked for, each of the workload submitted again, into ``record``."""
    if args.profile_prefill_steps > 0:
        record["prefill_profile"] = _profile_steps(
            llm, requests, args, args.profile_prefill_steps, after_prompts=False)
    if args.profile_decode_steps > 0:
        record["decode_profile"] = _profile_steps(
            llm, requests, args, args.profile_decode_steps, after_prompts=True)
    if args.profile_run:
        record["run_profile"] = _profile_run(llm, requests, args)


def fit_lengths(input_len: tuple[int, int] | None, output_len: tuple[int, int] | None,
                max_model_len: int) -> tuple[tuple[int, int], tuple[int, int], str | None]:
    """The run's prompt and output length ranges, and a line to print when defaults changed.

    ``None`` is the default range (W1's). Every request must fit the context: the longest
    prompt plus the longest output is at most ``max_model_len``. Defaulted ranges that do
    not fit are scaled down together (both ends, by one factor) until they do; ranges
    given that do not fit raise ``ValueError`` naming the flags.
    """
    given = {"--input-len": input_len, "--output-len": output_len}
    defaults = {"--input-len": DEFAULT_INPUT_LEN, "--output-len": DEFAULT_OUTPUT_LEN}
    defaulted = [flag for flag, lengths in given.items() if lengths is None]
    room = max_model_len - sum(lengths[1] for lengths in given.values() if lengths is not None)
    if room < len(defaulted):  # no room left, or not one token for each defaulted range
        shown = " with ".join(f"{flag} {_range(lengths)}" for flag, lengths in given.items()
                              if lengths is not None)
        raise ValueError(
            f"{shown} does not fit the model's {max_model_len}-token context (max_model_len: "
            "the longest prompt plus the longest output must fit): lower the lengths, or raise "
            "--max-model-len if the model allows it."
        )
    resolved = {flag: lengths or defaults[flag] for flag, lengths in given.items()}
    wanted = sum(defaults[flag][1] for flag in defaulted)
    if wanted <= room:
        return resolved["--input-len"], resolved["--output-len"], None
    scale = room / wanted
    for flag in defaulted:
        low, high = defaults[flag]
        resolved[flag] = (max(1, int(low * scale)), max(1, int(high * scale)))
    note = (f"Using {' and '.join(f'{flag} {_range(resolved[flag])}' for flag in defaulted)}: "
            f"the default{'s' if len(defaulted) > 1 else ''} "
            f"({' and '.join(_range(defaults[flag]) for flag in defaulted)}) scaled down to fit "
            f"the model's {max_model_len}-token context.")
    return resolved["--input-len"], resolved["--output-len"], note


def _range(lengths: tuple[int, int]) -> str:
    low, high = lengths
    return str(low) if low == high else f"{low}:{high}"


def _write(path: str | None, records: list[dict]) -> None:
    """One run writes its record; several write the list (rewritten after each run, so a
    run cut short keeps what was measured)."""
    write_json(path, records[0] if len(records) == 1 else records)


def _workload_args(args: argparse.Namespace) -> dict:
    return {"num_prompts": args.num_prompts, "input_len": list(args.input_len),
            "output_len": list(args.output_len), "seed": args.seed,
            "temperature": args.temperature, "ignore_eos": args.ignore_eos,
            "detokenize": args.detokenize, "prefix_len": args.prefix_len,
            "structured_output": args.structured_output}


def _warm_up(llm) -> None:
    """Untimed requests that compile the kernels' variants before the timed runs: a
    prefill-only step, then a step mixing a prompt chunk with decodes (three prompts
    sized to overflow one step's token budget), then decode steps."""
    from pagedllm import SamplingParams

    config = llm.llm_engine.config
    budget = config.scheduler_config.max_num_batched_tokens
    prompt_len = max(1, min(config.model_config.max_model_len - 9, budget // 2 + budget // 8))
    warm = synthetic_requests(3, (prompt_len, prompt_len), (1, 1),
                              config.model_config.vocab_size, seed=12345)
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in warm],
                 SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)


def fill_call_figures(calls) -> dict:
    """The bitmask fills of a run (``(seconds, rows)`` per call): how many, rows per call,
    and the milliseconds of a call at the median, p99 and most; with the rows filled in
    parallel, a per-row cost far above a one-row call's says the threads did not help."""
    if not calls:
        return {"fill_calls": 0}
    ms = sorted(1e3 * seconds for seconds, _ in calls)
    rows = sum(n for _, n in calls)
    return {"fill_calls": len(calls), "fill_rows_per_call": round(rows / len(calls), 2),
            "fill_ms_p50": round(ms[len(ms) // 2], 4),
            "fill_ms_p99": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 4),
            "fill_ms_max": round(ms[-1], 4),
            "fill_us_per_row": round(1e3 * sum(ms) / rows, 2)}


def ahead_fill_figures(fills) -> dict:
    """The fills ahead of a run one by one (``(seconds, rows, seconds waited for)``, see
    ``MaskPrefetch.fills``): how many, and the milliseconds of a fill and of the step
    loop's wait for it at the median, p90 and most (a constrained step waits for its own
    fill, so the slow fills, not the mean, set what the device waits)."""
    figures = {"ahead_fills": len(fills)}
    for name, values in (("fill", [s for s, _, _ in fills]), ("wait", [w for _, _, w in fills])):
        ms = sorted(1e3 * v for v in values)
        if ms:
            figures.update({f"ahead_{name}_ms_p50": round(ms[len(ms) // 2], 4),
                            f"ahead_{name}_ms_p90": round(ms[int(0.9 * (len(ms) - 1))], 4),
                            f"ahead_{name}_ms_max": round(ms[-1], 4)})
    return figures


def _track_sampling(timer, core, constrained: bool) -> None:
    """Time the sampler's launches (``sampler_s`` in the step timeline; a runner in this
    process) and, constrained, the step loop's grammar calls of a step sampled under masks
    filled ahead: taking the sampled tokens and starting the next fill
    (``grammar_take_s``), the masks handed to the sampler, with the wait for the fill
    (``grammar_masks_s``)."""
    sampler = getattr(core.model_runner, "sampler", None)  # in this process
    if sampler is not None:
        timer.track(sampler, "forward", "sampler")
    if constrained:
        timer.track(core.structured, "take_sampled", "grammar_take")
        timer.track(core.structured, "masks_ahead", "grammar_masks")


def _run_pagedllm(llm, requests: list[SyntheticRequest], args: argparse.Namespace,
                  step_timing: bool = False, constrained: bool = False) -> dict:
    """One timed run; ``constrained``: request ``i`` constrained to JSON schema ``i % 4``."""
    from pagedllm.benchmarks.step_timing import StepTimer, format_summary

    core = llm.llm_engine.engine_core
    core.scheduler.reset_prefix_cache()  # no hits from an earlier run
    stats_before = core.get_stats()
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = _request_params(requests, args, constrained)
    if constrained:
        structured = core.structured
        structured.backend()  # once per engine, not per workload
        ahead = structured.prefetch
        mask_start = (structured.mask_seconds, structured.num_mask_rows,
                      structured.num_mask_steps, structured.num_checked_rows,
                      structured.num_refused_rows, ahead.num_filled, ahead.num_used,
                      ahead.seconds, structured.num_substituted_rows, ahead.start_delay,
                      ahead.wait_seconds)
        structured.fill_calls.clear()
        ahead.fills.clear()
    timer = StepTimer(llm) if step_timing else None
    start = time.perf_counter()
    if timer is None:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:
        with timer:
            _track_sampling(timer, core, constrained)
            outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = reported_seconds(time.perf_counter() - start)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats_after = core.get_stats()
    queries = stats_after.prefix_cache_queries - stats_before.prefix_cache_queries
    hits = stats_after.prefix_cache_hits - stats_before.prefix_cache_hits
    extra = {}
    if args.prefix_len:
        extra.update(prefix_len=args.prefix_len, prompt_tokens_computed=prompt_tokens - hits,
                     prefix_cache_hits=hits,
                     prefix_cache_hit_rate=round(hits / queries, 4) if queries else 0.0)
    if timer is not None:
        extra["step_timing"] = timer.summary()
        extra["step_timeline"] = timer.timeline()
        print(format_summary(extra["step_timing"]), flush=True)
    if constrained:
        mask_s = structured.mask_seconds - mask_start[0]
        rows = structured.num_mask_rows - mask_start[1]
        steps = structured.num_mask_steps - mask_start[2]
        checked = structured.num_checked_rows - mask_start[3]
        refused = structured.num_refused_rows - mask_start[4]
        substituted = structured.num_substituted_rows - mask_start[8]
        extra.update(structured_output="json", mask_host_s=reported_seconds(mask_s),
                     mask_steps=steps, mask_rows=rows, checked_rows=checked,
                     refused_fraction=round(refused / checked, 4) if checked else None,
                     substituted_fraction=round(substituted / checked, 4) if checked else None,
                     masks_filled_ahead=ahead.num_filled - mask_start[5],
                     masks_used_ahead=ahead.num_used - mask_start[6],
                     ahead_fill_s=round(ahead.seconds - mask_start[7], 4),
                     ahead_start_delay_s=round(ahead.start_delay - mask_start[9], 4),
                     ahead_wait_s=round(ahead.wait_seconds - mask_start[10], 4),
                     mask_ms_per_step=round(1e3 * mask_s / max(steps, 1), 4),
                     mask_us_per_token=round(1e6 * mask_s / max(output_tokens, 1), 2),
                     **fill_call_figures(structured.fill_calls),
                     **ahead_fill_figures(ahead.fills))
    return {
        "backend": "pagedllm+json" if constrained else "pagedllm",
        "num_prompts": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "requests_per_s": round(len(requests) / elapsed, 3),
        "output_tok_s": round(output_tokens / elapsed, 1),
        "total_tok_s": round((prompt_tokens + output_tokens) / elapsed, 1),
        "truncated": False,
        "kv_cache_dtype": core.kv_cache_dtype,
        "kv_cache_tokens": core.num_kv_tokens,
        # Preemptions drop computed tokens, which are computed again when the request
        # resumes, or with --swap-space swap them out and back in.
        "preemptions": stats_after.num_preemptions - stats_before.num_preemptions,
        "preempted_tokens": stats_after.num_preempted_tokens - stats_before.num_preempted_tokens,
        "swapped_tokens": stats_after.num_swapped_tokens - stats_before.num_swapped_tokens,
        **extra,
    }


def _run_speculative(engine_args: EngineArgs, requests: list[SyntheticRequest],
                     args: argparse.Namespace) -> list[dict]:
    """The workload on the speculative engine, then on the same engine without
    speculation; returns both records, the speculative one last. Its step costs are timed
    during the run on the CPU; on a GPU, where the timers synchronise each step (which
    would also stop asynchronous scheduling), in a second run of the workload after it."""
    from pagedllm import LLM
    from pagedllm.benchmarks.speculative import StepCosts, acceptance, without_speculation

    llm = LLM(**vars(engine_args))
    _warm_up(llm)
    stats = llm.llm_engine.engine_core.scheduler.spec_decoding_stats
    before = stats.copy()
    costs = StepCosts(llm)
    timed_costs = llm.llm_engine.config.device == "cpu"
    with costs if timed_costs else contextlib.nullcontext():
        spec = _run_pagedllm(llm, requests, args)
    accepted = acceptance(before, stats)
    if not timed_costs:
        with costs:
            _run_pagedllm(llm, requests, args)
    spec_config = llm.llm_engine.config.speculative_config
    spec["backend"] = "pagedllm+spec"
    spec["speculative"] = {"method": spec_config.method,
                           "num_speculative_tokens": spec_config.num_speculative_tokens,
                           **accepted, **costs.summary()}
    del llm, costs  # both hold the engine: its GPU memory goes back before the next one
    gc.collect()
    plain_llm = LLM(**vars(without_speculation(engine_args)))
    _warm_up(plain_llm)
    plain = _run_pagedllm(plain_llm, requests, args)
    del plain_llm
    gc.collect()
    spec["speculative"]["measured_speedup"] = round(spec["output_tok_s"] / plain["output_tok_s"], 3)
    return [plain, spec]


def _submit_again(llm, requests: list[SyntheticRequest], args: argparse.Namespace) -> list[str]:
    """Add ``requests`` to the engine (no prefix-cache hits from the measured run); their ids.
    With ``--structured-output json`` they are constrained, as the run the profiles are
    recorded with."""
    engine = llm.llm_engine
    engine.engine_core.scheduler.reset_prefix_cache()
    ids = []
    params = _request_params(requests, args, constrained=args.structured_output == "json")
    for r, p in zip(requests, params):
        ids.append(engine.next_request_id())
        engine.add_request(ids[-1], {"prompt_token_ids": r.prompt_token_ids}, p)
    return ids


def _profile_run(llm, requests: list[SyntheticRequest], args: argparse.Namespace) -> dict:
    """Submit ``requests`` again and profile every step to the end (``run_profile``)."""
    _submit_again(llm, requests, args)
    print(f"whole-run profile ({len(requests)} requests)", flush=True)
    profiled = profile_run(llm.llm_engine)
    print(profiled.table(), flush=True)
    return profiled.as_dict()


def _profile_steps(llm, requests: list[SyntheticRequest], args: argparse.Namespace,
                   num_steps: int, *, after_prompts: bool) -> str:
    """Submit ``requests`` again and profile ``num_steps`` steps: the first ones (the
    prompts'), or with ``after_prompts`` those after every prompt is in (pure decode while
    no request finishes); aborts the rest."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.scheduler
    ids = _submit_again(llm, requests, args)
    while after_prompts and engine.has_unfinished_requests() and prompts_pending(scheduler):
        engine.step()
    print(f"profile of {num_steps} steps from {'the first decode' if after_prompts else 'the first'} "
          f"step ({len(requests)} requests)", flush=True)
    table = kernel_table(lambda: [engine.step() for _ in range(num_steps)], row_limit=20)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return table


def _request_params(requests: list[SyntheticRequest], args: argparse.Namespace,
                    constrained: bool = False) -> list:
    """Each request's ``SamplingParams``; ``constrained``: request ``i`` constrained to JSON
    schema ``i % 4`` (``structured_workload.py``)."""
    from pagedllm import SamplingParams
    from pagedllm.benchmarks.structured_workload import constraint_for

    return [SamplingParams(max_tokens=r.output_len, ignore_eos=args.ignore_eos,
                           temperature=args.temperature, detokenize=args.detokenize,
                           structured_outputs=constraint_for(i) if constrained else None)
            for i, r in enumerate(requests)]


def _add_ratios(records: list[dict]) -> None:
    """pagedllm's output tok/s over each peer's, on runs of the same number of requests."""
    peers = {(r["backend"], r["num_prompts"]): r.get("output_tok_s") for r in records
             if r.get("backend") in ("hf", "hf-cb")}
    for r in records:
        if r.get("backend") != "pagedllm":
            continue
        for peer, key in (("hf", "ratio_vs_hf_static"), ("hf-cb", "ratio_vs_hf_cb")):
            value = peers.get((peer, r["num_prompts"]))
            if value:
                r[key] = round(r["output_tok_s"] / value, 2)


def _header() -> str:
    return f"{'backend':>9} {'requests':>9} {'output tok':>11} {'elapsed s':>10} {'output tok/s':>13}  note"


def _row(r: dict) -> str:
    if "error" in r:
        return f"{r['backend']:>9} {r['num_prompts']:>9} {'-':>11} {'-':>10} {'-':>13}  {r['error']}"
    note = "stopped at the time limit" if r.get("truncated") else ""
    if "shape" in r:
        note = f"shape {r['shape']} (prompt/output tokens)"
    if "prefix_cache_hit_rate" in r:
        note = (f"prompt tokens computed {r['prompt_tokens_computed']} of "
                f"{r['prompt_tokens']} sent; prefix-cache hit rate "
                f"{100 * r['prefix_cache_hit_rate']:.1f}%")
    if "constrained_ratio" in r:
        refused = ("" if r.get("refused_fraction") is None
                   else f", {100 * r['refused_fraction']:.1f}% of checked tokens refused, "
                        f"{100 * r['substituted_fraction']:.1f}% replaced by a later candidate")
        fills = ("" if not r.get("fill_calls") else
                 f"; bitmask fills of {r['fill_rows_per_call']} rows: {r['fill_ms_p50']} ms "
                 f"median, {r['fill_ms_p99']} p99, {r['fill_us_per_row']} us/row")
        ahead = ("" if not r.get("masks_filled_ahead") else
                 f"; masks filled ahead {r['masks_filled_ahead']}, used "
                 f"{r['masks_used_ahead']} ({r['ahead_fill_s']} s off the step loop, begun "
                 f"{r['ahead_start_delay_s']} s after they were asked for, "
                 f"{r['ahead_wait_s']} s waited for; a fill {r['ahead_fill_ms_p50']} ms "
                 f"median, {r['ahead_fill_ms_p90']} p90, its wait {r['ahead_wait_ms_p50']} / "
                 f"{r['ahead_wait_ms_p90']})")
        note = (f"{r['constrained_ratio']}x unconstrained; constraints {r['mask_ms_per_step']} "
                f"ms/step on the host, {r['mask_us_per_token']} us/token{refused}{fills}{ahead}")
    if "speculative" in r:
        spec = r["speculative"]
        note = (f"{spec['measured_speedup']}x without speculation; K={spec['num_speculative_tokens']}, "
                f"acceptance {spec['acceptance_rate']:.3f}, mean accepted length "
                f"{spec['mean_accepted_length']:.2f}, {spec['tokens_per_step']:.2f} tokens per "
                f"decode step; proposal {spec['proposal_ms']} ms, verification "
                f"{spec['verification_ms']} ms per decode step")
    if r.get("preemptions"):
        note += (f"{'; ' if note else ''}{r['preemptions']} preemptions, "
                 f"{r['preempted_tokens']} computed tokens dropped (computed again)")
        if r.get("swapped_tokens"):
            note += f", {r['swapped_tokens']} swapped out and back"
    return (f"{r['backend']:>9} {r['num_prompts']:>9} {r['output_tokens']:>11} "
            f"{r['elapsed_s']:>10} {r['output_tok_s']:>13}  {note}")


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedllm.benchmarks.throughput``: the same command without the CLI's
    other subcommands (and their imports)."""
    parser = argparse.ArgumentParser(prog="pagedllm bench throughput", description=__doc__,
                                     formatter_class=HelpFormatter)
    add_cli_args(parser)
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    run(parser.parse_args(argv))
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()
           if t is not threading.main_thread()):
        # A peer's generation thread that ignored its stop must not hold the exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
