#!/usr/bin/env python3
"""Time prefill attention with the step's new keys read from the pages and from contiguous
rows (``paged_prefill_attention``'s ``new_kv``), and, where there is a cached context, with
that context widened into rows too (``widen_context_rows``, timed with the launch), over a
bf16 and an FP8 cache, on Llama-3.1-8B's attention shapes (32 query heads, 8 KV heads,
head_dim 128, pages of 16):

    python scripts/prefill_new_kv.py --out prefill_new_kv.json

Cases: four fresh prompts of 2,048 tokens (P1), one of 8,192, a chunk of 2,048 on 6,144
cached tokens, two chunks of 2,048 on 1,000. Each launch is checked against the other
(largest difference printed) and timed with ``triton.testing.do_bench``; TFLOP/s count the
causally visible keys. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

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


def visible_flops(seqs: tuple[tuple[int, int], ...]) -> float:
    """Both products' FLOPs over the keys each query sees (cached ones and its causal new ones)."""
    return sum(4 * n * (c + (n + 1) / 2) * HEAD_DIM * HEADS for c, n in seqs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="Write the rows as JSON here.")
    args = parser.parse_args()
    rows = []
    for label, seqs in CASES:
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
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
