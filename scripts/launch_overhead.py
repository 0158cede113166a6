#!/usr/bin/env python3
"""Host time per kernel launch on a CUDA GPU: what an eager (not graphed) step pays per op.

For each Triton kernel an eager prompt step launches (the norms, SiLU, the rope and KV
write, prefill attention), at a prompt step's shapes: the op as the model calls it, the
kernel through Triton's launcher (``kernel[grid](...)``: binding, specialisation key,
cache lookup) and the compiled kernel's own launch with the same arguments (what a
launcher cache could reach); beside them a cuBLAS product and an empty torch op. Each
figure is the median over rounds of ``--calls`` back-to-back calls, divided by the calls
(the kernels are small, so the host, not the device, sets the pace).

    python scripts/launch_overhead.py [--calls 2000] [--out launch.json] [--profile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def host_us(fn: Callable[[], Any], calls: int, rounds: int = 5) -> float:
    """Median host microseconds per call of ``fn`` over ``rounds`` runs of ``calls``."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def capture_launches(run: Callable[[], Any]) -> dict[str, tuple]:
    """The Triton launches ``run`` makes: name -> (jit function, args, kwargs, grid)."""
    from triton.runtime.jit import JITFunction

    seen: dict[str, tuple] = {}
    original = JITFunction.run

    def spy(self, *args, grid, warmup, **kwargs):
        seen.setdefault(self.fn.__name__, (self, args, dict(kwargs), grid))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = spy
    try:
        run()
        torch.cuda.synchronize()
    finally:
        JITFunction.run = original
    return seen


def direct_launch(jit, args: tuple, kwargs: dict, grid) -> Callable[[], None]:
    """The compiled kernel's launch with the arguments the JIT path binds, skipping it."""
    from triton.runtime import driver

    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    compiled = jit[grid](*args, **kwargs)
    binder = jit.device_caches[device][4]
    bound, _, _ = binder(*args, **kwargs)
    values = tuple(bound.values())
    grid = tuple(grid) + (1,) * (3 - len(grid))

    def launch() -> None:
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                     None, None, None, *values)

    return launch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=8192, help="rows of the prompt step")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="also print the host functions of the attention op (cProfile)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("launch_overhead.py needs a CUDA GPU.")
        return 2
    import check_kernels_gpu as ck
    from pagedllm.layers import triton_ops
    from pagedllm.layers.attention.triton_backend import TritonAttentionBackend

    t, hidden, inter = args.tokens, 1024, 3072  # qwen3-0.6b's widths
    x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(t, 2 * inter, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16)
    step = ck.make_step([(0, 1024)] * (t // 1024), seed=1)
    backend = TritonAttentionBackend()
    ops: dict[str, Callable[[], Any]] = {
        "rms_norm": lambda: triton_ops.rms_norm(x, w, 1e-6),
        "rms_norm + residual": lambda: triton_ops.rms_norm(x, w, 1e-6, residual=x),
        "silu_and_mul": lambda: triton_ops.silu_and_mul(gate_up),
        "attention (write + prefill)": ck.forward(backend, step),
    }
    rows: list[dict[str, Any]] = []
    for name, op in ops.items():
        launches = capture_launches(op)
        row = dict(op=name, op_us=round(host_us(op, args.calls), 1), kernels={})
        for kernel, (jit, a, kw, grid) in launches.items():
            row["kernels"][kernel] = dict(
                jit_us=round(host_us(lambda: jit[grid](*a, **kw), args.calls), 1),
                direct_us=round(host_us(direct_launch(jit, a, kw, grid), args.calls), 1),
            )
        rows.append(row)
    rows.append(dict(op="torch.mm (cuBLAS)", op_us=round(host_us(lambda: torch.mm(x[:16], weight), args.calls), 1)))
    rows.append(dict(op="torch.empty", op_us=round(host_us(lambda: torch.empty(t, hidden, device="cuda"), args.calls), 1)))
    print(f"{'op':30} {'op us':>7}  kernel: JIT launcher us / compiled launch us")
    for row in rows:
        kernels = "; ".join(f"{k}: {v['jit_us']} / {v['direct_us']}" for k, v in row.get("kernels", {}).items())
        print(f"{row['op']:30} {row['op_us']:7.1f}  {kernels}")
    if args.profile:
        from pagedllm.benchmarks.common import host_table

        attention = ops["attention (write + prefill)"]
        host_table(lambda: [attention() for _ in range(args.calls)], row_limit=20)
    if args.out:
        args.out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
