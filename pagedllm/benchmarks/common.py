"""Shared pieces of the benchmark commands: synthetic workloads and result records."""

from __future__ import annotations

import datetime
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass
class SyntheticRequest:
    prompt_token_ids: list[int]
    output_len: int


def synthetic_requests(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
    prefix_len: int = 0,
) -> list[SyntheticRequest]:
    """Random-token prompts; lengths uniform in the inclusive ranges, from ``random.Random(seed)``.

    ``prefix_len``: every prompt starts with the same ``prefix_len`` random tokens (a shared
    system prompt), followed by its own ``input_len`` random tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)] if prefix_len else []
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*input_len)
        out_len = rng.randint(*output_len)
        prompt = prefix + [rng.randrange(vocab_size) for _ in range(prompt_len)]
        requests.append(SyntheticRequest(prompt, out_len))
    return requests


def text_prompts(token_ids: list[list[int]], num_prompts: int, prompt_len: int,
                 seed: int = 0) -> list[list[int]]:
    """``num_prompts`` windows of ``prompt_len`` tokens of the token streams ``token_ids``
    (each a tokenized text file), each from a stream drawn at random (those long enough)
    at a random offset, from ``random.Random(seed)``."""
    long_enough = [ids for ids in token_ids if len(ids) >= prompt_len]
    if not long_enough:
        raise ValueError(f"No prompt file holds {prompt_len} tokens: give longer files or "
                         "lower --input-len.")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        ids = rng.choice(long_enough)
        start = rng.randrange(len(ids) - prompt_len + 1)
        prompts.append(ids[start:start + prompt_len])
    return prompts


def parse_range(text: str) -> tuple[int, int]:
    """``"100:1024"`` -> (100, 1024); ``"128"`` -> (128, 128)."""
    lo, _, hi = text.partition(":")
    low, high = int(lo), int(hi or lo)
    if not 1 <= low <= high:
        raise ValueError(f"A length range must be 'LOW:HIGH' with 1 <= LOW <= HIGH, got {text!r}.")
    return low, high


def reported_seconds(seconds: float) -> float:
    """A measured duration as a record reports it: six significant digits, so a run of a
    millisecond keeps its precision. Figures derived from a duration (tokens per second,
    milliseconds per token) are computed from this reported value, so the figures of one
    record agree with each other."""
    return float(f"{seconds:.6g}")


COMMIT_ENV = "PAGEDLLM_COMMIT"
# Beside an extracted package (scripts/ab_prepare.sh): the revision it was extracted from.
REVISION_FILE = "REVISION"


def git_commit() -> str | None:
    """The commit a record names: ``PAGEDLLM_COMMIT`` when set; the revision a package
    extracted by ``scripts/ab_prepare.sh`` came from; else the checkout's short ``HEAD``,
    with ``-dirty`` when tracked files differ from it (the record then ran code no commit
    holds). None outside a checkout, and for a package in an ignored folder without its
    revision file."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    package = Path(__file__).resolve().parents[1]
    revision = package.parent / REVISION_FILE
    if revision.is_file():
        return revision.read_text().strip() or None

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=package)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode or not head.stdout.strip() or git("check-ignore", "-q", ".").returncode == 0:
            return None
        dirty = git("diff", "--quiet", "HEAD", "--").returncode == 1
    except OSError:
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def result_record(**fields) -> dict:
    return {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "command": recorded_command(sys.argv[1:]),
        **fields,
    }


def recorded_command(args: list[str]) -> str:
    """The command line a record names: ``pagedllm`` and ``args``, absolute paths cut to
    their file names (a record says what ran, not on which machine's directories)."""
    def portable(arg: str) -> str:
        flag, equals, value = arg.rpartition("=") if arg.startswith("--") else ("", "", arg)
        if value.startswith("/"):
            value = Path(value).name
        return f"{flag}{equals}{value}"

    return " ".join(["pagedllm", *map(portable, args)])


def parallel_sizes(config) -> dict:
    """The record fields naming how an engine of ``config`` (an ``EngineConfig``) is split."""
    parallel = config.parallel_config
    return {"tensor_parallel_size": parallel.tensor_parallel_size,
            "pipeline_parallel_size": parallel.pipeline_parallel_size}


def write_json(path: str | None, records: dict | list) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(records, indent=2) + "\n")
        print(f"wrote {path}")


def host_table(run: Callable[[], object], row_limit: int = 25) -> str:
    """Run ``run`` under cProfile; returns (and prints) the host functions that took the
    most time, by own time and by cumulative time (this thread only)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(run)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    for key in ("tottime", "cumulative"):
        stats.sort_stats(key).print_stats(row_limit)
    table = text.getvalue()
    print(table, flush=True)
    return table


def kernel_table(run: Callable[[], object], row_limit: int = 15) -> str:
    """Run ``run`` under torch.profiler; returns (and prints) its top ops and kernels by
    device time, then its top host calls by their own host time (a host call that waits
    for the device, such as a synchronising copy or free, shows there), as text tables,
    and on a GPU how much of the profiled span the device sat idle (``device_idle``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    averages = prof.key_averages()
    tables = []
    for keys in (("self_device_time_total", "self_cuda_time_total"), ("self_cpu_time_total",)):
        for key in keys:
            try:
                tables.append(averages.table(sort_by=key, row_limit=row_limit, max_name_column_width=60))
                break
            except Exception:  # noqa: BLE001 - the sort keys differ across torch versions
                continue
    device_events = [(e.time_range.start, e.time_range.end) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA]
    if device_events:
        tables.append(device_idle(device_events))
    table = "\n".join(tables)
    print(table, flush=True)
    return table


def device_idle(intervals: list[tuple[float, float]]) -> str:
    """One line: the span from the first device event's start to the last one's end, and
    the time inside it that no event covered (the device idle, waiting for the host).
    ``intervals`` are (start, end) in microseconds, overlapping or not."""
    intervals = sorted(intervals)
    first = covered_until = intervals[0][0]
    idle = 0.0
    for start, end in intervals:
        if start > covered_until:
            idle += start - covered_until
        covered_until = max(covered_until, end)
    span = covered_until - first
    return (f"device idle {idle / 1e3:.1f} ms of a {span / 1e3:.1f} ms span "
            f"({100 * idle / span if span else 0.0:.1f}%)")
