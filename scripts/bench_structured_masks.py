"""Time the host's work for a step of constrained rows, both ways, on the same grammar states:
a token mask for every row (masking first), against checking each row's sampled token and
masking only the refused ones (check-then-mask, what the engine does).

The rows follow the JSON schemas of ``bench throughput --structured-output json``
(``structured_workload.py``, row ``i`` takes schema ``i % 4``), and the "model" samples
uniformly over the vocabulary, as random weights nearly do: a refused token is replaced by
one drawn uniformly from the allowed ones, which is the masked distribution. The two ways
alternate step by step, so a busy machine slows both alike.

Usage: python scripts/bench_structured_masks.py --tokenizer DIR [--rows 128] [--steps 40]
(DIR from ``python -m pagedllm.benchmarks.bench_tokenizer``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.benchmarks.structured_workload import constraint_for  # noqa: E402
from pagedllm.engine.tokenizer import Tokenizer  # noqa: E402
from pagedllm.structured.llguidance_backend import LLGuidanceBackend  # noqa: E402
from pagedllm.structured.manager import StructuredOutputManager  # noqa: E402


def attached(manager: StructuredOutputManager, rows: int) -> list:
    """Compiled grammars for ``rows`` rows, row ``i`` with schema ``i % 4``. Each way gets
    its own: a matcher keeps its last mask, so a way that shared the other's would find
    the states' masks already computed."""
    requests = [SimpleNamespace(sampling_params=SimpleNamespace(structured_outputs=constraint_for(i)))
                for i in range(rows)]
    for request in requests:
        manager.attach(request)
    while not all(request.grammar.ready for request in requests):
        time.sleep(0.01)
    return [request.grammar for request in requests]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_pretrained(args.tokenizer)
    backend = LLGuidanceBackend(tokenizer, len(tokenizer))
    manager = StructuredOutputManager(lambda: backend)
    masking, checking = (attached(manager, args.rows) for _ in range(2))
    vocab, width = backend.vocab_size, manager.bitmask_width
    rng = np.random.default_rng(args.seed)
    masks = np.empty((args.rows, width), dtype=np.int32)
    full_ms, check_ms, refused_rows = [], [], 0
    for _ in range(args.steps):
        start = time.perf_counter()
        manager.fill_bitmask(masking, masks)
        full_ms.append(1e3 * (time.perf_counter() - start))
        tokens = [int(t) for t in rng.integers(0, vocab, args.rows)]
        start = time.perf_counter()
        refused, bitmask = manager.check_tokens(
            checking, tokens, lambda rows, words: np.empty((rows, words), dtype=np.int32))
        check_ms.append(1e3 * (time.perf_counter() - start))
        refused_rows += len(refused)
        for k, i in enumerate(refused):
            allowed = np.flatnonzero(np.unpackbits(bitmask[k].view(np.uint8), bitorder="little")[:vocab])
            tokens[i] = int(rng.choice(allowed))
        for grammars in (masking, checking):
            for grammar, token in zip(grammars, tokens):
                grammar.accept_token(token)
                assert grammar.error is None, grammar.error
    print(f"{args.rows} rows, {args.steps} steps, vocabulary {vocab}: "
          f"{100 * refused_rows / (args.rows * args.steps):.1f}% of sampled tokens refused")
    for name, times in (("mask every row", full_ms), ("check, mask the refused", check_ms)):
        print(f"{name:>24}: median {statistics.median(times):7.2f} ms/step, "
              f"mean {statistics.mean(times):7.2f} ms/step, "
              f"{1e3 * statistics.mean(times) / args.rows:6.1f} us/row")
    manager.shutdown()


if __name__ == "__main__":
    main()
