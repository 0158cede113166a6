"""Time the host's work for a step of constrained rows, three ways, on the same grammar
states: a token mask for every row (masking first); checking each row's sampled token and
masking the refused ones (check-then-mask); and the same, where a refused row first checks
its next best candidates by draw score and needs no mask when one is allowed (what the
engine does; ``--candidates K``, the runner's ``check_candidates()``).

The rows follow the JSON schemas of ``bench throughput --structured-output json``
(``structured_workload.py``, row ``i`` takes schema ``i % 4``), and the "model" samples
uniformly over the vocabulary, as random weights nearly do (so a row's best candidates are
uniform too): a refused token is replaced by one drawn uniformly from the allowed ones,
which is the masked distribution. The ways alternate step by step, so a busy machine slows
all alike.

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
from pagedllm.worker.model_runner import check_candidates  # noqa: E402


def attached(manager: StructuredOutputManager, rows: int) -> list:
    """Compiled grammars for ``rows`` rows, row ``i`` with schema ``i % 4``; each call gives
    fresh matchers (a matcher keeps its last mask: the ways must not share one)."""
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
    parser.add_argument("--candidates", type=int, default=check_candidates())
    args = parser.parse_args()
    tokenizer = Tokenizer.from_pretrained(args.tokenizer)
    backend = LLGuidanceBackend(tokenizer, len(tokenizer))
    manager = StructuredOutputManager(lambda: backend)
    ways = [attached(manager, args.rows) for _ in range(3)]  # one grammar per row and way
    vocab, width = backend.vocab_size, manager.bitmask_width
    rng = np.random.default_rng(args.seed)
    masks = np.empty((args.rows, width), dtype=np.int32)
    full_ms, check_ms, candidates_ms, refused_rows = [], [], [], 0
    settled_before = manager.num_settled_rows

    def candidates(tokens: list[int]):
        """Each row's sampled token, then uniform others, with descending scores (drawn
        before the clock starts; the lookup picks the refused rows')."""
        others = rng.integers(0, vocab, (len(tokens), args.candidates - 1)).tolist()
        ids = [[token, *rest] for token, rest in zip(tokens, others)]
        scores = np.sort(rng.random((len(tokens), args.candidates)))[:, ::-1].tolist()
        return lambda refused: ([ids[i] for i in refused], [scores[i] for i in refused])

    def allocate(rows: int, words: int) -> np.ndarray:
        return np.empty((rows, words), dtype=np.int32)
    for _ in range(args.steps):
        start = time.perf_counter()
        manager.fill_bitmask(ways[0], masks)
        full_ms.append(1e3 * (time.perf_counter() - start))
        tokens = [int(t) for t in rng.integers(0, vocab, args.rows)]
        start = time.perf_counter()
        refused, bitmask = manager.check_tokens(ways[1], tokens, allocate)
        check_ms.append(1e3 * (time.perf_counter() - start))
        lookup = candidates(tokens)
        start = time.perf_counter()
        manager.check_tokens(ways[2], tokens, allocate, lookup)
        candidates_ms.append(1e3 * (time.perf_counter() - start))
        refused_rows += len(refused)
        for k, i in enumerate(refused):
            allowed = np.flatnonzero(np.unpackbits(bitmask[k].view(np.uint8), bitorder="little")[:vocab])
            tokens[i] = int(rng.choice(allowed))
        for grammars in ways:
            for grammar, token in zip(grammars, tokens):
                grammar.accept_token(token)
                assert grammar.error is None, grammar.error
    print(f"{args.rows} rows, {args.steps} steps, vocabulary {vocab}: "
          f"{100 * refused_rows / (args.rows * args.steps):.1f}% of sampled tokens refused, "
          f"{100 * (manager.num_settled_rows - settled_before) / max(refused_rows, 1):.1f}% of "
          f"those settled by {args.candidates} candidates")
    for name, times in (("mask every row", full_ms), ("check, mask the refused", check_ms),
                        ("check, candidates, mask", candidates_ms)):
        print(f"{name:>24}: median {statistics.median(times):7.2f} ms/step, "
              f"mean {statistics.mean(times):7.2f} ms/step, "
              f"{1e3 * statistics.mean(times) / args.rows:6.1f} us/row")
    manager.shutdown()


if __name__ == "__main__":
    main()
