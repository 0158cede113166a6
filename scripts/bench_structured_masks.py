"""Time the host's work for a step of constrained rows, three ways, on the same grammar
states: a token mask for every row (masking first); checking each row's sampled token and
masking only the refused ones (check-then-mask); and the same where a refused row first
tries the next tokens of its draw's ranking, masked only when it allows none of them (what
the engine does, ``PAGEDLLM_CHECK_CANDIDATES``).

A fourth set of grammars in the same states fills its masks one row at a time on this
thread, timed row by row, which splits the first way's time into what the rows cost and
how well the fill threads share them: per step the rows' sum, the dearest row (no number
of threads fills the step faster), and the step's length if the rows were dealt to the fill
threads in order, each to the first thread free (``dealt``), or dearest first
(``dearest first``). A fill slower than ``dealt`` loses time to the threads themselves
(contention, memory, or how the rows are shared among them: ``PAGEDLLM_GRAMMAR_FILL=par``,
llguidance's parallel call, or ``rows``, one queue; ``backend.fills_by_rows``), not to the
rows.

The rows follow the JSON schemas of ``bench throughput --structured-output json``
(``structured_workload.py``, row ``i`` takes schema ``i % 4``), and the "model" samples
uniformly over the vocabulary, as random weights nearly do: each row's ranking is a random
order of the vocabulary, and its token the first one the row's mask allows (the masked
distribution). The ways alternate step by step, so a busy machine slows them alike.

Usage: python scripts/bench_structured_masks.py --tokenizer DIR [--rows 128] [--steps 40]
    [--candidates 8] [--forms N]
(DIR from ``python -m pagedllm.benchmarks.bench_tokenizer``).
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.benchmarks.structured_workload import constraint_for  # noqa: E402
from pagedllm.engine.tokenizer import Tokenizer  # noqa: E402
from pagedllm.structured.backend import constraint_forms, fill_threads, fills_by_rows  # noqa: E402
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
    while not all([request.grammar.ready for request in requests]):  # each begins its form
        time.sleep(0.01)
    return [request.grammar for request in requests]


def makespan(costs: list[float], threads: int) -> float:
    """How long ``threads`` workers take over jobs of ``costs``, each job in the order given
    going to the first worker free."""
    free = [0.0] * threads
    for cost in costs:
        heapq.heapreplace(free, free[0] + cost)
    return max(free)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--candidates", type=int, default=8,
                        help="tokens of each draw's ranking a refused row may take")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--forms", type=int, default=None,
                        help="times each schema is compiled at most (default: the engine's "
                             "rule, PAGEDLLM_GRAMMAR_FORMS or one per row)")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_pretrained(args.tokenizer)
    backend = LLGuidanceBackend(tokenizer, len(tokenizer))
    manager = StructuredOutputManager(
        lambda: backend, forms_per_constraint=args.forms or constraint_forms(args.rows))
    masking, checking, ranking, alone = (attached(manager, args.rows) for _ in range(4))
    vocab, width = backend.vocab_size, manager.bitmask_width
    rng = np.random.default_rng(args.seed)
    masks = np.empty((args.rows, width), dtype=np.int32)

    def allocate(rows: int, words: int) -> np.ndarray:
        return np.empty((rows, words), dtype=np.int32)

    times: dict[str, list[float]] = {"mask every row": [], "check, mask the refused": [],
                                      "check, candidates, mask the rest": []}
    critical: dict[str, list[float]] = {"rows' sum": [], "dearest row": [], "dealt": [],
                                        "dearest first": []}
    threads = fill_threads()
    refused_rows = still_refused = 0
    for _ in range(args.steps):
        start = time.perf_counter()
        manager.fill_bitmask(masking, masks)
        times["mask every row"].append(1e3 * (time.perf_counter() - start))
        costs = []
        for row, grammar in enumerate(alone):
            if grammar.active:
                start = time.perf_counter()
                backend.fill_bitmasks([(grammar.grammar, 0)], masks[row:row + 1])
                costs.append(1e3 * (time.perf_counter() - start))
        for name, ms in zip(critical, (sum(costs), max(costs, default=0.0),
                                       makespan(costs, threads),
                                       makespan(sorted(costs, reverse=True), threads))):
            critical[name].append(ms)
        # A uniform model's ranking of a row: a random order of the vocabulary, of which
        # the first few; the row's token is the first one its mask allows.
        ranked = [[int(t) for t in rng.choice(vocab, args.candidates, replace=False)]
                  for _ in range(args.rows)]
        tokens = []
        for row, candidates in zip(masks, ranked):
            allowed = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
            taken = next((t for t in candidates if allowed[t]), None)
            tokens.append(taken if taken is not None else int(rng.choice(np.flatnonzero(allowed))))
        first = [candidates[0] for candidates in ranked]
        start = time.perf_counter()
        refused, _, _ = manager.check_tokens(checking, first, allocate)
        times["check, mask the refused"].append(1e3 * (time.perf_counter() - start))
        start = time.perf_counter()
        remaining, _, _ = manager.check_tokens(ranking, first, allocate, lambda: ranked)
        times["check, candidates, mask the rest"].append(1e3 * (time.perf_counter() - start))
        refused_rows += len(refused)
        still_refused += len(remaining)
        for grammars in (masking, checking, ranking, alone):
            for grammar, token in zip(grammars, tokens):
                grammar.accept_token(token)
                assert grammar.error is None, grammar.error
    print(f"{args.rows} rows, {args.steps} steps, vocabulary {vocab}, "
          f"{manager.num_forms} forms, {fill_threads()} fill threads "
          f"({'rows from one queue' if fills_by_rows() else 'parallel call'}): "
          f"{100 * refused_rows / (args.rows * args.steps):.1f}% of sampled tokens refused, "
          f"{100 * still_refused / (args.rows * args.steps):.1f}% refused all of the first "
          f"{args.candidates} of their ranking")
    for name, ms in times.items():
        print(f"{name:>32}: median {statistics.median(ms):7.2f} ms/step, "
              f"mean {statistics.mean(ms):7.2f} ms/step, "
              f"{1e3 * statistics.mean(ms) / args.rows:6.1f} us/row")
    print(f"each row alone, one thread; the step's fill on {threads} threads at best:")
    for name, ms in critical.items():
        print(f"{name:>32}: median {statistics.median(ms):7.2f} ms/step, "
              f"mean {statistics.mean(ms):7.2f} ms/step")
    manager.shutdown()


if __name__ == "__main__":
    main()
