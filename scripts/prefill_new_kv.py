#!/usr/bin/env python3
"""Time prefill attention with the step's new keys read from the pages and from contiguous
rows (``paged_prefill_attention``'s ``new_kv``), and, where there is a cached context, with
that context widened into rows too (``widen_context_rows``, timed with the launch), over a
bf16 and an FP8 cache, on Llama-3.1-8B's attention shapes (32 query heads, 8 KV heads,
head_dim 128, pages of 16):

    python scripts/prefill_new_kv.py --out prefill_new_kv.json

Cases: four fresh prompts of 2,048 tokens (P1), one of 8,192, a chunk of 2,048 on 6,144
cached tokens, two chunks of 2,048 on 1,000; with ``--long``, P2's one step of 32,000 and
its last chunk of 8,192 on 23,808. Each launch is checked against the other (largest
difference printed) and timed with ``triton.testing.do_bench``; TFLOP/s count the
causally visible keys. With ``--sdpa cudnn,flash``, torch's fused attention of one
sequence (bf16, its keys contiguous, causal from the bottom right) is timed beside the
kernel: what library kernels built for the GPU reach on the same work; and fresh prompts
of one length (P1's four) through one cuDNN call with a batch dimension, over either cache
(its keys from the rows). CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.layers.attention.kv_quant import paged_kv_views  # noqa: E402
from pagedllm.layers.attention.triton_kv_write import write_kv_cache  # noqa: E402
from pagedllm.layers.attention.triton_prefill import (  # noqa: E402
    paged_prefill_attention, plan_context_rows, products_dtype, widen_context_rows,
)
from tests.kernels.paged_batch import batch_args, make_fp8_step, make_step  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
CASES = (("4 x 2048", ((0, 2048),) * 4), ("1 x 8192", ((0, 8192),)),
         ("2048 on 6144", ((6144, 2048),)), ("2 x 2048 on 1000", ((1000, 2048),) * 2))
LONG_CASES = (("1 x 32000", ((0, 32000),)), ("8192 on 23808", ((23808, 8192),)))
SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}


def visible_flops(seqs: tuple[tuple[int, int], ...]) -> float:
    """Both products' FLOPs over the keys each query sees (cached ones and its causal new ones)."""
    return sum(4 * n * (c + (n + 1) / 2) * HEAD_DIM * HEADS for c, n in seqs)


def sdpa_rows(label: str, seqs: tuple[tuple[int, int], ...], backends: list[str],
              reference: torch.Tensor, query: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> list[dict]:
    """torch's fused attention of one sequence's ``query [n, H, D]`` over ``keys, values
    [c + n, Hkv, D]`` (its whole context), bottom-right causal, by backend; each output is
    compared with ``reference`` (the kernel's)."""
    (context, n), = seqs
    q = query.transpose(0, 1).unsqueeze(0)
    k, v = (x.transpose(0, 1).unsqueeze(0) for x in (keys, values))
    rows = []
    for name in backends:
        for gqa in ("native", "repeated"):
            kk, vv = ((k, v) if gqa == "native"
                      else (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v)))
            mask = None if context == 0 else causal_lower_right(n, context + n)

            def launch(kk=kk, vv=vv, mask=mask, gqa=gqa) -> torch.Tensor:
                with sdpa_kernel([SDPA_BACKENDS[name]]):
                    return F.scaled_dot_product_attention(
                        q, kk, vv, attn_mask=mask, is_causal=mask is None,
                        scale=HEAD_DIM ** -0.5, enable_gqa=gqa == "native")

            try:
                out = launch()
                torch.cuda.synchronize()
            except RuntimeError as error:
                print(f"  sdpa {name} ({gqa} groups): {str(error).splitlines()[0][:160]}")
                continue
            diff = (out[0].transpose(0, 1).float() - reference).abs().max().item()
            us = triton.testing.do_bench(launch, warmup=20, rep=200) * 1000
            row = dict(case=label, cache="bf16", keys_from=f"sdpa {name}, {gqa} groups",
                       us=round(us, 1), tflops=round(visible_flops(seqs) / us / 1e6, 1),
                       largest_difference=round(diff, 4))
            rows.append(row)
            print(row, flush=True)
    return rows


def batched_fresh_row(label: str, cache: str, seqs: tuple[tuple[int, int], ...],
                      reference: torch.Tensor, query: torch.Tensor, keys: torch.Tensor,
                      values: torch.Tensor) -> dict:
    """Fresh prompts of one length through one cuDNN call with a batch dimension (the
    queries cast to the keys' dtype inside the timing, as a step would), compared with the
    kernel's output."""
    batch, n = len(seqs), seqs[0][1]

    def launch() -> torch.Tensor:
        q, k, v = (x.to(keys.dtype).view(batch, n, *x.shape[1:]).transpose(1, 2)
                   for x in (query, keys, values))
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, False, 0.0, True, False, scale=HEAD_DIM ** -0.5)[0]

    out = launch().transpose(1, 2).reshape(reference.shape)
    diff = (out.float() - reference).abs().max().item()
    us = triton.testing.do_bench(launch, warmup=20, rep=200) * 1000
    row = dict(case=label, cache=cache, keys_from="cudnn, one batched call", us=round(us, 1),
               tflops=round(visible_flops(seqs) / us / 1e6, 1), largest_difference=round(diff, 4))
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="Write the rows as JSON here.")
    parser.add_argument("--long", action="store_true", help="Add P2's cases (32,000 tokens).")
    parser.add_argument("--sdpa", default="", help="torch backends to time beside the kernel, "
                        "comma-separated (cudnn, flash, efficient).")
    args = parser.parse_args()
    backends = [b for b in args.sdpa.split(",") if b]
    rows = []
    for label, seqs in CASES + (LONG_CASES if args.long else ()):
        for cache in ("bf16", "fp8"):
            shape = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                         block_size=PAGE, seed=1)
            step = (make_fp8_step(seqs, k_scale=1.0, v_scale=1.0, dtype=torch.bfloat16, **shape)
                    if cache == "fp8" else make_step(seqs, dtype=torch.bfloat16, **shape))
            md = step.metadata
            plan = plan_context_rows(md.query_start_loc_cpu, md.seq_lens_cpu,
                                     md.num_actual_tokens, step.query.device)
            new_kv = torch.empty((2, plan.rows_needed if plan else md.num_actual_tokens,
                                  *step.key.shape[1:]), device=step.key.device,
                                 dtype=products_dtype(step.query.dtype, step.kv_cache.dtype))
            write_kv_cache(step.key, step.value, *paged_kv_views(step.kv_cache), md.slot_mapping,
                           fresh=new_kv)
            outs = {}
            for source in ("pages", "rows", "rows and context rows")[:3 if plan else 2]:
                out = torch.zeros_like(step.query)

                def launch(out=out, source=source) -> None:
                    context = plan if source == "rows and context rows" else None
                    if context is not None:
                        widen_context_rows(*paged_kv_views(step.kv_cache), md.block_tables,
                                           context, new_kv)
                    paged_prefill_attention(
                        step.query, *paged_kv_views(step.kv_cache), *batch_args(step), out,
                        num_tokens=md.num_actual_tokens, max_query_len=md.max_query_len,
                        scale=HEAD_DIM ** -0.5, new_kv=None if source == "pages" else new_kv,
                        context_rows=None if context is None else context.starts)

                launch()
                torch.cuda.synchronize()
                outs[source] = out.float()
                us = triton.testing.do_bench(launch, warmup=50, rep=300) * 1000
                row = dict(case=label, cache=cache, keys_from=source, us=round(us, 1),
                           tflops=round(visible_flops(seqs) / us / 1e6, 1))
                rows.append(row)
                print(row, flush=True)
            for source in list(outs)[1:]:
                diff = (outs[source] - outs["pages"]).abs().max().item()
                print(f"  {source}: largest difference {diff:.3g}", flush=True)
            lengths = {n for c, n in seqs}
            if "cudnn" in backends and len(seqs) > 1 and len(lengths) == 1 and not any(
                    c for c, _ in seqs):
                rows.append(batched_fresh_row(label, cache, seqs, outs["pages"], step.query,
                                              new_kv[0, :md.num_actual_tokens],
                                              new_kv[1, :md.num_actual_tokens]))
            if backends and cache == "bf16" and len(seqs) == 1:
                keys, values = (torch.cat([new_kv[i, md.num_actual_tokens:],
                                           new_kv[i, :md.num_actual_tokens]])
                                if plan else new_kv[i] for i in (0, 1))
                rows += sdpa_rows(label, seqs, backends, outs["pages"], step.query, keys, values)
            del step, new_kv, outs
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
