#!/usr/bin/env python3
"""The HTTP path beside the offline engine, on one workload, in one run (gpu_bench.sh's
``serve`` step).

    python scripts/gpu_bench_serve.py --model qwen3-0.6b --out DIR [--py-spy-seconds 20]

1. ``pagedllm bench throughput`` on the workload (offline, token ids only);
2. ``pagedllm serve MODEL --load-format dummy`` started on a free port, and ``pagedllm bench
   serve`` with the same workload against it (streaming, all requests at once); the
   seconds of CPU the API process, its engine-core process and the benchmark client used
   during the run are read from ``/proc``; with ``--py-spy-seconds`` (and ``py-spy`` on
   PATH), those three processes are sampled that long, from ``--py-spy-delay-s`` into the
   run, and the frames that took the most samples are kept;
3. ``DIR/serve-<model>.json``: a list with one record per ``--api-server-counts`` value
   and round (each a server of that many API processes against the round's offline run;
   ``--rounds N`` repeats 1 and 2, interleaved, and prints the medians): both bench
   records, ``http_vs_offline`` (output tok/s ratio; the target is 0.97), the CPU seconds
   (all API processes together), the profile summary (API process 0), and the steps of
   both runs (``bench throughput --step-timing`` offline; the server's core writes its own
   when ``PAGEDLLM_CORE_STEP_TIMING_JSON`` names a file): per step kind, how many and their
   mean milliseconds, and the seconds all steps took. A short table is printed last.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from pagedllm.distributed.executor import free_port
from pagedllm.engine.core_process import STEP_TIMING_ENV
from pagedllm.entrypoints.event_loop import loop_name

TARGET = 0.97
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    """``/proc/PID/stat``'s fields after the command name (state first); OSError once the
    process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` (0.0 once it is gone)."""
    try:
        fields = _stat(pid)
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (all its threads' children)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def wait_healthy(port: int, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} while starting")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server was not healthy after {timeout_s:.0f} s")


def summarize_profile(raw: str, top: int = 25) -> dict:
    """py-spy's raw (collapsed) stacks: the share of samples in each frame (inclusive) and
    at the top of the stack (self), most first."""
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        total += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
        own[frames[-1]] += int(count)

    def shares(counter: collections.Counter) -> list[list]:
        return [[frame, round(n / total, 4)] for frame, n in counter.most_common(top)]

    return {"samples": total, "inclusive": shares(inclusive) if total else [],
            "self": shares(own) if total else []}


def _bench_process(kind: str, args: argparse.Namespace, extra: list[str], out: Path,
                   share: tuple[int, int] = (0, 1)) -> subprocess.Popen:
    """``pagedllm bench KIND`` on the workload; ``share`` (i, n): the i-th of n equal parts."""
    index, parts = share
    num_prompts = args.num_prompts // parts + (index < args.num_prompts % parts)
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", kind,
               "--num-prompts", str(num_prompts), "--input-len", args.input_len,
               "--output-len", args.output_len, "--temperature", "0", "--output-json", str(out),
               *extra]
    print("+", " ".join(command[2:]), flush=True)
    return subprocess.Popen(command)


def _bench_result(process: subprocess.Popen, out: Path) -> dict:
    if process.wait() != 0:
        raise RuntimeError(f"{' '.join(map(str, process.args[2:4]))} exited with code "
                           f"{process.returncode}")
    record = json.loads(out.read_text())
    return record[-1] if isinstance(record, list) else record


def _merge(records: list[dict]) -> dict:
    """Several clients' runs as one: tokens from the first start to the last end; the latency figures
    are the first client's (each client sends the same mix)."""
    if len(records) == 1:
        return records[0]
    merged = dict(records[0])
    merged["duration_s"] = round(max(r["start_time"] + r["duration_s"] for r in records)
                                 - min(r["start_time"] for r in records), 6)
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens"):
        merged[key] = sum(r[key] for r in records)
    merged["output_throughput"] = round(merged["total_output_tokens"] / merged["duration_s"], 2)
    merged["clients"] = len(records)
    return merged


def _bench(kind: str, args: argparse.Namespace, extra: list[str], out: Path) -> dict:
    return _bench_result(_bench_process(kind, args, extra, out), out)


def run(args: argparse.Namespace) -> list[dict]:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    engine = ["--load-format", "dummy", *args.engine_args.split()]
    records = []
    for round_ in range(args.rounds):
        offline = _bench("throughput", args, ["--model", args.model, *engine, "--step-timing"],
                         scratch / f"offline{round_}.json")
        for count in args.api_server_counts:
            record = _serve_run(args, engine, offline, count, scratch / f"r{round_}-count{count}")
            records.append({**record, "round": round_})
    (out_dir / f"serve-{Path(args.model).name}.json").write_text(json.dumps(records, indent=1))
    print(table(records))
    if args.rounds > 1:
        print(median_table(records))
    return records


def median_table(records: list[dict]) -> str:
    """Per API-process count over the rounds: the median offline and HTTP throughput and
    their ratio (each round's offline run sits just before its servers)."""
    lines = [f"{'model':<16} {'API':>3} {'rounds':>6} {'median offline':>15} "
             f"{'median HTTP':>12} {'ratio':>6}"]
    for count in sorted({r["api_server_count"] for r in records}):
        rows = [r for r in records if r["api_server_count"] == count]
        offline = statistics.median(r["offline_output_tok_s"] for r in rows)
        http = statistics.median(r["http_output_tok_s"] for r in rows)
        lines.append(f"{rows[0]['model']:<16} {count:>3} {len(rows):>6} {offline:>15.0f} "
                     f"{http:>12.0f} {http / offline:>6.3f}")
    return "\n".join(lines)


def server_processes(pid: int) -> tuple[list[int], int | None]:
    """A running ``pagedllm serve``'s API processes (``pid`` first) and its engine core:
    of ``pid``'s children started by multiprocessing's spawn, the core is the oldest."""
    spawned = []
    for child in children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            started = int(_stat(child)[19])  # start time
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            spawned.append((started, child))
    spawned.sort()
    core = spawned[0][1] if spawned else None
    return [pid, *(child for _, child in spawned[1:])], core


def _serve_run(args: argparse.Namespace, engine: list[str], offline: dict, count: int,
               scratch: Path) -> dict:
    """One server with ``count`` API processes, loaded by bench serve: its record."""
    scratch.mkdir()
    port = free_port()
    core_timing = scratch / "core-steps.json"
    server = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", args.model, *engine,
         *shlex.split(args.serve_args),
         "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
         "--api-server-count", str(count)],
        start_new_session=True, env={**os.environ, STEP_TIMING_ENV: str(core_timing)})
    try:
        wait_healthy(port, server, args.startup_timeout_s)
        apis, core = server_processes(server.pid)
        assert core is not None and len(apis) == count, (apis, core)
        before = {"api": sum(map(cpu_seconds, apis)), "core": cpu_seconds(core)}
        client_before = _children_cpu()
        clients = [
            _bench_process("serve", args, ["--port", str(port), "--vocab-size", str(args.vocab_size),
                                           "--seed", str(i)],
                           scratch / f"http{i}.json", share=(i, args.clients))
            for i in range(args.clients)]
        profiles = {name: _start_profile(pid, args, scratch / f"{name}.raw")
                    for name, pid in (("api", server.pid), ("core", core),
                                      ("client", clients[0].pid))}
        http = _merge([_bench_result(c, scratch / f"http{i}.json") for i, c in enumerate(clients)])
        cpu = {"api": round(sum(map(cpu_seconds, apis)) - before["api"], 2),
               "core": round(cpu_seconds(core) - before["core"], 2),
               "client": round(_children_cpu() - client_before, 2)}
        profile_summary = {name: _finish_profile(profile, scratch / f"{name}.raw")
                           for name, profile in profiles.items()}
    finally:
        server.send_signal(signal.SIGTERM)  # it stops the others and the core (which then
        try:                                # writes its step timing)
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)  # whatever is left of the session
    ratio = round(http["output_throughput"] / offline["output_tok_s"], 3)
    core_steps = _read_json(core_timing)
    return {
        "workload": "serve-vs-offline", "model": args.model, "num_prompts": args.num_prompts,
        "input_len": args.input_len, "output_len": args.output_len,
        "engine_args": args.engine_args, "serve_args": args.serve_args,
        "api_server_count": count, "clients": args.clients,
        "offline_output_tok_s": offline["output_tok_s"],
        "http_output_tok_s": http["output_throughput"], "http_vs_offline": ratio,
        "target": TARGET, "met": ratio >= TARGET, "duration_s": http["duration_s"],
        "event_loop": loop_name(),
        "cpu_seconds": cpu, "ttft_ms": http["ttft_ms"], "tpot_ms": http["tpot_ms"],
        "itl_ms": http["itl_ms"], "failed": http["failed"], "profiles": profile_summary,
        "steps": {"offline": _steps(offline.get("step_timing")),
                  "server_core": _steps(core_steps.get("step_timing"))},
        "server_core_step_timing": core_steps.get("step_timing"),
        "timeline": {"offline": offline.get("step_timeline"),
                     "server_core": core_steps.get("timeline")},
        "offline": offline, "http": http,
    }


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _steps(summary: dict | None) -> dict | None:
    """Per step kind, the number of steps, their mean tokens and milliseconds; and the
    seconds all steps took (the core's busy time, startup warm-up excluded)."""
    if not summary:
        return None
    kinds = {kind: {"steps": row["steps"], "tokens": row.get("tokens"), "ms": row["total_ms"]}
             for kind, row in summary.items()}
    busy = sum(row["steps"] * row["total_ms"] for row in summary.values()) / 1e3
    return {**kinds, "busy_s": round(busy, 3)}


def _children_cpu() -> float:
    usage = os.times()
    return usage.children_user + usage.children_system


def _start_profile(pid: int, args: argparse.Namespace, raw: Path) -> subprocess.Popen | None:
    spy = shutil.which("py-spy")
    if not args.py_spy_seconds or spy is None:
        return None
    return subprocess.Popen(
        ["bash", "-c", f"sleep {args.py_spy_delay_s}; exec {spy} record -p {pid} "
         f"-d {args.py_spy_seconds} -r 100 --nonblocking -f raw -o {raw}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _finish_profile(profile: subprocess.Popen | None, raw: Path) -> dict | None:
    if profile is None:
        return None
    try:
        _, err = profile.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        profile.kill()
        return {"error": "py-spy did not finish"}
    if not raw.is_file():
        return {"error": (err or "no profile written").strip()[-300:]}
    return summarize_profile(raw.read_text())


def _ms(value: float | None, width: int, digits: int) -> str:
    """A latency cell: right-aligned (``width`` > 0) or left; ``-`` where there is none
    (TPOT of one-token outputs)."""
    text = "-" if value is None else f"{value:.{digits}f}"
    return text.rjust(width) if width > 0 else text.ljust(-width)


# The core's time outside its steps (see step_timing.py), printed where the record has it.
_TRACKED = ("waiting_s", "messages_s", "send_s", "gc0_s", "gc1_s", "gc2_s")


def table(records: list[dict]) -> str:
    lines = [f"{'model':<16} {'API':>3} {'offline tok/s':>14} {'HTTP tok/s':>11} {'ratio':>6} "
             f"{'TTFT p50/p99 ms':>17} {'TPOT p50/p99 ms':>16}  CPU s (api / core / client)"]
    for r in records:
        cpu = r["cpu_seconds"]
        lines.append(
            f"{r['model']:<16} {r.get('api_server_count', 1):>3} "
            f"{r['offline_output_tok_s']:>14.0f} {r['http_output_tok_s']:>11.0f} "
            f"{r['http_vs_offline']:>6.3f} "
            f"{_ms(r['ttft_ms']['median'], 8, 0)}/{_ms(r['ttft_ms']['p99'], -8, 0)} "
            f"{_ms(r['tpot_ms']['median'], 7, 1)}/{_ms(r['tpot_ms']['p99'], -8, 1)} "
            f"{cpu.get('api', 0):.1f} / {cpu.get('core', 0):.1f} / {cpu.get('client', 0):.1f}"
            f"{'' if r.get('event_loop', 'uvloop') == 'uvloop' else '  (asyncio loop)'}"
            f"{'' if r['met'] else '  (target ' + str(TARGET) + ')'}")
    for r in records:
        steps = r.get("steps") or {}
        cells = []
        for name in ("offline", "server_core"):
            run = steps.get(name)
            if run:
                kinds = ", ".join(f"{v['steps']} {k} x {v['ms']:.2f} ms"
                                  + (f" ({v['tokens']:.0f} tok)" if v.get("tokens") else "")
                                  for k, v in run.items() if k != "busy_s")
                cells.append(f"{name}: {kinds}; busy {run['busy_s']:.2f} s")
        if cells:
            lines.append(f"  steps ({r['model']}, {r.get('api_server_count', 1)} API): "
                         + " | ".join(cells))
        for name, t in (r.get("timeline") or {}).items():
            if t:
                lines.append(f"  timeline ({r['model']}, {r.get('api_server_count', 1)} API, "
                             f"{name}): {t['requests_added']} added, half by "
                             f"{t.get('half_added_s', float('nan')):.2f} s, all by {t['last_add_s']:.2f} s, "
                             f"steps {t['first_step_s']:.2f} -> {t['last_output_s']:.2f} s, "
                             f"busy {t['steps_busy_s']:.2f} s, idle {t['idle_s']:.2f} s"
                             + "".join(f", {k[:-2]} {t[k]:.2f} s" for k in _TRACKED if k in t))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="Prompts are token ids in [0, N) (the served config-only models "
                             "have no tokenizer; default: config.json's vocab_size).")
    parser.add_argument("--out", required=True, help="Directory of the record.")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", default="1024")
    parser.add_argument("--output-len", default="128")
    parser.add_argument("--engine-args", default="", help="More engine flags, for both paths.")
    parser.add_argument("--serve-args", default="",
                        help="More server flags, e.g. '--stream-interval 4' (the HTTP path only).")
    parser.add_argument("--api-server-counts", default=[1],
                        type=lambda text: [int(n) for n in text.split(",")],
                        help="Comma-separated --api-server-count values: one server each, "
                             "against the one offline run (default: 1).")
    parser.add_argument("--rounds", type=int, default=1,
                        help="Rounds of the offline run and the servers, interleaved (a small "
                             "model's figures move from run to run); the medians are printed "
                             "last.")
    parser.add_argument("--clients", type=int, default=1,
                        help="bench serve processes sharing the requests (one client process "
                             "can be the limit on a fast engine).")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--py-spy-seconds", type=int, default=0)
    parser.add_argument("--py-spy-delay-s", type=float, default=5.0,
                        help="Seconds after the benchmark starts before sampling.")
    args = parser.parse_args(argv)
    if args.vocab_size is None:
        from pagedllm.config import resolve_model_path

        config = Path(resolve_model_path(args.model)) / "config.json"
        args.vocab_size = json.loads(config.read_text())["vocab_size"]
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
