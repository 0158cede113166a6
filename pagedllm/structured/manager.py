"""Structured outputs in the engine core: compiling constraints off the step loop, one grammar
per request, and a step's token bitmask.

Lifecycle of a constrained request::

    EngineCore.add_request ──> attach(): request.grammar = RequestGrammar(its form to come)
    scheduler: WAITING_FOR_GRAMMAR until request.grammar.ready, then WAITING as usual
    each step, per constrained row (``StepGrammars``, the runner's questions):
      check-then-mask: the runner samples the row unmasked; check_tokens(rows, sampled)
          asks the grammar whether the token is allowed, and fills a bitmask only for
          the rows it refuses, which the runner draws again under their mask
      mask first (rows with logprobs, top-k, top-p or min-p): fill_bitmask(rows) ──>
          the runner masks those rows' logits, then samples
      masks ahead (a GPU with a step in flight: every row, nothing checked):
          masks_ahead(rows) gives the masks filled while the device computed the step;
          the runner samples under them just before the next launch, and after it
          take_sampled(rows, tokens): the grammars take them and fill the next masks
      speculating: the scheduler cuts the proposals at the first token the grammar
          refuses (num_allowed); fill_verify_bitmask gives each verification row the
          state after the proposals before it, and the rejection sampler judges the
          masked distributions
    scheduler.update_from_output: request.grammar.accept_token(token) for each token
    request.grammar.is_terminated() ──> the request finishes with "stop"

Both ways sample the masked distribution: a row's first draw is kept when its grammar
allows it, and a refused one is drawn again under the mask with the same noise, so the
token is the one masking first would give (see ``pagedllm.layers.sampler.Sampler.redraw``).
Checking a token costs microseconds, a mask the whole vocabulary. Where the grammar forces
text, llguidance's mask allows the first token of that text's canonical tokenization alone
(``"ag"`` of a forced key ``"age"``, not ``"a"``), and so does its check
(``LLGuidanceGrammar.is_allowed``).

Compilation runs in a thread pool (llguidance releases the GIL), so a slow constraint never
stalls the step loop; compiled constraints are cached by ``StructuredOutputsParams.key``
(least recently used first out, ``COMPILE_CACHE_SIZE`` forms in all, at least two
constraints' worth), each in up to ``forms_per_constraint`` forms compiled independently
and handed to its requests in turn, fewer where compiling is dear: grammars made from one
form wait for each other while masks are filled (``_Forms``; the engine's count:
``constraint_forms``).
Masks for a step's rows are filled by the backend's own threads. The backend itself is
built on the first constrained request, so an engine that never sees one pays nothing.

A grammar's state follows the request's output tokens, which survive preemption, so a
recomputed request continues where its grammar was.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Callable

import numpy as np

from pagedllm.structured.backend import Grammar, GrammarBackend
from pagedllm.structured.params import StructuredOutputsParams
from pagedllm.switches import switch

logger = logging.getLogger(__name__)

# Compiled forms of constraints kept for reuse (a constraint may hold several: ``_Forms``).
COMPILE_CACHE_SIZE = 512
# Compile-thread seconds a constraint's forms may take in all, by the first one's (``_Forms``).
COMPILE_BUDGET_S = 0.5
# Bitmask fill calls whose timing is kept (for benchmarks; a bounded window).
FILL_CALLS_KEPT = 1 << 16


class RequestGrammar:
    """A request's grammar as the core sees it: ``ready`` once compiled, then it accepts the
    request's output tokens one by one.

    With ``reasoning_end_token_ids`` the constraint starts after the output has produced
    that token sequence; tokens before it (and the sequence itself) are free.

    Speculative decoding looks ahead without committing: ``num_allowed`` counts the
    proposals the constraint allows in a row, and ``checkpoint`` / ``restore`` bracket
    accepting proposals (allowed ones only) to read the states after them.

    The token a check settled on (``checked_token``: the sampled one it allowed, or the
    one its redraw gave) may be taken ahead of the scheduler (``take_early``, every checked
    row in one backend call, while the step after runs; a refused row's next mask can then
    be filled); the scheduler's ``accept_token`` of that same token then finds it taken.
    Whether the output is complete is kept from the last token taken, so asking it never
    waits for a fill in flight.
    """

    __slots__ = ("_form", "_backend", "grammar", "error", "_gate", "_recent", "_num_taken",
                 "version", "_settle", "_stopped", "checked_token", "_early")

    def __init__(self, form: Callable[[], Future | None], backend: Callable[[], GrammarBackend],
                 reasoning_end_token_ids: list[int] | None,
                 settle: Callable[[RequestGrammar], None] = lambda grammar: None) -> None:
        """``form()`` is the compile of the request's form, or None while the constraint's
        forms are not handed out yet (``_Forms.form``). ``settle(self)`` runs before every
        use of the matcher: it waits for a fill another thread may be running on it
        (``MaskPrefetch.settle_for``)."""
        self._form = form
        self._backend = backend
        self.grammar: Grammar | None = None
        self.error: str | None = None
        self._gate = list(reasoning_end_token_ids or [])
        self._recent: list[int] = []
        self._num_taken = 0  # tokens the grammar has accepted
        self.version = 0  # changes whenever the state does
        self._settle = settle
        self._stopped = False  # the grammar's is_terminated() after the last token taken
        self.checked_token: int | None = None  # the last check's token, not yet taken
        self._early: int | None = None  # a token taken ahead of accept_token

    @property
    def ready(self) -> bool:
        """Compiled (or failed: ``error`` says why); the request may be scheduled."""
        if self.grammar is None and self.error is None:
            future = self._form()
            if future is None or not future.done():
                return False
            try:
                self.grammar = self._backend().new_grammar(future.result())
                self._stopped = self.grammar.is_terminated()
            except Exception as exc:  # noqa: BLE001 - a failed compile finishes the request
                self.error = str(exc)
        return True

    def wait(self, timeout_s: float = 60.0) -> None:
        """Block until ``ready`` (for tools and tests; the engine polls ``ready``)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            future = self._form()
            if future is not None:
                future.exception(timeout=max(0.0, deadline - time.monotonic()))
            elif time.monotonic() > deadline:
                raise TimeoutError("the constraint was not compiled in time")
            else:
                time.sleep(0.001)

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (compiled, past the reasoning, not done)."""
        return self.grammar is not None and not self._gate and not self._stopped

    def allows(self, token_id: int) -> bool:
        """Whether ``token_id`` may come next: any token while the constraint is not active
        (as its bitmask row then says), else the grammar's answer. The state does not change."""
        if not self.active:
            return True
        self._settle(self)
        return self.grammar.is_allowed(token_id)

    def num_allowed(self, token_ids: list[int]) -> int:
        """How many leading tokens of ``token_ids`` may come next one after the other: the
        reasoning before the constraint takes any, then the grammar decides (none after the
        output is complete). The state does not change."""
        if self.error is not None:
            return 0
        free = 0  # tokens the reasoning takes
        if self._gate:
            recent, closed = self._recent, False
            while free < len(token_ids) and not closed:
                recent, closed = self._gate_step(recent, token_ids[free])
                free += 1
            if not closed:
                return len(token_ids)
        if self.grammar is None:
            return len(token_ids)
        self._settle(self)
        return free + self.grammar.num_allowed(token_ids[free:])

    @staticmethod
    def take_early(grammars: list[RequestGrammar], backend: GrammarBackend) -> None:
        """The ``grammars`` still active with a ``checked_token`` take it now, ahead of the
        scheduler's ``accept_token`` of it, in one ``backend.accept_each`` call. Their
        matchers must not be in use by a fill (settle it first)."""
        taking = [g for g in grammars if g.checked_token is not None and g.active]
        for grammar in taking:
            grammar._early, grammar.checked_token = grammar.checked_token, None
            grammar.version += 1
            grammar._num_taken += 1
        answers = backend.accept_each([(g.grammar, g._early) for g in taking])
        for grammar, allowed in zip(taking, answers, strict=True):
            grammar._took(grammar._early, allowed)

    def accept_token(self, token_id: int) -> None:
        self.checked_token = None
        if self._early is not None:
            early, self._early = self._early, None
            if early == token_id:
                return  # taken already
            logger.error("A grammar took token %d ahead, then was given %d: taking that one.",
                         early, token_id)
            self._settle(self)
            self.grammar.rollback(1)
            self._num_taken -= 1
        self.version += 1
        if self._gate:
            self._recent, closed = self._gate_step(self._recent, token_id)
            if closed:
                self._gate = []
            return
        if self.grammar is None:
            return
        self._settle(self)
        self._num_taken += 1
        self._took(token_id, self.grammar.accept_tokens([token_id]))

    def _took(self, token_id: int, allowed: bool) -> None:
        """After the matcher's taking ``token_id``: an error if it refused, and whether the
        output is now complete."""
        if not allowed:
            self.error = self.grammar.error or f"token {token_id} is not allowed"
            logger.error("A constrained request sampled a token its grammar refuses: %s",
                         self.error)
        self._stopped = self.grammar.is_terminated()

    def _gate_step(self, recent: list[int], token_id: int) -> tuple[list[int], bool]:
        """The reasoning's last tokens after ``token_id`` (a new list), and whether they
        end the reasoning."""
        keep = len(self._gate) - 1  # the last len(gate) tokens are all a match needs
        recent = [*(recent[-keep:] if keep else ()), token_id]
        return recent, recent == self._gate

    def checkpoint(self) -> tuple:
        """The state now, for ``restore`` after accepting tokens ``allows`` let through."""
        return self._gate, self._recent, self._num_taken

    def restore(self, checkpoint: tuple) -> None:
        """Back to the state ``checkpoint`` saw: the grammar rolls back what it took since."""
        gate, recent, num_taken = checkpoint
        self.version += 1
        if self._num_taken > num_taken:
            self._settle(self)
            self.grammar.rollback(self._num_taken - num_taken)
            self._stopped = self.grammar.is_terminated()
        self._gate, self._recent, self._num_taken = gate, recent, num_taken

    def is_terminated(self) -> bool:
        """The output is complete (nothing but EOS may follow), or the grammar failed."""
        if self.error is not None:
            return True
        return self.grammar is not None and not self._gate and self._stopped


PREFETCH_MASKS_ENV = "PAGEDLLM_PREFETCH_MASKS"


class _Ranked:
    """A check's ranked candidates (``check_tokens``), read on first need."""

    __slots__ = ("_read", "_rows")

    def __init__(self, read: Callable[[], list[list[int]]] | None) -> None:
        self._read, self._rows = read, None

    @property
    def read(self) -> bool:
        """Whether the candidates have been read."""
        return self._rows is not None

    def first_allowed(self, allows: Callable[[int], bool], i: int) -> int | None:
        """The first of row ``i``'s later candidates (after its sampled token) that
        ``allows`` passes, or None (no candidates, or none allowed before the ranking ends
        at -1)."""
        if self._read is None:
            return None
        if self._rows is None:
            self._rows = self._read()
        for token in self._rows[i][1:]:
            if token < 0:
                break
            if allows(token):
                return token
        return None


def prefetch_masks_wanted(device: str) -> bool:
    """``PAGEDLLM_PREFETCH_MASKS`` (``1`` or ``0``); unset: on where the model runs on a GPU
    (the worker fills while the device computes; on a CPU it would take cores from the
    forward pass)."""
    return switch(PREFETCH_MASKS_ENV, device == "cuda")


def masks_ahead_wanted(config) -> bool:
    """Whether the runner samples constrained rows under the masks filled ahead, nothing
    checked (``StepGrammars.defers_masks``): masks are filled ahead
    (``prefetch_masks_wanted``) and a step stays in flight (asynchronous scheduling, no
    speculation, no pipeline stages)."""
    return (prefetch_masks_wanted(config.device) and config.scheduler_config.async_scheduling
            and config.speculative_config is None
            and config.parallel_config.pipeline_parallel_size == 1)


def _run_start(values: np.ndarray) -> int | None:
    """The first of ``values`` when they are consecutive integers (``first, first + 1,
    ...``), else None (also for none)."""
    if not len(values):
        return None
    first = int(values[0])
    return first if np.array_equal(values, np.arange(first, first + len(values))) else None


class MaskPrefetch:
    """Bitmask rows filled ahead of a check, by a worker thread, while the device computes.

    Once a check's rows have taken their tokens, ``start`` fills the masks of their next
    states off the step loop's thread, while the device computes the step those tokens
    feed. At the next check a row filled here is checked against its mask (``allowed``, a
    bit test for all rows at once) and takes it as its mask if refused, when its grammar is
    the same object in the same state (``version``); other rows are checked by their
    grammars and filled as before. Every row is filled, not only the ones refused last: a
    refusal the step loop did not see coming otherwise waits for its whole mask (in a
    bounded JSON string, milliseconds), with the device idle. A matcher serves one call at
    a time, so every use of one first waits for the fill in flight if that fill holds it
    (``settle_for``, which each ``RequestGrammar`` calls), and reading the rows filled waits
    for it (``settle``). Counters: ``num_filled`` rows filled ahead, ``num_used`` of them
    taken as a refused row's mask, ``seconds`` the worker's fill time, ``start_delay`` the
    time from a fill's start to its worker taking it up (the worker needs the interpreter's
    lock to begin), ``wait_seconds`` the time the step loop waited in ``settle`` for fills
    still running; ``fills`` the latest fills one by one, as (seconds, rows, seconds
    waited for), whose spread a mean hides: a step waits for its own fill only.
    """

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-masks")
        self._future: Future | None = None
        self._rows: dict[int, tuple[int, int, RequestGrammar]] = {}  # id -> row, version, grammar
        self._own = np.empty((0, 0), dtype=np.int32)  # rows filled when no array is given
        self._buffer = self._own  # the rows of the fill started last
        self.num_filled = 0
        self.num_used = 0
        self.seconds = 0.0
        self.start_delay = 0.0
        self.wait_seconds = 0.0
        # Each fill settled: (its seconds, its rows, the seconds the step loop waited for it).
        self.fills: deque[tuple[float, int, float]] = deque(maxlen=FILL_CALLS_KEPT)

    def settle(self) -> None:
        """Wait for the fill in flight, if any (a failed fill leaves no rows)."""
        future, self._future = self._future, None
        if future is not None:
            begin, rows = time.perf_counter(), len(self._rows)
            try:
                delay, seconds = future.result()
                self.start_delay += delay
                self.seconds += seconds
            except Exception:  # noqa: BLE001 - the check fills the rows itself
                logger.exception("Filling masks ahead failed")
                self._rows = {}
                seconds = 0.0
            waited = time.perf_counter() - begin
            self.wait_seconds += waited
            self.fills.append((seconds, rows, waited))

    def settle_for(self, grammar: RequestGrammar) -> None:
        """Wait for the fill in flight if it holds ``grammar``'s matcher."""
        if self._future is not None and id(grammar) in self._rows:
            self.settle()

    def start(self, grammars: list[RequestGrammar],
              fill: Callable[[list[tuple], np.ndarray], None], width: int,
              allocate: Callable[[int, int], np.ndarray] | None = None) -> None:
        """Fill the masks of ``grammars`` (the active ones) in their present states, into
        ``allocate(rows, width)`` (C-contiguous int32) when given, else an array of its own."""
        self.settle()
        self._rows = {}
        live = [g for g in grammars if g.active]
        if not live:
            return
        if allocate is not None:
            self._buffer = allocate(len(live), width)
        else:
            own = self._own
            if own.shape[0] < len(live) or own.shape[1] != width:
                own = self._own = np.empty((max(len(live), 2 * own.shape[0]), width), np.int32)
            self._buffer = own
        for row, grammar in enumerate(live):
            self._rows[id(grammar)] = (row, grammar.version, grammar)
        rows = [(grammar.grammar, row) for row, grammar in enumerate(live)]
        buffer = self._buffer
        self.num_filled += len(rows)

        submitted = time.perf_counter()

        def run() -> tuple[float, float]:
            begin = time.perf_counter()
            fill(rows, buffer)
            return begin - submitted, time.perf_counter() - begin

        self._future = self._executor.submit(run)

    def holds(self, grammar: RequestGrammar) -> bool:
        """Whether the fill started last covers ``grammar`` (its matcher may be in use)."""
        return id(grammar) in self._rows

    def row(self, grammar: RequestGrammar) -> np.ndarray | None:
        """The row filled ahead for ``grammar`` in its present state, or None. Call after
        ``settle``."""
        index = self._index(grammar)
        return None if index < 0 else self._buffer[index]

    def _index(self, grammar: RequestGrammar) -> int:
        """``grammar``'s row of the buffer, or -1 if none was filled for its present state."""
        entry = self._rows.get(id(grammar))
        if entry is None or entry[2] is not grammar or entry[1] != grammar.version:
            return -1
        return entry[0]

    def indices(self, grammars: list[RequestGrammar]) -> np.ndarray:
        """Each grammar's row of the buffer (int64), -1 where none was filled for its present
        state. Call after ``settle``."""
        return np.fromiter((self._index(g) for g in grammars), np.int64, len(grammars))

    def block(self, indices: np.ndarray) -> np.ndarray | None:
        """The buffer's rows ``indices`` (as ``indices`` gave them) as a view of the
        buffer, counted as used, when they are consecutive rows (a decode step of the same
        requests as the step before); else None."""
        first = _run_start(indices)
        if first is None or first < 0:
            return None
        self.num_used += len(indices)
        return self._buffer[first:first + len(indices)]

    def copy_rows(self, indices: np.ndarray, out: np.ndarray, out_rows: np.ndarray) -> None:
        """``out[out_rows] = `` the buffer's rows ``indices`` (as ``indices`` gave them): one
        block copy when both are runs of consecutive rows (a decode step of the same
        requests as the step before)."""
        n = len(indices)
        if not n:
            return
        first, start = _run_start(indices), _run_start(out_rows)
        if first is not None and start is not None:
            out[start:start + n] = self._buffer[first:first + n]
        else:
            out[out_rows] = self._buffer[indices]
        self.num_used += n

    def allowed(self, grammars: list[RequestGrammar], token_ids: list[int]) -> list[bool | None]:
        """Whether each grammar's row filled ahead allows its token: None where no row was
        filled for the grammar's present state. Call after ``settle``."""
        rows = self.indices(grammars)
        tokens = np.asarray(token_ids, dtype=np.int64)
        have = rows >= 0
        bits = np.zeros(len(grammars), dtype=bool)
        words = self._buffer[rows[have], tokens[have] >> 5]
        bits[have] = ((words >> (tokens[have] & 31).astype(np.int32)) & 1) == 1
        return [bool(b) if h else None for b, h in zip(bits.tolist(), have.tolist())]

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class _Forms:
    """One constraint's compiled forms, handed to its requests in turn (request ``n`` takes
    form ``n % count``), each compiled on first need. The requests of one form share its
    state where the backend shares it (llguidance: a matcher's copies lex under one lock),
    so a step's rows of one constraint fill their masks in parallel only across forms.

    The first form is compiled as the first request comes; how long that took decides
    ``count``: up to ``limit``, as many as ``COMPILE_BUDGET_S`` of compile time pays for (a
    schema compiled in a millisecond gets hundreds, one of 100 ms five), so a burst of
    requests never queues seconds of compiles. Requests learn their form once the first is
    compiled (they wait for that anyway); until then ``form`` answers None."""

    __slots__ = ("_compile", "_submit", "_futures", "_limit", "_count", "_taken",
                 "_on_new_form")

    def __init__(self, compile_form: Callable[[], Callable[[], object]],
                 submit: Callable[[Callable[[], object]], Future], limit: int,
                 on_new_form: Callable[[_Forms], None]) -> None:
        """``compile_form()`` readies the backend and returns the call that compiles one
        form (timed alone); ``submit`` runs a call on the compile threads;
        ``on_new_form(self)`` counts each form begun (the cache's size)."""
        self._compile = compile_form
        self._submit = submit
        self._limit = limit
        self._count: int | None = None  # set when the first form is compiled
        self._taken = 0
        self._on_new_form = on_new_form
        self._futures: dict[int, Future] = {}

    def __len__(self) -> int:
        """The forms compiled (or compiling)."""
        return len(self._futures)

    def _begin(self, first: bool = False) -> Future:
        def run() -> object:
            compile_one = self._compile()
            start = time.perf_counter()
            compiled = compile_one()
            if first:
                seconds = time.perf_counter() - start
                self._count = max(1, min(self._limit, int(COMPILE_BUDGET_S / max(seconds, 1e-6))))
            return compiled

        self._on_new_form(self)
        return self._submit(run)

    @property
    def failed(self) -> bool:
        """The first compile ended in an error (a new request compiles again)."""
        first = self._futures.get(0)
        return first is not None and first.done() and first.exception() is not None

    def take(self) -> Callable[[], Future | None]:
        """The next request's ticket: the call that gives its form's compile (``form``); the
        first request begins the first form."""
        if not self._futures:
            self._futures[0] = self._begin(first=True)
        ticket = self._taken
        self._taken += 1
        return lambda: self.form(ticket)

    def form(self, ticket: int) -> Future | None:
        """The compile of form ``ticket % count``, begun now if it is new; the first form's
        (done, or failed) while ``count`` is not known; None while the first compiles."""
        first = self._futures[0]
        if not first.done():
            return None
        if self._count is None:
            return first
        index = ticket % self._count
        future = self._futures.get(index)
        if future is None:
            future = self._futures[index] = self._begin()
        return future


class StructuredOutputManager:
    """Compiles constraints for the engine core and builds each step's bitmask.

    ``make_backend`` builds the backend (it loads a tokenizer: called once, lazily, in the
    compile thread). For benchmarks: ``mask_seconds`` adds up the host time spent on the
    constrained rows (checks and bitmasks), ``num_mask_steps`` the calls that checked or
    masked rows (one per step, two in a step that does both), ``num_checked_rows`` the
    sampled tokens checked (rows whose constraint is active: not a token sampled past the
    end of a complete output, as an asynchronous step samples one), ``num_refused_rows``
    those refused, ``num_substituted_rows`` those that took a later candidate of their draw
    instead (``check_tokens``), and ``num_mask_rows`` the bitmask rows filled on the step
    loop's thread;
    ``fill_calls`` the latest calls to the backend's bitmask fill, as (seconds, rows).
    ``forms_per_constraint``: how many times a constraint is compiled at most (``_Forms``).

    With ``prefetch_masks`` on (the model computes on a device while the step loop goes
    on), ``take_checked()``, once the step after a check is launched, gives every row the
    check saw its token in one backend call, and fills their next masks ahead of the next
    check (``MaskPrefetch``; its counters are ``prefetch``'s).
    """

    def __init__(self, make_backend: Callable[[], GrammarBackend], num_threads: int = 2,
                 prefetch_masks: bool = False, forms_per_constraint: int = 1) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=num_threads,
                                        thread_name_prefix="pagedllm-grammar")
        self._compiled: OrderedDict[tuple, _Forms] = OrderedDict()
        self._forms_per_constraint = forms_per_constraint
        self._cache_size = max(COMPILE_CACHE_SIZE, 2 * forms_per_constraint)
        self._num_forms = 0  # in the cache
        self.mask_seconds = 0.0
        self.num_mask_steps = 0
        self.num_mask_rows = 0
        self.num_checked_rows = 0
        self.num_refused_rows = 0
        self.num_substituted_rows = 0
        self.fill_calls: deque[tuple[float, int]] = deque(maxlen=FILL_CALLS_KEPT)
        self.prefetch_masks = prefetch_masks
        self.prefetch = MaskPrefetch()
        self._passed: list[RequestGrammar] = []  # the last check's rows it allowed
        self._refused: list[RequestGrammar] = []  # and those it refused

    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                start = time.perf_counter()
                self._backend = self._make_backend()
                logger.info("Structured-output backend ready in %.1f s (vocabulary of %d).",
                            time.perf_counter() - start, self._backend.vocab_size)
            return self._backend

    def attach(self, request) -> None:
        """Give a constrained ``Request`` its grammar; compilation starts now (or is shared)."""
        params: StructuredOutputsParams = request.sampling_params.structured_outputs
        key = params.key
        forms = self._compiled.get(key)
        if forms is not None and forms.failed:
            self._num_forms -= len(self._compiled.pop(key))
            forms = None
        if forms is None:
            forms = self._compiled[key] = _Forms(
                lambda: partial(self.backend().compile, params), self._pool.submit,
                self._forms_per_constraint, partial(self._count_form, key))
        self._compiled.move_to_end(key)
        form = forms.take()
        self._evict()
        request.grammar = RequestGrammar(form, self.backend, params.reasoning_end_token_ids,
                                         self.prefetch.settle_for)

    def _count_form(self, key: tuple, forms: _Forms) -> None:
        """A form of ``forms`` was begun: counted while the cache holds them."""
        if self._compiled.get(key) is forms:
            self._num_forms += 1

    def _evict(self) -> None:
        """Drop the least recently used constraints while the cache holds too many forms
        (their requests keep their own)."""
        while self._num_forms > self._cache_size and len(self._compiled) > 1:
            self._num_forms -= len(self._compiled.popitem(last=False)[1])

    @property
    def num_forms(self) -> int:
        """Compiled forms in the cache (a constraint may hold several: ``_Forms``)."""
        return self._num_forms

    @property
    def bitmask_width(self) -> int:
        """Int32 words per bitmask row: ceil(vocabulary / 32)."""
        return (self.backend().vocab_size + 31) // 32

    def fill_bitmask(self, grammars: list[RequestGrammar | None], out: np.ndarray) -> None:
        """Write the allowed next tokens of a step's constrained rows into ``out`` (int32,
        C-contiguous, ``[len(grammars), bitmask_width]``): bit ``t % 32`` of word ``t // 32``
        for token ``t``. A row whose grammar is not active (a ``None`` entry is a request
        gone since the step was planned) allows everything."""
        start = time.perf_counter()
        self.prefetch.settle()
        self._fill(grammars, out)
        self.mask_seconds += time.perf_counter() - start
        self.num_mask_steps += 1

    def check_tokens(self, grammars: list[RequestGrammar | None], token_ids: list[int],
                     allocate: Callable[[int, int], np.ndarray],
                     candidates: Callable[[], list[list[int]]] | None = None
                     ) -> tuple[list[int], np.ndarray | None, list[tuple[int, int]]]:
        """Check-then-mask: the indices of the sampled ``token_ids`` their ``grammars``
        refuse, those rows' bitmask (``allocate(len(refused), bitmask_width)``, filled as
        ``fill_bitmask`` does; None when nothing is refused), and the rows that take
        another token instead, as ``(index, token)``. ``candidates()`` (optional, called
        at most once, when a sampled token is refused): row ``i``'s tokens in the order its
        draw ranked them (``Sampler.candidates``: the sampled one first, -1 where the
        ranking ends); a row whose sampled token is refused takes the first of them its
        grammar allows, which is the token its mask's redraw would give, and is refused
        only when it allows none. A grammar that is not active (or ``None``) allows any
        token. The grammars have not taken the tokens."""
        start = time.perf_counter()
        if len(grammars) != len(token_ids):
            raise ValueError(f"{len(grammars)} grammars for {len(token_ids)} sampled tokens.")
        checked = [i for i, grammar in enumerate(grammars) if grammar is not None and grammar.active]
        prefetch = self.prefetch
        # Rows outside the fill in flight are checked while it runs; the rest after it,
        # from the rows it filled where their grammars are still in those states.
        held, refused, substituted = [], [], []
        ranked = _Ranked(candidates)
        for i in checked:
            if prefetch.holds(grammars[i]):
                held.append(i)
            elif not grammars[i].grammar.is_allowed(token_ids[i]):
                taken = ranked.first_allowed(grammars[i].grammar.is_allowed, i)
                if taken is None:
                    refused.append(i)
                else:
                    substituted.append((i, taken))
        prefetch.settle()
        ahead: dict[int, np.ndarray] = {}
        answers = prefetch.allowed([grammars[i] for i in held], [token_ids[i] for i in held])
        for i, answer in zip(held, answers):
            if answer is None:
                allows = grammars[i].grammar.is_allowed
                answer = allows(token_ids[i])
            if answer:
                continue
            row = prefetch.row(grammars[i])
            if row is not None:
                def allows(token: int, row=row) -> bool:
                    return bool((int(row[token >> 5]) >> (token & 31)) & 1)
            # A row with its mask filled ahead reads the candidates only if a row without
            # one had them read: its redraw costs no mask.
            taken = ranked.first_allowed(allows, i) if ranked.read or row is None else None
            if taken is not None:
                substituted.append((i, taken))
                continue
            if row is not None:
                ahead[i] = row
            refused.append(i)
        refused.sort()
        substituted.sort()
        bitmask = None
        if refused:
            bitmask = allocate(len(refused), self.bitmask_width)
            rows = []  # refused grammars are active
            for k, i in enumerate(refused):
                if i in ahead:
                    bitmask[k] = ahead[i]
                else:
                    rows.append((grammars[i].grammar, k))
            prefetch.num_used += len(ahead)
            self._fill_rows(rows, bitmask)
        if self.prefetch_masks:
            refused_set = set(refused)
            taken = dict(substituted)
            passed = [i for i in checked if i not in refused_set]
            for i in passed:
                grammars[i].checked_token = taken.get(i, token_ids[i])
            self._passed = [grammars[i] for i in passed]
            self._refused = [grammars[i] for i in refused]
        self.mask_seconds += time.perf_counter() - start
        self.num_mask_steps += 1
        self.num_checked_rows += len(checked)
        self.num_refused_rows += len(refused)
        self.num_substituted_rows += len(substituted)
        return refused, bitmask, substituted

    def fill_verify_bitmask(self, grammars: list[RequestGrammar | None],
                            proposals: list[list[int]], out: np.ndarray) -> None:
        """Write the allowed tokens of a speculative step's verification rows into ``out``
        (``[sum(len(p) + 1), bitmask_width]``): request ``i``'s ``len(proposals[i]) + 1``
        rows together, in order, its row ``j`` the state after its first ``j`` proposals.
        The grammars end in the state they started in. A row after a proposal the grammar
        refuses allows everything: the rejection sampler never reads past a refused
        proposal (its probability under the mask is 0). Rows of a step position are
        filled together, one bitmask call per position."""
        start = time.perf_counter()
        self.prefetch.settle()
        out[:] = -1
        row_starts = np.cumsum([0] + [len(p) + 1 for p in proposals]).tolist()
        checkpoints = [(g, g.checkpoint()) for g in grammars if g is not None]
        advancing = [i for i, g in enumerate(grammars) if g is not None]
        try:
            for j in range(max((len(p) for p in proposals), default=0) + 1):
                self._fill_rows([(grammars[i].grammar, row_starts[i] + j) for i in advancing
                                 if grammars[i].active], out)
                still = []
                for i in advancing:  # a complete output takes nothing more (allows
                    # would say any token: its rows are not constrained)
                    grammar = grammars[i]
                    if (j < len(proposals[i]) and not grammar.is_terminated()
                            and grammar.allows(proposals[i][j])):
                        grammar.accept_token(proposals[i][j])
                        still.append(i)
                advancing = still
        finally:
            for grammar, checkpoint in checkpoints:
                grammar.restore(checkpoint)
        self.mask_seconds += time.perf_counter() - start
        self.num_mask_steps += 1

    def masks_ahead(self, grammars: list[RequestGrammar | None],
                    allocate: Callable[[int, int], np.ndarray]) -> np.ndarray:
        """``fill_bitmask``'s rows, each taken from the masks filled ahead where one was
        filled for its grammar's present state (waiting for the fill in flight); the other
        active rows are filled here. When every row was filled ahead, in the fill's order
        (a decode step of the same requests as the step before), the fill's own rows are
        returned (``MaskPrefetch.block``); else a new ``allocate(len(grammars), width)``."""
        start = time.perf_counter()
        prefetch = self.prefetch
        prefetch.settle()
        live, free = [], []
        for i, grammar in enumerate(grammars):
            (live if grammar is not None and grammar.active else free).append(i)
        indices = prefetch.indices([grammars[i] for i in live])
        out = None if free else prefetch.block(indices)
        if out is None:
            out = allocate(len(grammars), self.bitmask_width)
            out[free] = -1
            ahead = indices >= 0
            prefetch.copy_rows(indices[ahead], out, np.asarray(live, dtype=np.int64)[ahead])
            self._fill_rows([(grammars[i].grammar, i) for i, filled
                             in zip(live, ahead.tolist()) if not filled], out)
        self.mask_seconds += time.perf_counter() - start
        self.num_mask_steps += 1
        return out

    def take_sampled(self, grammars: list[RequestGrammar | None], token_ids: list[int],
                     allocate: Callable[[int, int], np.ndarray] | None = None) -> None:
        """The tokens of a step whose rows were sampled under ``masks_ahead``: each active
        grammar takes its own now, and their next masks start filling (``take_checked``),
        into ``allocate(rows, width)`` when given (arrays ``masks_ahead`` may return as
        they are: each must stay untouched until the step it is handed to has copied it)."""
        passed = []
        for grammar, token in zip(grammars, token_ids, strict=True):
            if grammar is not None and grammar.active:
                grammar.checked_token = token
                passed.append(grammar)
        self._passed, self._refused = passed, []
        self.take_checked(allocate)

    def note_redrawn(self, token_ids: list[int]) -> None:
        """The tokens the last check's refused rows were drawn again to, in its order: each
        grammar keeps its own (``RequestGrammar.checked_token``) for ``take_checked``."""
        if self.prefetch_masks:
            for grammar, token in zip(self._refused, token_ids, strict=True):
                grammar.checked_token = token

    def take_checked(self, allocate: Callable[[int, int], np.ndarray] | None = None) -> None:
        """The last check's rows take their tokens (those the scheduler has not taken yet:
        ``RequestGrammar.take_early``, one backend call for all), then their next masks
        start filling off this thread (``MaskPrefetch``), so that the fill runs while the
        device computes the step those tokens feed (into ``allocate``'s array, when given:
        ``take_sampled``). A no-op unless ``prefetch_masks``. Call once the step after the
        check is launched, or once the checked step's tokens are taken, whichever comes
        first (the second call finds nothing left)."""
        passed, refused = self._passed, self._refused
        if passed or refused:
            self._passed, self._refused = [], []
            backend = self.backend()
            self.prefetch.settle()
            RequestGrammar.take_early(refused + passed, backend)
            self.prefetch.start(refused + passed, backend.fill_bitmasks, self.bitmask_width,
                                allocate)

    def _fill(self, grammars: list[RequestGrammar | None], out: np.ndarray) -> None:
        rows = []
        for i, grammar in enumerate(grammars):
            if grammar is not None and grammar.active:
                rows.append((grammar.grammar, i))
            else:
                out[i] = -1
        self._fill_rows(rows, out)

    def _fill_rows(self, rows: list[tuple], out: np.ndarray) -> None:
        """One backend fill of ``rows`` ((grammar, row of ``out``) pairs), counted and timed."""
        if rows:
            start = time.perf_counter()
            self.backend().fill_bitmasks(rows, out)
            self.fill_calls.append((time.perf_counter() - start, len(rows)))
        self.num_mask_rows += len(rows)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.prefetch.settle()
        self.prefetch.shutdown()


class StepGrammars:
    """The engine's answers to the model runner about a step's constrained rows, by request
    id (``requests``: the scheduler's live requests; a request gone since the step was
    planned allows everything).

    - ``bitmask(request_ids, allocate)`` (also the object's call, for runners that only
      mask): the rows to mask before sampling. ``resolve_in_flight`` runs first, so the
      grammars have taken the step before's tokens.
    - ``check(request_ids, token_ids, allocate, candidates)``: rows sampled without their
      mask, when their ids are read (before any later step's forward pass), with the
      tokens each row's draw ranked next; the grammars have taken every earlier step's
      tokens, not these. See ``StructuredOutputManager.check_tokens``.
      Then ``redrawn(token_ids)``: the refused rows' new tokens, in the check's order; and
      ``forward_launched()`` once the next step's forward pass is launched: the checked
      rows' grammars take their tokens, and their next masks are filled in the background
      (``take_checked``).
    - With ``defers_masks`` (the engine fills every checked row's next mask ahead, and
      keeps a step in flight), the runner samples constrained rows under
      ``masks_ahead(request_ids, allocate)``: ``bitmask``'s rows, from the masks filled
      ahead (the grammars have taken the step before's tokens: no step is resolved), then
      tells ``sampled(request_ids, token_ids)`` once the next forward pass is launched:
      the grammars take those tokens and their next masks start filling.
    - ``verify_bitmask(request_ids, proposals, allocate)``: the verification rows of
      requests checking proposals (speculative steps, which are never asynchronous). See
      ``StructuredOutputManager.fill_verify_bitmask``.
    """

    __slots__ = ("_manager", "_requests", "_resolve_in_flight", "defers_masks")

    def __init__(self, manager: StructuredOutputManager, requests: dict,
                 resolve_in_flight: Callable[[], None], defers_masks: bool = False) -> None:
        self._manager = manager
        self._requests = requests
        self._resolve_in_flight = resolve_in_flight
        self.defers_masks = defers_masks

    def _grammars(self, request_ids: list[str]) -> list[RequestGrammar | None]:
        requests = self._requests
        return [getattr(requests.get(r), "grammar", None) for r in request_ids]

    def bitmask(self, request_ids: list[str], allocate: Callable[[int, int], np.ndarray]) -> np.ndarray:
        self._resolve_in_flight()
        out = allocate(len(request_ids), self._manager.bitmask_width)
        self._manager.fill_bitmask(self._grammars(request_ids), out)
        return out

    __call__ = bitmask

    def check(self, request_ids: list[str], token_ids: list[int],
              allocate: Callable[[int, int], np.ndarray],
              candidates: Callable[[], list[list[int]]] | None = None
              ) -> tuple[list[int], np.ndarray | None, list[tuple[int, int]]]:
        return self._manager.check_tokens(self._grammars(request_ids), token_ids, allocate,
                                          candidates)

    def redrawn(self, token_ids: list[int]) -> None:
        self._manager.note_redrawn(token_ids)

    def masks_ahead(self, request_ids: list[str],
                    allocate: Callable[[int, int], np.ndarray]) -> np.ndarray:
        return self._manager.masks_ahead(self._grammars(request_ids), allocate)

    def sampled(self, request_ids: list[str], token_ids: list[int],
                allocate: Callable[[int, int], np.ndarray] | None = None) -> None:
        self._manager.take_sampled(self._grammars(request_ids), token_ids, allocate)

    def forward_launched(self) -> None:
        self._manager.take_checked()

    def verify_bitmask(self, request_ids: list[str], proposals: list[list[int]],
                       allocate: Callable[[int, int], np.ndarray]) -> np.ndarray:
        out = allocate(sum(len(p) + 1 for p in proposals), self._manager.bitmask_width)
        self._manager.fill_verify_bitmask(self._grammars(request_ids), proposals, out)
        return out
