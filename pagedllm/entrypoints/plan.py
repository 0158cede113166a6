"""``pagedllm plan``: how many GPUs a traffic profile needs, and what it costs, per candidate.

    pagedllm plan --model llama-3.1-70b --requests-per-day 1000000 --input-len 1000 \\
        --output-len 200 --ttft-p95-ms 2000 --tpot-p95-ms 50 --candidates candidates.yaml

Memory: the engine's own model (``worker/kv_allocator.py``). A group of ``tp`` GPUs holds
``gpu_memory_utilization x tp x memory_gib`` GiB, less the weights (parameters x dtype
bytes from config.json; fp8 projections one byte plus their scales); the rest is KV
cache, in blocks of ``block_bytes`` (one byte an element with ``kv_cache_dtype: fp8``). The plan fits when one request of ``max_model_len``
(default: the longest input plus the longest output) fits; its concurrency is the
requests of mean KV length (``input x (1 - shared prefix fraction) + output``) the blocks
hold, at most ``max_num_seqs``. Activations and CUDA graphs are not subtracted (the
engine measures them at start), so the cache is a little smaller in practice.

Throughput, per group (replica):
- measured: the newest bench record (``--records``: ``bench throughput`` / ``latency`` /
  ``serve`` JSON files) of the same model, GPU, quantization, KV-cache dtype and TP size; a
  ``bench serve``
  record (also one ``--measure-url`` takes against a live server with the profile) brings
  TTFT and TPOT (p95 when recorded; a p99 within the target holds the p95 target too);
- roofline (only with the candidate's ``bandwidth_gb_s`` and ``tflops``, labelled as such):
  ``B`` = the concurrency, lowered until ``step_s`` meets the TPOT target when one is
  set; one decode step reads the weights plus the KV of ``B`` requests
  at their mean context (input + output / 2), and computes ``2 x parameters`` FLOPs per
  token of the batch plus each request's prefill spread over its output tokens::

      step_s = max((weights + B x ctx x kv_bytes_per_token) / bandwidth,
                   2 x params x B x (1 + input_eff / output) / flops)
      output_tok_s = B / step_s;  TPOT >= step_s;  TTFT >= 2 x params x input_eff / flops

  a bound no engine beats, so a target missed at batch 1 (or by the prompt alone) is
  missed; one it meets stays "unknown";
- neither: throughput, GPUs and cost are "unknown" (nothing is invented).

Then: peak output tokens/s = peak requests/s x mean output; replicas = ceil(peak output
tokens/s / per-replica output tokens/s); GPUs = replicas x tp; cost per day = GPUs x price
per hour x 24; cost per million tokens = cost per day / (requests per day x tokens per
request / 1e6), for output tokens and for all (input + output) tokens. Peak requests/s is
``--peak-rps``, else requests per day / 86400 x ``--peak-factor``. TP above 1 is a
projection: per-GPU throughput under tensor parallelism is not measured yet, so a replica
of ``tp`` GPUs is credited with ``tp`` times one GPU's memory and speed.

Recommended: the cheapest plan per day that fits, has a known cost and does not miss a
latency target, preferring plans whose targets are known to hold.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pagedllm.config import normalize_kv_cache_dtype
from pagedllm.engine.arg_utils import CUDA_MAX_NUM_SEQS
from pagedllm.worker import kv_allocator as kv

_GIB = 1 << 30
SECONDS_PER_DAY = 86400


@dataclass
class Profile:
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    requests_per_day: float | None = None
    peak_rps: float | None = None
    peak_factor: float = 2.0
    prefix_fraction: float = 0.0
    ttft_p95_ms: float | None = None
    tpot_p95_ms: float | None = None

    def __post_init__(self) -> None:
        if self.requests_per_day is None and self.peak_rps is None:
            raise ValueError("Give the traffic: --requests-per-day N or --peak-rps R.")
        if not 0.0 <= self.prefix_fraction < 1.0:
            raise ValueError(f"--prefix-fraction must be in [0, 1), got {self.prefix_fraction}.")

    @property
    def input_mean(self) -> float:
        return sum(self.input_len) / 2

    @property
    def output_mean(self) -> float:
        return sum(self.output_len) / 2

    @property
    def daily_requests(self) -> float:
        if self.requests_per_day is not None:
            return self.requests_per_day
        return self.peak_rps * SECONDS_PER_DAY / self.peak_factor

    @property
    def peak(self) -> float:
        if self.peak_rps is not None:
            return self.peak_rps
        return self.requests_per_day / SECONDS_PER_DAY * self.peak_factor


# A candidate's quantization -> how ``weight_bytes`` counts its projections: FP8, or 4-bit
# integer weights in groups of 128 (the usual GPTQ and AWQ exports), or bitsandbytes' 4-bit
# codes in blocks of 64.
WEIGHT_STORAGE = {None: (None, -1), "fp8": ("fp8", -1), "gptq": ("int4", 128),
                  "awq": ("int4", 128), "bitsandbytes": ("nf4", 64)}


@dataclass
class Candidate:
    name: str
    gpu: str
    price_per_hour: float
    memory_gib: float
    tp: int = 1
    dtype: str | None = None  # None: the model's
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "fp8": one byte an element
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_num_seqs: int = CUDA_MAX_NUM_SEQS  # the engine's default on a GPU
    max_model_len: int | None = None  # None: longest input + longest output
    bandwidth_gb_s: float | None = None  # per GPU, for the roofline
    tflops: float | None = None  # dense, per GPU, in the dtype the projections run in


@dataclass
class Measurement:
    source: str
    output_tok_s: float
    ttft_ms: dict | None = None
    tpot_ms: dict | None = None
    tpot_floor_ms: float | None = None  # batch-1 decode (bench latency): TPOT is never lower
    input_len: list | None = None
    output_len: list | None = None


@dataclass
class Plan:
    candidate: str
    gpu: str
    tp: int
    projection: bool
    fits: bool
    weights_gib: float
    kv_cache_gib: float
    kv_tokens: int
    max_concurrency: int
    throughput_source: str
    output_tok_s_per_replica: float | None
    replicas: int | None
    gpus: int | None
    cost_per_day: float | None
    cost_per_million_output_tokens: float | None
    cost_per_million_tokens: float | None
    ttft_p95: str
    tpot_p95: str
    notes: list[str] = field(default_factory=list)


# -- records -------------------------------------------------------------------------------
def _flag(command: str, name: str) -> str | None:
    words = command.split()
    return words[words.index(name) + 1] if name in words[:-1] else None


def iter_records(paths: list[Path]):
    """(file, context text, record) for every run record in bench JSON files: a record, a
    list of them, or ``{"runs": ...}`` (a list, or a dict of lists)."""
    for path in paths:
        data = json.loads(Path(path).read_text())
        context = f"{Path(path).name} {data.get('note', '') if isinstance(data, dict) else ''}"
        runs = data.get("runs", data) if isinstance(data, dict) else data
        if isinstance(runs, dict):
            runs = [runs] if "workload" in runs else [r for v in runs.values()
                                                      for r in (v if isinstance(v, list) else [v])]
        for record in runs:
            if isinstance(record, dict) and "workload" in record:
                yield Path(path), context, record


def _record_matches(record: dict, context: str, model: str, candidate: Candidate,
                    model_dtype: str) -> bool:
    command = record.get("command", "")
    gpu = str(record.get("gpu") or context).lower()
    quantization = record.get("quantization") or _flag(command, "--quantization")
    tp = int(_flag(command, "--tensor-parallel-size") or _flag(command, "-tp") or 1)
    dtype = _flag(command, "--dtype") or model_dtype
    kv_cache_dtype = normalize_kv_cache_dtype(_flag(command, "--kv-cache-dtype") or "auto")
    return (record.get("model") == model and candidate.gpu.lower() in gpu
            and quantization == candidate.quantization and tp == candidate.tp
            and dtype == (candidate.dtype or model_dtype)
            and kv_cache_dtype == normalize_kv_cache_dtype(candidate.kv_cache_dtype))


def find_measurement(paths: list[Path], model: str, candidate: Candidate,
                     model_dtype: str) -> Measurement | None:
    """The newest matching unconstrained throughput or serve record (a serve record wins a
    tie of dates: it carries latencies), with the newest batch-1 TPOT."""
    best, best_key, floor = None, None, None
    for order, (path, context, record) in enumerate(iter_records(paths)):
        if not _record_matches(record, context, model, candidate, model_dtype):
            continue
        workload, date = record["workload"], record.get("date", "")
        if workload == "L1" and record.get("tpot_ms"):
            floor = record["tpot_ms"]
            continue
        constrained = (record.get("structured_output") not in (None, "none")
                       or (record.get("workload_args") or {}).get("structured_output")
                       not in (None, "none") or record.get("backend") not in (None, "pagedllm"))
        if constrained:
            continue
        source = f"{path.name}: {workload} {record.get('command', '')}".strip()
        if workload == "serve" and record.get("output_throughput"):
            found = Measurement(source, record["output_throughput"], record.get("ttft_ms"),
                                record.get("tpot_ms"), input_len=record.get("input_len"),
                                output_len=record.get("output_len"))
            key = (date, 1, order)
        elif workload in ("W1", "throughput") and record.get("output_tok_s"):
            args = record.get("workload_args") or {}
            found = Measurement(source, record["output_tok_s"],
                                input_len=args.get("input_len") or _range(record, "--input-len"),
                                output_len=args.get("output_len") or _range(record, "--output-len"))
            key = (date, 0, order)
        else:
            continue
        if best_key is None or key > best_key:
            best, best_key = found, key
    if best is not None:
        best.tpot_floor_ms = floor
    return best


def _range(record: dict, flag: str) -> list[int] | None:
    text = _flag(record.get("command", ""), flag)
    if text is None:
        return None
    low, _, high = text.partition(":")
    return [int(low), int(high or low)]


# -- the arithmetic -------------------------------------------------------------------------
def _judge(target: float | None, stats: dict | None, floor: float | None) -> str:
    """"yes", "no" or "unknown (...)" for a p95 target, from recorded stats or a lower bound."""
    if target is None:
        return "not set"
    if stats:
        if stats.get("p95") is not None:
            return f"{'yes' if stats['p95'] <= target else 'no'} (p95 {stats['p95']:.1f} ms)"
        if stats.get("p99") is not None and stats["p99"] <= target:
            return f"yes (p99 {stats['p99']:.1f} ms)"
    if floor is not None and floor > target:
        return f"no (at least {floor:.1f} ms)"
    return "unknown"


def plan_candidate(profile: Profile, hf_config: dict, candidate: Candidate,
                   measurement: Measurement | None) -> Plan:
    model_dtype = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    dtype = candidate.dtype or model_dtype
    element = kv.DTYPE_BYTES[dtype]
    if candidate.quantization not in WEIGHT_STORAGE:
        raise ValueError(f"Candidate {candidate.name}: quantization={candidate.quantization!r} "
                         f"is not one of {sorted(q for q in WEIGHT_STORAGE if q)}.")
    weights = kv.weight_bytes(hf_config, element, *WEIGHT_STORAGE[candidate.quantization])
    params = kv.weight_bytes(hf_config, 1)
    heads = hf_config["num_attention_heads"]
    per_block = kv.block_bytes(
        num_layers=hf_config["num_hidden_layers"], block_size=candidate.block_size,
        num_kv_heads=hf_config.get("num_key_value_heads") or heads,
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
        element_size=kv.kv_element_size(normalize_kv_cache_dtype(candidate.kv_cache_dtype), dtype))
    max_model_len = candidate.max_model_len or profile.input_len[1] + profile.output_len[1]
    total = int(candidate.tp * candidate.memory_gib * _GIB)
    available = kv.gpu_kv_bytes(total, candidate.gpu_memory_utilization, weights)
    usable = candidate.max_num_seqs * kv.blocks_per_request(max_model_len, candidate.block_size)
    blocks = kv.blocks_for_bytes(available, per_block, usable)
    fits = blocks >= kv.blocks_per_request(max_model_len, candidate.block_size)
    input_eff = profile.input_mean * (1 - profile.prefix_fraction)
    request_tokens = math.ceil(input_eff + profile.output_mean)
    concurrency = min(kv.max_concurrency(blocks, request_tokens, candidate.block_size),
                      candidate.max_num_seqs)
    notes = []
    if candidate.tp > 1:
        notes.append("projection: tensor-parallel throughput is projected, not measured")
    if not fits:
        notes.append(f"does not fit: {weights / _GIB:.1f} GiB of weights leave "
                     f"{max(available, 0) / _GIB:.1f} GiB, less than one request of "
                     f"{max_model_len} tokens needs")

    tok_s, source, ttft, tpot = None, "none: no bench record matches", "unknown", "unknown"
    if fits and measurement is not None:
        tok_s, source = measurement.output_tok_s, f"measured ({measurement.source})"
        ttft = _judge(profile.ttft_p95_ms, measurement.ttft_ms, None)
        tpot = _judge(profile.tpot_p95_ms, measurement.tpot_ms, measurement.tpot_floor_ms)
        if measurement.input_len and measurement.output_len and (
                list(measurement.input_len) != list(profile.input_len)
                or list(measurement.output_len) != list(profile.output_len)):
            notes.append(f"measured on input {measurement.input_len}, output "
                         f"{measurement.output_len}, not the profile's lengths")
    elif fits and candidate.bandwidth_gb_s and candidate.tflops:
        bandwidth = candidate.tp * candidate.bandwidth_gb_s * 1e9
        flops = candidate.tp * candidate.tflops * 1e12
        context = profile.input_mean + profile.output_mean / 2
        kv_per_token = per_block / candidate.block_size
        def step_s(batch: int) -> float:
            memory_s = (weights + batch * context * kv_per_token) / bandwidth
            compute_s = 2 * params * batch * (1 + input_eff / profile.output_mean) / flops
            return max(memory_s, compute_s)

        batch = concurrency
        if profile.tpot_p95_ms is not None:  # the largest batch whose step meets the target
            while batch > 1 and step_s(batch) * 1e3 > profile.tpot_p95_ms:
                batch -= 1
        tok_s = batch / step_s(batch)
        source = (f"roofline estimate ({candidate.bandwidth_gb_s:g} GB/s, "
                  f"{candidate.tflops:g} TFLOPS per GPU, batch {batch}, step "
                  f"{step_s(batch) * 1e3:.1f} ms): an upper bound")
        ttft = _judge(profile.ttft_p95_ms, None, 2 * params * input_eff / flops * 1e3)
        tpot = _judge(profile.tpot_p95_ms, None, step_s(1) * 1e3)
    elif fits:
        notes.append("no throughput: add a bench record of this model and GPU (--records), "
                     "measure a live server (--measure-url), or give bandwidth_gb_s and "
                     "tflops for a roofline estimate")

    replicas = gpus = cost = per_m_out = per_m_all = None
    if tok_s:
        replicas = max(1, math.ceil(profile.peak * profile.output_mean / tok_s))
        gpus = replicas * candidate.tp
        cost = gpus * candidate.price_per_hour * 24
        per_m_out = cost / (profile.daily_requests * profile.output_mean / 1e6)
        per_m_all = cost / (profile.daily_requests * (profile.input_mean + profile.output_mean) / 1e6)
    return Plan(
        candidate=candidate.name, gpu=candidate.gpu, tp=candidate.tp,
        projection=candidate.tp > 1, fits=fits, weights_gib=round(weights / _GIB, 2),
        kv_cache_gib=round(max(available, 0) / _GIB, 2),
        kv_tokens=blocks * candidate.block_size, max_concurrency=concurrency,
        throughput_source=source,
        output_tok_s_per_replica=None if tok_s is None else round(tok_s, 1),
        replicas=replicas, gpus=gpus, cost_per_day=None if cost is None else round(cost, 2),
        cost_per_million_output_tokens=None if per_m_out is None else round(per_m_out, 4),
        cost_per_million_tokens=None if per_m_all is None else round(per_m_all, 4),
        ttft_p95=ttft, tpot_p95=tpot, notes=notes,
    )


def recommend(plans: list[Plan]) -> Plan | None:
    usable = [p for p in plans if p.fits and p.cost_per_day is not None
              and not p.ttft_p95.startswith("no ") and not p.tpot_p95.startswith("no ")]

    def known(plan: Plan) -> int:
        return sum(not s.startswith(("yes", "not set")) for s in (plan.ttft_p95, plan.tpot_p95))

    return min(usable, key=lambda p: (known(p), p.cost_per_day), default=None)


# -- command line ---------------------------------------------------------------------------
def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from pagedllm.benchmarks.common import parse_range

    traffic = parser.add_argument_group("traffic profile")
    traffic.add_argument("--model", default="llama-3.1-8b",
                         help="A built-in config (llama-3.1-70b, ...) or a model directory.")
    traffic.add_argument("--requests-per-day", type=float, default=None, help="Daily requests.")
    traffic.add_argument("--peak-rps", type=float, default=None,
                         help="Peak requests per second (default: requests per day / 86400 x "
                              "--peak-factor).")
    traffic.add_argument("--peak-factor", type=float, default=2.0,
                         help="Peak over mean request rate, when only --requests-per-day is given.")
    traffic.add_argument("--input-len", type=parse_range, default="512",
                         help="Prompt tokens: a mean, or LOW:HIGH (uniform).")
    traffic.add_argument("--output-len", type=parse_range, default="256",
                         help="Output tokens: a mean, or LOW:HIGH (uniform).")
    traffic.add_argument("--prefix-fraction", type=float, default=0.0,
                         help="Fraction of each prompt that is a prefix shared between requests "
                              "(its KV is cached once).")
    traffic.add_argument("--ttft-p95-ms", type=float, default=None, help="TTFT p95 target.")
    traffic.add_argument("--tpot-p95-ms", type=float, default=None, help="TPOT p95 target.")
    cand = parser.add_argument_group("candidates (a file, and/or one from flags)")
    cand.add_argument("--candidates", default=None, metavar="FILE",
                      help="YAML or JSON: a list of candidates, or {candidates: [...]}, each "
                           "with the fields of the flags below (name, gpu, price_per_hour, "
                           "memory_gib, tp, dtype, quantization, kv_cache_dtype, "
                           "gpu_memory_utilization, "
                           "max_num_seqs, max_model_len, bandwidth_gb_s, tflops).")
    cand.add_argument("--gpu", default=None, help="GPU type, as bench records name it (H200).")
    cand.add_argument("--price-per-hour", type=float, default=None, help="Price of one GPU.")
    cand.add_argument("--memory-gib", type=float, default=None,
                      help="Memory of one GPU, as torch reports it (H200: 139.8, H100: 79.2).")
    cand.add_argument("--tp", type=int, default=1, help="GPUs per replica (tensor parallel).")
    cand.add_argument("--dtype", default=None, help="The model's dtype unless given.")
    cand.add_argument("--quantization", default=None,
                      choices=[q for q in WEIGHT_STORAGE if q is not None],
                      help="fp8 projections, or 4-bit ones (gptq, awq: groups of 128; "
                           "bitsandbytes: blocks of 64).")
    cand.add_argument("--kv-cache-dtype", default="auto",
                      help="fp8: the KV cache in one byte an element (auto: the model's dtype).")
    cand.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                      help="Fraction of GPU memory for weights, activations and KV cache.")
    cand.add_argument("--bandwidth-gb-s", type=float, default=None,
                      help="Memory bandwidth of one GPU, GB/s (for a roofline estimate).")
    cand.add_argument("--tflops", type=float, default=None,
                      help="Dense TFLOPS of one GPU in the compute dtype (for a roofline estimate).")
    meas = parser.add_argument_group("measurements")
    meas.add_argument("--records", nargs="*", default=None, metavar="FILE",
                      help="bench JSON records (default: benchmarks/results/*.json when present).")
    meas.add_argument("--measure-url", default=None,
                      help="Run bench serve with the profile against this live server, and use "
                           "the result for --measure-candidate.")
    meas.add_argument("--measure-candidate", default=None,
                      help="The candidate the live server runs (default: the first).")
    meas.add_argument("--measure-num-prompts", type=int, default=200, help="Requests to send.")
    parser.add_argument("--output-json", default=None, help="Write the plans here.")


def load_candidates(args: argparse.Namespace) -> list[Candidate]:
    candidates = []
    if args.candidates:
        text = Path(args.candidates).read_text()
        if args.candidates.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        items = data.get("candidates", []) if isinstance(data, dict) else data
        candidates = [Candidate(**item) for item in items]
    if args.gpu:
        if args.price_per_hour is None or args.memory_gib is None:
            raise ValueError("A candidate from flags needs --gpu, --price-per-hour and --memory-gib.")
        candidates.append(Candidate(
            name=f"{args.gpu} x{args.tp} {args.quantization or args.dtype or 'model dtype'}"
                 f"{' fp8-kv' if normalize_kv_cache_dtype(args.kv_cache_dtype) == 'fp8' else ''}",
            gpu=args.gpu, price_per_hour=args.price_per_hour, memory_gib=args.memory_gib,
            tp=args.tp, dtype=args.dtype, quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            bandwidth_gb_s=args.bandwidth_gb_s, tflops=args.tflops))
    if not candidates:
        raise ValueError("Give candidates: --candidates FILE, or --gpu, --price-per-hour and "
                         "--memory-gib for one.")
    return candidates


def _measure(args: argparse.Namespace, profile: Profile, model: str) -> Measurement:
    from pagedllm.benchmarks import serve as serve_bench

    parser = argparse.ArgumentParser()
    serve_bench.add_cli_args(parser)
    bench_args = parser.parse_args([
        "--base-url", args.measure_url, "--num-prompts", str(args.measure_num_prompts),
        "--input-len", "%d:%d" % profile.input_len, "--output-len", "%d:%d" % profile.output_len,
        "--request-rate", str(profile.peak)])
    record = serve_bench.run(bench_args)
    return Measurement(f"bench serve against {args.measure_url}", record["output_throughput"],
                       record.get("ttft_ms"), record.get("tpot_ms"),
                       input_len=record.get("input_len"), output_len=record.get("output_len"))


def make_plans(args: argparse.Namespace) -> tuple[Profile, list[Plan]]:
    from pagedllm.config import read_hf_config, resolve_model_path

    profile = Profile(input_len=args.input_len, output_len=args.output_len,
                      requests_per_day=args.requests_per_day, peak_rps=args.peak_rps,
                      peak_factor=args.peak_factor, prefix_fraction=args.prefix_fraction,
                      ttft_p95_ms=args.ttft_p95_ms, tpot_p95_ms=args.tpot_p95_ms)
    hf_config = read_hf_config(resolve_model_path(args.model, local_files_only=True))
    model_dtype = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    records = args.records
    if records is None:
        records = sorted(Path("benchmarks/results").glob("*.json"))
    candidates = load_candidates(args)
    measured_name = args.measure_candidate or candidates[0].name
    live = _measure(args, profile, args.model) if args.measure_url else None
    plans = []
    for candidate in candidates:
        measurement = live if live is not None and candidate.name == measured_name else (
            find_measurement([Path(r) for r in records], args.model, candidate, model_dtype))
        plans.append(plan_candidate(profile, hf_config, candidate, measurement))
    return profile, plans


def _money(value: float | None, digits: int = 2) -> str:
    return "unknown" if value is None else f"${value:,.{digits}f}"


def format_plans(profile: Profile, plans: list[Plan], best: Plan | None) -> str:
    lines = [f"Traffic: {profile.daily_requests:,.0f} requests/day, peak {profile.peak:.2f} "
             f"requests/s; input {profile.input_len[0]}:{profile.input_len[1]} (mean "
             f"{profile.input_mean:g}), output {profile.output_len[0]}:{profile.output_len[1]} "
             f"(mean {profile.output_mean:g}), shared prefix {profile.prefix_fraction:.0%}; "
             f"peak output {profile.peak * profile.output_mean:,.0f} tokens/s"]
    for p in plans:
        lines += [
            "", f"{p.candidate}  ({p.gpu} x{p.tp} per replica{', projection' if p.projection else ''})",
            f"  memory: weights {p.weights_gib} GiB, KV cache {p.kv_cache_gib} GiB = "
            f"{p.kv_tokens} tokens, max concurrency {p.max_concurrency}"
            f"{'' if p.fits else ' (does not fit)'}",
            f"  throughput: {p.output_tok_s_per_replica or 'unknown'} output tokens/s per "
            f"replica, {p.throughput_source}",
            f"  GPUs: {p.gpus if p.gpus is not None else 'unknown'} ({p.replicas or '?'} "
            f"replicas); cost/day {_money(p.cost_per_day)}; per million output tokens "
            f"{_money(p.cost_per_million_output_tokens, 4)}, per million tokens "
            f"{_money(p.cost_per_million_tokens, 4)}",
            f"  targets: TTFT p95 {p.ttft_p95}; TPOT p95 {p.tpot_p95}",
            *[f"  note: {note}" for note in p.notes],
        ]
    lines.append("")
    if best is None:
        lines.append("Recommendation: none: no candidate fits with a known throughput and its "
                     "targets; measure one (--measure-url, bench records) or add candidates.")
    else:
        lines.append(f"Recommendation: {best.candidate}: {best.gpus} GPUs, "
                     f"{_money(best.cost_per_day)}/day"
                     f"{' (a projection)' if best.projection else ''}.")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    from pagedllm.benchmarks.common import write_json

    profile, plans = make_plans(args)
    best = recommend(plans)
    print(format_plans(profile, plans, best))
    result = {"profile": {**asdict(profile), "peak_rps": profile.peak,
                          "requests_per_day": profile.daily_requests},
              "plans": [asdict(p) for p in plans],
              "recommendation": None if best is None else best.candidate}
    write_json(args.output_json, result)
    return result
