"""Speculative decoding on a device: the tokens equal those without speculation.

The bundled demo model decodes the same prompts (text windows of ``--prompt-files``, or
random tokens) greedily without speculation, with its draft (``pagedllm-demo-draft``) and
with n-gram lookup, one request at a time and all together (on CUDA, verification steps
replay the captured verify graphs, padded to a captured batch size, and the draft's
catch-up its own); every speculative output must equal the plain one. A seeded sampled request must also
reproduce its tokens, alone and in a batch. Exits 1 on a difference.

    python scripts/spec_decode_check.py --device cuda --prompt-files held_out/*.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.common import synthetic_requests, text_prompts

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None)
    parser.add_argument("--prompt-files", nargs="*", default=None)
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    engine = dict(max_model_len=512, max_num_seqs=8, device=args.device)
    plain = LLM(**engine)
    if args.prompt_files:
        tokenizer = plain.llm_engine.tokenizer
        streams = [tokenizer.encode(Path(f).read_text(errors="replace")) for f in args.prompt_files]
        prompts = text_prompts(streams, args.num_prompts, 96, seed=0)
    else:
        prompts = [r.prompt_token_ids for r in synthetic_requests(
            args.num_prompts, (32, 96), (1, 1), plain.llm_engine.config.model_config.vocab_size)]
    requests = [{"prompt_token_ids": p} for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=48, ignore_eos=True)

    def tokens(llm, batch):
        return [o.outputs[0].token_ids for o in llm.generate(batch, greedy, use_tqdm=False)]

    want = tokens(plain, requests)
    failures = []
    for name, spec in (("draft", dict(speculative_model="pagedllm-demo-draft")),
                       ("ngram", dict(speculative_method="ngram"))):
        llm = LLM(**engine, num_speculative_tokens=args.k, **spec)
        one_by_one = [tokens(llm, [r])[0] for r in requests]
        together = tokens(llm, requests)
        stats = llm.llm_engine.engine_core.scheduler.spec_decoding_stats
        ok = one_by_one == want and together == want
        print(f"{name}: greedy equal alone {one_by_one == want}, in a batch {together == want}; "
              f"acceptance {stats.acceptance_rate:.3f}, mean accepted length "
              f"{stats.mean_accepted_length:.2f}", flush=True)
        alone = llm.generate(requests[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
        batched = llm.generate(requests, [seeded] + [greedy] * (len(requests) - 1),
                               use_tqdm=False)[0].outputs[0].token_ids
        print(f"{name}: seeded sample reproduced in a batch {alone == batched}", flush=True)
        if not ok or alone != batched:
            failures.append(name)
        del llm
    print("FAIL: " + ", ".join(failures) if failures else "PASS", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
