"""Held-out perplexity of the demo model through pagedllm, per engine configuration
(KV-cache dtype, weight quantization).

What an engine option costs in accuracy, measured on the text docs/demo_model.md reports
its numbers on: the standard library's held-out "test" files (``demo_model_data.split_of``),
each encoded as ``<|bos|> ids <|end|>``, concatenated and cut into non-overlapping
512-token windows plus the tail, as ``train_demo_model.mean_nll`` cuts them (the first
token of a window is context only). Each window is one prompt; the NLL of its tokens comes
from the engine's prompt logprobs, in nats per predicted token; perplexity is ``exp(NLL)``.

    python scripts/demo_model_perplexity.py            # the four runs below, all windows
    python scripts/demo_model_perplexity.py --max-windows 16 --config "" \
        --config quantization=fp8 --output-json ppl.json

Each ``--config`` (engine keywords of ``LLM``, ``KEY=VALUE`` separated by commas; empty:
the defaults) runs the same windows; the report gives each one's change of perplexity
relative to the first. The default runs: the model's dtype, ``kv_cache_dtype=fp8``,
``quantization=fp8`` (W8A8) and both. Runs on the CPU in float32 unless ``--device`` says
otherwise; the figures depend on the standard library the running Python ships.

Prompt logprobs come from prompt steps, whose attention is the prefill kernel's. To score
the decode kernel instead, cut each window into one-token chunks:
``--config kv_cache_dtype=fp8,max_num_batched_tokens=1,max_num_seqs=1`` (a step of one
query row goes to the decode kernel; one forward pass a token, so use ``--max-windows``).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_model_data import BOS_TOKEN, EOS_TOKEN, load_stdlib_corpus  # noqa: E402
from train_demo_model import _encode_docs  # noqa: E402

SEQ_LEN = 512


def held_out_windows(seq_len: int = SEQ_LEN, max_windows: int | None = None,
                     stdlib: str | None = None) -> list[list[int]]:
    """Token ids of the held-out test text in windows of ``seq_len`` (the last may be
    shorter, at least 2 tokens); the first ``max_windows`` when given."""
    from tokenizers import Tokenizer

    from pagedllm.config import resolve_model_path

    tokenizer = Tokenizer.from_file(str(resolve_model_path("pagedllm-demo") / "tokenizer.json"))
    bos, eos = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    corpus = load_stdlib_corpus(stdlib)
    stream = [t for doc in _encode_docs(tokenizer, [f.text for f in corpus.test], bos, eos)
              for t in doc]
    windows = [stream[i:i + seq_len] for i in range(0, len(stream) - 1, seq_len)]
    if len(windows[-1]) < 2:
        windows.pop()
    return windows[:max_windows]


def mean_nll(windows: list[list[int]], **engine_args) -> float:
    """Mean NLL (nats per predicted token) of ``windows`` under the demo model (or the
    ``model`` keyword's checkpoint of it, e.g. a quantized one), run by an engine of
    ``engine_args`` (keywords of ``LLM``)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(**{"model": "pagedllm-demo", "enable_prefix_caching": False, **engine_args})
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    total, count = 0.0, 0
    for window, output in zip(windows, outputs):
        for token, entry in zip(window[1:], output.prompt_logprobs[1:]):
            total -= entry[token].logprob
        count += len(window) - 1
    return total / count


DEFAULT_CONFIGS = ["", "kv_cache_dtype=fp8", "quantization=fp8",
                   "quantization=fp8,kv_cache_dtype=fp8"]


def parse_config(text: str) -> dict[str, Any]:
    """``"quantization=fp8,max_num_batched_tokens=1"`` -> engine keywords (Python literals,
    such as numbers and ``True``, as such; anything else as a string)."""
    pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
    if any(len(pair) != 2 for pair in pairs):
        raise SystemExit(f"--config {text!r}: give KEY=VALUE pairs separated by commas.")
    return {key.strip(): _literal(value.strip()) for key, value in pairs}


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", default=None,
                        help="Engine keywords of one run, KEY=VALUE[,KEY=VALUE] (repeat; the "
                             "first is the baseline).")
    parser.add_argument("--max-windows", type=int, default=None,
                        help="Score only the first N windows (default: all).")
    parser.add_argument("--stdlib", default=None,
                        help="The standard library to read (default: the running Python's).")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", help="The model's dtype.")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)

    windows = held_out_windows(max_windows=args.max_windows, stdlib=args.stdlib)
    tokens = sum(len(w) - 1 for w in windows)
    print(f"{len(windows)} windows, {tokens} predicted tokens", flush=True)
    runs = []
    configs = args.config if args.config is not None else DEFAULT_CONFIGS
    for config in configs:
        start = time.perf_counter()
        engine_args = parse_config(config)
        nll = mean_nll(windows, device=args.device, dtype=args.dtype,
                       max_model_len=SEQ_LEN + 1, **engine_args)
        run = {"config": engine_args, "nll": round(nll, 5),
               "perplexity": round(math.exp(nll), 4),
               "seconds": round(time.perf_counter() - start, 1)}
        if runs:
            base = runs[0]["perplexity"]
            run["perplexity_change"] = round(run["perplexity"] / base - 1.0, 5)
        runs.append(run)
        print(json.dumps(run), flush=True)
    result = {"model": "pagedllm-demo", "windows": len(windows), "predicted_tokens": tokens,
              "device": args.device, "dtype": args.dtype, "python": sys.version.split()[0],
              "runs": runs}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
