"""The grammar interface the engine calls; a backend (llguidance today) implements it.

A backend turns a request's ``StructuredOutputsParams`` into a compiled grammar, and each
request gets its own ``Grammar`` (a matcher's state) from it. The engine only ever:

- ``validate(params)`` at submission (no tokenizer needed; raises ``ValueError`` with the
  compiler's message),
- ``compile(params)`` in a worker thread, up to once per request that may run at the same
  time, per distinct constraint (``params.key``; see ``constraint_forms``),
- ``new_grammar(compiled)`` per request,
- ``Grammar.is_allowed(token)`` for a token sampled without a mask (check-then-mask: most
  samples are allowed, and checking one token costs microseconds where a mask costs the
  whole vocabulary), and ``Grammar.num_allowed(tokens)`` for proposed tokens (speculative
  decoding cuts a proposal at the first token the grammar refuses),
- ``fill_bitmasks([(grammar, row)], bitmask)`` for the constrained rows that need a mask:
  bit ``t`` of row ``r`` (word ``t // 32``, bit ``t % 32``, int32 words) says token ``t``
  is allowed,
- ``Grammar.accept_tokens`` / ``rollback`` / ``is_terminated`` as tokens are sampled, and
  ``accept_each([(grammar, token)])`` for a step's checked rows at once.

So another backend (xgrammar) plugs in here without the scheduler or the runner changing.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.structured.params import StructuredOutputsParams
from pagedllm.switches import choice, integer

# Threads filling token masks (``PAGEDLLM_GRAMMAR_FILL_THREADS``).
FILL_THREADS_ENV = "PAGEDLLM_GRAMMAR_FILL_THREADS"
# How a step's masks are shared among those threads (``PAGEDLLM_GRAMMAR_FILL``).
FILL_MODE_ENV = "PAGEDLLM_GRAMMAR_FILL"
# Times one constraint is compiled at most (``PAGEDLLM_GRAMMAR_FORMS``).
FORMS_ENV = "PAGEDLLM_GRAMMAR_FORMS"
# The cgroup (v2) CPU quota of the process: "QUOTA PERIOD" or "max PERIOD".
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, within its cgroup's CPU quota (a
    container's CPU limit), at least 1."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()
        if quota != "max":
            cpus = min(cpus, int(quota) // int(period))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota to read
    return max(1, cpus)


def fill_threads() -> int:
    """Threads a step's masks are filled on: ``PAGEDLLM_GRAMMAR_FILL_THREADS``, else 80% of
    the usable CPUs, 1 to 32 (llguidance's own default)."""
    threads = integer(FILL_THREADS_ENV, None, 1, 256)
    if threads is None:
        threads = min(32, max(1, usable_cpus() * 80 // 100))
    return threads


def fills_by_rows() -> bool:
    """Whether the fill threads take a step's rows one at a time from one queue, dearest at
    their last fill first (``PAGEDLLM_GRAMMAR_FILL=rows``), rather than as the backend's
    own parallel call deals them (``par``, the default, until timed on a many-CPU host)."""
    return choice(FILL_MODE_ENV, ("par", "rows"), "par") == "rows"


def constraint_forms(max_num_seqs: int) -> int:
    """Times the engine compiles one constraint at most, its requests taking the forms in
    turn: ``PAGEDLLM_GRAMMAR_FORMS``, else ``max_num_seqs`` (the requests a step may hold),
    so that the running requests of one schema hardly ever share a form (fewer where the
    first compile is slow: ``manager._Forms``).

    Grammars made from one compiled form wait for each other while their masks are filled
    (llguidance's copies of a matcher share its lexer, behind one lock), so rows of one
    schema fill in parallel only across forms; a compile costs about a millisecond of a
    compile thread, a form a megabyte or less of host memory as its lexer's states grow,
    and a fresh form's first masks more (its states are built as they are met; a later
    request taking a form finds them built)."""
    return integer(FORMS_ENV, None, 1, 1 << 16) or max_num_seqs


class Grammar(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over sampled tokens; False if one is not allowed (the grammar is then
        in an error state and terminated)."""

    @abstractmethod
    def is_allowed(self, token_id: int) -> bool:
        """Whether ``token_id`` may come next (the state does not change): the bit
        ``fill_bitmasks`` writes for it, while the grammar is not terminated."""

    @abstractmethod
    def num_allowed(self, token_ids: list[int]) -> int:
        """How many leading tokens of ``token_ids`` may come next, one after the other
        (the state does not change)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (possible in any state but an
        error: accept only allowed tokens before rolling back)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether no token but EOS can follow (the output is complete), or an error happened."""

    @property
    @abstractmethod
    def error(self) -> str | None:
        """Why the grammar stopped accepting, if it failed."""


class GrammarBackend(ABC):
    """Compiles constraints and fills token bitmasks for a vocabulary of ``vocab_size``."""

    vocab_size: int

    @staticmethod
    @abstractmethod
    def validate(params: StructuredOutputsParams) -> None:
        """Raise ``ValueError`` (the compiler's message) if the constraint cannot compile."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """A compiled form of ``params``, shared by requests with the same key."""

    @abstractmethod
    def new_grammar(self, compiled: Any) -> Grammar:
        """A fresh grammar state at the start of the output."""

    def accept_each(self, grammars: list[tuple[Grammar, int]]) -> list[bool]:
        """Each grammar takes its one token, as ``grammar.accept_tokens([token])`` does;
        the answers in order. A backend may take them in parallel."""
        return [grammar.accept_tokens([token]) for grammar, token in grammars]

    @abstractmethod
    def fill_bitmasks(self, grammars: list[tuple[Grammar, int]], bitmask: np.ndarray) -> None:
        """Write each grammar's allowed next tokens into its row of ``bitmask``
        (int32 ``[rows, ceil(vocab_size / 32)]``); other rows are left as they are."""
