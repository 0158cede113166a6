"""Time one mixture-of-experts layer on a GPU: the grouped Triton GEMM
(``layers/fused_moe/triton_moe.py``) against the loop over experts (``torch_ref.py``),
at Mixtral-8x7B's and Qwen3-30B-A3B's expert shapes, after checking they agree.

Usage: python scripts/bench_fused_moe.py [--tokens 1,16,256,4096] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.layers.fused_moe.routing import select_experts  # noqa: E402
from pagedllm.layers.fused_moe.torch_ref import fused_moe_reference  # noqa: E402
from pagedllm.layers.fused_moe.triton_moe import fused_moe_triton  # noqa: E402

# name: (experts, top_k, hidden, expert intermediate, renormalize)
SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336, True), "qwen3-30b-a3b": (128, 8, 2048, 768, True)}


def _time_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,16,256,4096")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print("shape, tokens, fused ms, expert loop ms, speed-up, max abs diff / max abs")
    for name, (experts, top_k, hidden, inter, renormalize) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen)
               * hidden ** -0.5).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen)
              * inter ** -0.5).to(dtype)
        router = torch.randn(experts, hidden, device="cuda", generator=gen).to(dtype)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
            weights, ids = select_experts(x @ router.T, top_k, renormalize)
            fused = fused_moe_triton(x, w13, w2, weights, ids)
            ref = fused_moe_reference(x, w13, w2, weights, ids)
            err = (fused.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
            t_fused = _time_ms(lambda: fused_moe_triton(x, w13, w2, weights, ids))
            t_loop = _time_ms(lambda: fused_moe_reference(x, w13, w2, weights, ids))
            print(f"{name}, {tokens}, {t_fused:.3f}, {t_loop:.3f}, {t_loop / t_fused:.2f}x, "
                  f"{err:.2e}", flush=True)


if __name__ == "__main__":
    main()
