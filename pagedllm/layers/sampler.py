"""The batched sampler: one step's logits ``[B, V]`` -> one token per row, plus logprobs.

Order of operations per step (vLLM semantics)::

    logits ──> grammar masks (constrained rows: disallowed tokens -> -inf) = the raw logits
    raw logits ──> logprobs to return (log_softmax of the RAW logits)
        │
        ├─ allowed_token_ids    (every other token -> -inf)
        ├─ logit_bias           (each listed token's bias added to its logit)
        ├─ repetition penalty   (tokens seen in prompt or output: divide positive, multiply negative)
        ├─ presence / frequency (tokens seen in output: subtract presence * seen, frequency * count)
        ├─ min_tokens           (EOS and stop_token_ids -> -inf while the output is too short)
        ├─ bad_words            (a word's last token -> -inf where the output ends with the rest)
        │
        ├─ greedy rows:  argmax
        └─ random rows:  / temperature -> top-k -> top-p -> min-p -> softmax
                         -> argmax(probs / q),  q ~ Exp(1)   (the "exponential race")

The exponential race samples exactly from ``probs``: ``argmax(p_i / q_i)`` with i.i.d.
``q_i ~ Exp(1)`` picks ``i`` with probability ``p_i``. A seeded row draws its ``q`` from its
own ``torch.Generator`` (one draw of ``V`` values per sampled token), so its tokens do not
depend on the batch it sits in; unseeded rows share the global generator.

On CUDA, when no row filters (top-k, top-p, min-p), the race runs as one Triton kernel
(``triton_ops.gumbel_sample``): ``argmax(logits / T - log q)`` picks the same token without
a softmax, in one pass over the logits instead of about eight. Each row's noise then comes
from one seed drawn from its generator per sampled token, so seeded rows stay independent
of the batch (the tokens differ from the torch path's for the same seed). Greedy rows take
``triton_ops.greedy_argmax`` there, the same tokens as ``argmax`` in a fraction of the time.

Check-then-mask (structured outputs): a constrained row may be sampled without its token
mask (``SamplingMetadata.keep_draw``); the sampler then keeps the step's draw (``Draw``:
the logits after penalties and the race's noise), and a row whose token the grammar
refuses is drawn again under its mask with the same noise (``Sampler.redraw``). The race
over the allowed tokens with the noise of the first draw picks the token that masking
first would have picked: when the first winner is allowed it also wins among the allowed
tokens, so the token, and how far a seeded generator advances, are the same either way.
That holds because everything before the race (allowed tokens, logit bias, penalties,
``min_tokens``, bad words, temperature) acts token by token and commutes with the mask;
top-k, top-p and min-p depend on the whole distribution, so rows with them are masked
first. The race also ranks the tokens it did not pick (``Sampler.candidates``): the best
allowed one wins the masked race, so a refused row whose next candidates include an
allowed token needs no mask at all.

Everything per row is a tensor built once per step by ``SamplingMetadata.build``; the
forward pass is vectorised over rows and never syncs with the host, except for drawing
``q`` row by row for seeded requests. The penalties' token counts live on the device from
step to step (``TokenCounts``): a request's history is read from the host once, and each
step adds only the ids it sampled.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from pagedllm.core.outputs import LogprobsEntry
from pagedllm.layers import triton_ops
from pagedllm.layers.triton_ops import use_fused_ops
from pagedllm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """Per-row sampling state for one step's batch of ``B`` rows, as device tensors.

    A tensor is ``None`` when no row of the batch needs it, so the common case (all
    greedy, no penalties, no logprobs) carries nothing and costs nothing. Rows that do not
    use a feature hold its neutral value (temperature 1, top_k ``V``, top_p 1, min_p 0,
    penalties 1/0/0).
    """

    num_rows: int
    all_greedy: bool
    all_random: bool
    # [B] float32; 1.0 on greedy rows. None when every row is greedy.
    temperature: torch.Tensor | None = None
    # [B] bool, True on greedy rows. Only set when the batch mixes greedy and random rows.
    greedy_mask: torch.Tensor | None = None
    top_k: torch.Tensor | None = None  # [B] int64 in [1, V]
    top_p: torch.Tensor | None = None  # [B] float32 in (0, 1]
    min_p: torch.Tensor | None = None  # [B] float32 in [0, 1]
    # row index -> the request's own generator (random rows of seeded requests only).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    no_penalties: bool = True
    repetition_penalties: torch.Tensor | None = None  # [B] float32
    presence_penalties: torch.Tensor | None = None  # [B] float32
    frequency_penalties: torch.Tensor | None = None  # [B] float32
    # [B, V] bool: token appears in the prompt or the output (repetition penalty only).
    seen_mask: torch.Tensor | None = None
    # [B, V] float32: how often each token appears in the output so far.
    output_counts: torch.Tensor | None = None
    # Rows with allowed_token_ids (int64 [R]) and which tokens each allows (bool [R, V]).
    allowed_rows: torch.Tensor | None = None
    allowed_mask: torch.Tensor | None = None
    # (rows, token ids, biases) to add to the logits: the rows' logit_bias entries.
    logit_bias_rows: torch.Tensor | None = None  # int64 [E]
    logit_bias_token_ids: torch.Tensor | None = None  # int64 [E]
    logit_bias_values: torch.Tensor | None = None  # float32 [E]
    # Bad words' bans, one entry a (row, token), and whether each applies (bool [E]: the
    # output ends with the rest of its word, pending tokens compared on the device).
    bad_word_rows: torch.Tensor | None = None  # int64 [E]
    bad_word_token_ids: torch.Tensor | None = None  # int64 [E]
    bad_word_applies: torch.Tensor | None = None  # bool [E]
    # (rows, token ids) to set to -inf: stop tokens of rows still short of min_tokens.
    min_tokens_rows: torch.Tensor | None = None
    min_tokens_token_ids: torch.Tensor | None = None
    # The largest ``logprobs`` k asked for by any row (0 is valid); None if no row asks.
    max_num_logprobs: int | None = None
    # With penalties: the table the counts came from and the batch's rows in it (int64
    # [B] on the device), which ``record_sampled`` adds the step's tokens to.
    token_counts: TokenCounts | None = None
    token_count_rows: torch.Tensor | None = None
    # Constrained rows (int64 [R]) and their allowed tokens (int32 [R, ceil(V / 32)], bit
    # t % 32 of word t // 32 for token t). None when no row is constrained.
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None
    # Keep the step's ``Draw`` (rows sampled without their grammar mask, to be checked).
    keep_draw: bool = False

    def record_sampled(self, token_ids: torch.Tensor) -> None:
        """Count the step's sampled ids (int64 ``[B]``) into the table the penalties read
        (a no-op without penalties); the caller does it once per step, after sampling."""
        if self.token_counts is not None:
            self.token_counts.add(self.token_count_rows, token_ids)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
        pending_token_ids: tuple[list[int], torch.Tensor] | None = None,
        counts: RowCounts | None = None,
        grammar: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> "SamplingMetadata":
        """Gather the batch's per-row knobs into tensors on ``device``.

        Row ``i`` is described by ``params[i]``, its prompt and output token ids so far, and
        ``generators[i]``, the generator the caller keeps for a seeded request (``None``
        for unseeded ones). ``vocab_size`` is the width of the logits.

        ``pending_token_ids = (rows, ids)``: one more output token of each of ``rows`` whose
        id is known only on the device (``ids``, int64 ``[len(rows)]``: sampled by a step
        whose output has not been read back). Penalties count them, and ``min_tokens``
        counts them, without a host sync.

        ``counts``: where the penalties' token counts live across steps (``RowCounts``: a
        ``TokenCounts`` table, each row's index in it and the object owning that row).
        Without it the counts are built afresh from the token lists.

        ``grammar = (rows, bitmask)``: the constrained rows and their allowed tokens, on
        ``device`` (see ``grammar_rows``).
        """
        num_rows = len(params)
        for name, seq in (("prompt_token_ids", prompt_token_ids),
                          ("output_token_ids", output_token_ids), ("generators", generators)):
            if len(seq) != num_rows:
                raise ValueError(f"{name} has {len(seq)} rows but params has {num_rows}.")

        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        meta = cls(num_rows=num_rows, all_greedy=all_greedy, all_random=all_random)
        if grammar is not None:
            meta.grammar_rows, meta.grammar_bitmask = grammar

        ks = [p.logprobs for p in params if p.logprobs is not None]
        meta.max_num_logprobs = max(ks) if ks else None

        if not all_greedy:
            _build_random(meta, params, greedy, generators, vocab_size, device)

        allowing = [(i, p.allowed_token_ids) for i, p in enumerate(params)
                     if p.allowed_token_ids is not None]
        if allowing:
            _build_allowed(meta, allowing, vocab_size, device)
        biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias is not None]
        if biased:
            _build_logit_bias(meta, biased, device)

        if any(p.has_penalties for p in params):
            if counts is None:  # a table for this step alone
                counts = RowCounts(TokenCounts(num_rows, vocab_size, device), list(range(num_rows)),
                                   [object() for _ in range(num_rows)])
            _build_penalties(meta, params, prompt_token_ids, output_token_ids, device,
                             pending_token_ids, counts)

        num_pending = [0] * num_rows
        for row in (pending_token_ids[0] if pending_token_ids is not None else ()):
            num_pending[row] += 1
        rows: list[int] = []
        toks: list[int] = []
        for i, (p, out) in enumerate(zip(params, output_token_ids)):
            if len(out) + num_pending[i] < p.min_tokens:
                for t in p.all_stop_token_ids:
                    if t < vocab_size:
                        rows.append(i)
                        toks.append(t)
        if rows:
            meta.min_tokens_rows = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
            meta.min_tokens_token_ids = torch.tensor(toks, dtype=torch.long).to(device, non_blocking=True)
        if any(p.bad_words_token_ids for p in params):
            _build_bad_words(meta, params, output_token_ids, pending_token_ids, device)
        return meta


def _build_random(
    meta: SamplingMetadata,
    params: list[SamplingParams],
    greedy: list[bool],
    generators: list[torch.Generator | None],
    vocab_size: int,
    device: torch.device | str,
) -> None:
    temperature, top_k, top_p, min_p = [], [], [], []
    for i, (p, is_greedy, gen) in enumerate(zip(params, greedy, generators)):
        if is_greedy:
            temperature.append(1.0)
            top_k.append(vocab_size)
            top_p.append(1.0)
            min_p.append(0.0)
            continue
        temperature.append(p.temperature)
        top_k.append(vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size))
        top_p.append(p.top_p)
        min_p.append(p.min_p)
        if gen is not None:
            meta.generators[i] = gen
        elif p.seed is not None:
            raise ValueError(
                f"Row {i} has seed={p.seed} but no generator: pass the request's "
                "torch.Generator in generators so its samples stay reproducible."
            )

    def to_device(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    meta.temperature = to_device(temperature, torch.float32)
    if any(k < vocab_size for k in top_k):
        meta.top_k = to_device(top_k, torch.long)
    if any(p < 1.0 for p in top_p):
        meta.top_p = to_device(top_p, torch.float32)
    if any(m > 0.0 for m in min_p):
        meta.min_p = to_device(min_p, torch.float32)
    if not meta.all_random:
        meta.greedy_mask = to_device(greedy, torch.bool)


def _build_allowed(meta: SamplingMetadata, allowing: list[tuple[int, list[int]]],
                   vocab_size: int, device: torch.device | str) -> None:
    """The rows with ``allowed_token_ids`` (row index and its list) and their allowed tokens
    as a ``[R, V]`` mask, made on the device from the ids alone."""
    counts = [len(ids) for _, ids in allowing]
    mask_rows = np.repeat(np.arange(len(allowing), dtype=np.int64), counts)
    ids = np.fromiter((t for _, row_ids in allowing for t in row_ids), dtype=np.int64,
                      count=len(mask_rows))
    mask_rows, ids = (torch.from_numpy(a).to(device, non_blocking=True) for a in (mask_rows, ids))
    mask = torch.zeros(len(allowing), vocab_size, dtype=torch.bool, device=mask_rows.device)
    meta.allowed_mask = mask.index_put_((mask_rows, ids), torch.ones((), dtype=torch.bool,
                                                                     device=mask.device))
    meta.allowed_rows = torch.tensor([row for row, _ in allowing], dtype=torch.long).to(
        device, non_blocking=True)


def _build_bad_words(meta: SamplingMetadata, params: list[SamplingParams],
                     output_token_ids: list[list[int]],
                     pending_token_ids: tuple[list[int], torch.Tensor] | None,
                     device: torch.device | str) -> None:
    """The bans of the rows' bad words (see ``SamplingMetadata.bad_word_rows``): a word's
    last token wherever the output so far ends with the rest of the word. A row's pending
    tokens (known on the device only) end its output; the part of a word that falls on
    them is compared on the device."""
    pending: dict[int, list[int]] = {}  # row -> its pending tokens' indices, in order
    for k, row in enumerate(pending_token_ids[0] if pending_token_ids is not None else ()):
        pending.setdefault(row, []).append(k)
    rows, tokens, checks = [], [], []  # checks: (entry, pending index, expected token)
    for i, (p, out) in enumerate(zip(params, output_token_ids)):
        tail = pending.get(i, [])
        for word in p.bad_words_token_ids:
            *head, last = word
            if len(head) > len(out) + len(tail):
                continue
            on_device = []
            for back, token in enumerate(reversed(head), start=1):  # back: from the end
                if back <= len(tail):
                    on_device.append((tail[-back], token))
                elif out[len(out) - (back - len(tail))] != token:
                    break
            else:
                checks.extend((len(rows), k, token) for k, token in on_device)
                rows.append(i)
                tokens.append(last)
    if not rows:
        return

    def to_device(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    meta.bad_word_rows, meta.bad_word_token_ids = to_device(rows), to_device(tokens)
    if checks:
        entry, index, expected = (to_device(list(c)) for c in zip(*checks))
        differs = (pending_token_ids[1].index_select(0, index) != expected).long()
        misses = torch.zeros(len(rows), dtype=torch.long, device=differs.device)
        meta.bad_word_applies = misses.index_add(0, entry, differs) == 0
    else:
        meta.bad_word_applies = torch.ones(len(rows), dtype=torch.bool, device=device)


def _build_logit_bias(meta: SamplingMetadata, biased: list[tuple[int, dict[int, float]]],
                      device: torch.device | str) -> None:
    """The (row, token, bias) entries of the rows with a ``logit_bias`` (``biased``: row
    index and its dict), flattened for one ``index_put`` a step."""
    counts = [len(bias) for _, bias in biased]
    rows = np.repeat(np.array([row for row, _ in biased], dtype=np.int64), counts)
    ids = np.fromiter((t for _, bias in biased for t in bias), dtype=np.int64, count=len(rows))
    values = np.fromiter((b for _, bias in biased for b in bias.values()), dtype=np.float32,
                         count=len(rows))
    meta.logit_bias_rows, meta.logit_bias_token_ids, meta.logit_bias_values = (
        torch.from_numpy(a).to(device, non_blocking=True) for a in (rows, ids, values))


def _build_penalties(
    meta: SamplingMetadata,
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    device: torch.device | str,
    pending_token_ids: tuple[list[int], torch.Tensor] | None,
    counts: RowCounts,
) -> None:
    """Penalty factors per row plus the token-occurrence tensors they act on, from
    ``counts`` (see ``SamplingMetadata.build``)."""
    meta.no_penalties = False
    meta.repetition_penalties = torch.tensor(
        [p.repetition_penalty for p in params], dtype=torch.float32).to(device, non_blocking=True)
    meta.presence_penalties = torch.tensor(
        [p.presence_penalty for p in params], dtype=torch.float32).to(device, non_blocking=True)
    meta.frequency_penalties = torch.tensor(
        [p.frequency_penalty for p in params], dtype=torch.float32).to(device, non_blocking=True)
    table = counts.table
    table.fill_rows(counts, prompt_token_ids, output_token_ids, pending_token_ids)
    rows = torch.tensor(counts.rows, dtype=torch.long).to(device, non_blocking=True)
    meta.output_counts = table.output.index_select(0, rows)
    meta.seen_mask = table.prompt.index_select(0, rows) | (meta.output_counts > 0)
    meta.token_counts, meta.token_count_rows = table, rows


class RowCounts(NamedTuple):
    """A batch's rows in a ``TokenCounts`` table: ``rows[i]`` is batch row ``i``'s index in
    it, ``owners[i]`` the object it serves (a request's state: a new object, a new fill)."""

    table: TokenCounts
    rows: list[int]
    owners: list[object]


class TokenCounts:
    """The penalties' per-request token counts, on the device, kept from step to step.

    Row ``r`` serves one owner (a request's entry in the batch): ``output[r, v]`` counts
    token ``v`` among the owner's sampled tokens, ``prompt[r, v]`` marks ``v`` in its prompt.
    A row is filled from the host's token lists once, when a batch first reads it for a new
    owner (``fill_rows``); from then on each step adds the ids it sampled, on the device
    (``add``). The host's work per step is then one index per row, not the whole history
    (for 256 requests of 1,500 tokens, tens of milliseconds a step).
    """

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device | str) -> None:
        self.output = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
        self.prompt = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
        self.owners: list[object | None] = [None] * num_rows

    def fill_rows(
        self,
        counts: RowCounts,
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        pending_token_ids: tuple[list[int], torch.Tensor] | None,
    ) -> None:
        """Fill the rows of ``counts`` whose owner changed: the owner's prompt, its output
        so far and its pending tokens (batch rows and device ids, as in
        ``SamplingMetadata.build``). The other rows already count all of those."""
        stale = [i for i, (row, owner) in enumerate(zip(counts.rows, counts.owners))
                 if self.owners[row] is not owner]
        if not stale:
            return
        device = self.output.device
        table_rows = [counts.rows[i] for i in stale]
        index = torch.tensor(table_rows, dtype=torch.long).to(device, non_blocking=True)
        self.output[index] = 0.0
        self.prompt[index] = False
        rows, ids = _flatten([output_token_ids[i] for i in stale], device)
        self.add(index[rows], ids)
        rows, ids = _flatten([prompt_token_ids[i] for i in stale], device)
        self.prompt[index[rows], ids] = True
        if pending_token_ids is not None:
            position = {i: k for k, i in enumerate(stale)}
            picks = [(k, position[i]) for k, i in enumerate(pending_token_ids[0]) if i in position]
            if picks:
                which, at = (torch.tensor(v, dtype=torch.long).to(device, non_blocking=True)
                             for v in zip(*picks))
                self.add(index[at], pending_token_ids[1][which])
        for i in stale:
            self.owners[counts.rows[i]] = counts.owners[i]

    def add(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """One more occurrence of ``token_ids[i]`` in row ``rows[i]`` (both int64 on the
        device; repeats accumulate)."""
        if token_ids.numel():
            self.output.index_put_((rows, token_ids),
                                   torch.ones_like(token_ids, dtype=torch.float32), accumulate=True)


def _flatten(token_lists: list[list[int]], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of a ragged batch, as two int64 tensors on ``device``."""
    lengths = [len(t) for t in token_lists]
    # np.fromiter over the chained lists is several times faster than torch.tensor(flat list).
    ids = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64,
                                       count=sum(lengths)))
    rows = torch.from_numpy(np.repeat(np.arange(len(token_lists), dtype=np.int64), lengths))
    return rows.to(device, non_blocking=True), ids.to(device, non_blocking=True)


@dataclass
class LogprobsTensors:
    """Logprobs for ``B`` rows: the sampled (or target) token first, then the top ``k``.

    ``token_ids`` and ``logprobs`` are ``[B, 1 + k]`` for the batch's largest ``k``;
    ``ranks`` is ``[B]``, the rank of column 0's token in the full distribution
    (1 = most likely; 1 + the number of tokens with a strictly greater logprob).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    _host: tuple[list, list, list] | None = field(default=None, repr=False)

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        """The three tensors as Python lists (one device-to-host copy, cached)."""
        if self._host is None:
            self._host = (self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist())
        return self._host

    def to_entries(self, row: int, k: int) -> LogprobsEntry:
        """Row ``row`` cut to its own ``k``, as plain data.

        ``k`` is at most the batch's largest; the top list is shorter only when the
        vocabulary itself has fewer than ``k`` tokens.
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}.")
        token_ids, logprobs, ranks = self.tolists()
        return token_ids[row][: k + 1], logprobs[row][: k + 1], ranks[row]


@dataclass
class Draw:
    """How a step's rows were drawn, kept to draw some again under a token mask
    (``Sampler.redraw``): ``logits`` ``[B, V]`` after the penalties and ``min_tokens``
    (what greedy rows took the argmax of and random rows raced over), the step's metadata,
    and the race's noise: Exp(1) draws ``[B, V]`` (torch), or one seed per row ``[B]``
    (the Gumbel kernel); None when every row is greedy."""

    logits: torch.Tensor
    meta: SamplingMetadata
    noise: torch.Tensor | None


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # set when any row asked for logprobs
    draw: Draw | None = None  # set when ``SamplingMetadata.keep_draw``


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """The logprob and rank of ``token_ids[b]`` in row ``b`` of ``logprobs [B, V]``, plus the top ``k``."""
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1))  # [B, 1]
    ranks = (logprobs > chosen).sum(-1) + 1
    k = min(k, logprobs.shape[-1])
    if k > 0:
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)
        ids = torch.cat([token_ids.unsqueeze(-1), top_ids], dim=-1)
        values = torch.cat([chosen, top_logprobs], dim=-1)
    else:
        ids, values = token_ids.unsqueeze(-1), chosen
    return LogprobsTensors(token_ids=ids, logprobs=values, ranks=ranks)


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: torch.Tensor, k: int
) -> list[LogprobsEntry]:
    """Logprobs of prompt tokens: row ``i`` of ``logits [N, V]`` scores ``target_token_ids[i]``.

    The caller aligns rows and targets (the logits at position ``p`` predict token
    ``p + 1``). Returns one entry per row: the target first, then the top ``k``.
    """
    if logits.shape[0] != target_token_ids.shape[0]:
        raise ValueError(
            f"logits has {logits.shape[0]} rows but target_token_ids has {target_token_ids.shape[0]}."
        )
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    tensors = gather_logprobs(logprobs, target_token_ids.to(logits.device, torch.long), k)
    token_ids, values, ranks = tensors.tolists()
    return [(t, v, r) for t, v, r in zip(token_ids, values, ranks)]


class Sampler(nn.Module):
    """Chooses one token per row of ``logits [B, V]`` as ``SamplingMetadata`` says.

    Logits may come in any float dtype: penalties, masks, temperature and softmax work on
    a float32 copy, while greedy and plain temperature sampling on a GPU read them as they
    are (their kernels widen each value exactly), so the choice is the float32 one."""

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != meta.num_rows:
            raise ValueError(
                f"logits must be [num_rows={meta.num_rows}, vocab], got {tuple(logits.shape)}."
            )
        if meta.grammar_rows is not None:
            logits = apply_token_bitmask(logits, meta.grammar_rows, meta.grammar_bitmask)
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)

        logits = penalized_logits(logits, meta)
        greedy = None if meta.all_random else _argmax(logits)
        noise = None
        if meta.all_greedy:
            sampled = greedy
        else:
            sampled, noise = self._sample_random(logits, meta)
            if greedy is not None:
                sampled = torch.where(meta.greedy_mask, greedy, sampled)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        draw = Draw(logits=logits, meta=meta, noise=noise) if meta.keep_draw else None
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs, draw=draw)

    @staticmethod
    def redraw(draw: Draw, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (int64 ``[R]``) of a kept draw drawn again with the tokens
        ``bitmask`` (int32 ``[R, W]``, as in ``apply_token_bitmask``) disallows removed, with
        the noise of their first draw -> int64 ``[R]``: the tokens the step would have
        sampled with the mask applied first. Rows must not filter (top-k, top-p, min-p).
        On a GPU the kernels race the kept rows under the bitmask in place
        (``triton_ops.masked_row_argmax``)."""
        meta = draw.meta
        if use_fused_ops(draw.logits):
            if meta.all_greedy:
                return triton_ops.masked_row_argmax(draw.logits, rows, bitmask)
            sampled = triton_ops.masked_row_argmax(draw.logits, rows, bitmask,
                                                   meta.temperature, draw.noise)
            if meta.greedy_mask is not None:
                greedy = triton_ops.masked_row_argmax(draw.logits, rows, bitmask)
                sampled = torch.where(meta.greedy_mask.index_select(0, rows), greedy, sampled)
            return sampled
        masked = masked_rows(draw.logits, rows, bitmask)
        if meta.all_greedy:
            return _argmax(masked)
        temperature = meta.temperature.index_select(0, rows)
        noise = draw.noise.index_select(0, rows)
        if noise.dim() == 1:  # the Gumbel kernel's row seeds
            sampled = triton_ops.gumbel_sample(masked, temperature, noise)
        else:
            probs = (masked.float() / temperature.unsqueeze(-1)).softmax(dim=-1)
            sampled = probs.div_(noise).argmax(dim=-1)
        if meta.greedy_mask is not None:
            sampled = torch.where(meta.greedy_mask.index_select(0, rows), _argmax(masked), sampled)
        return sampled

    @staticmethod
    def candidates(draw: Draw, rows: torch.Tensor, count: int) -> torch.Tensor:
        """The tokens of rows ``rows`` (int64 ``[R]``) of a kept draw in the order its race
        ranked them, best first: int64 ``[R, count]``, -1 past the tokens the ranking
        settles (scores tied with the ``count + 1``-th best, or -inf). The first of a
        row's candidates that a token mask allows is the token ``redraw`` gives under that
        mask (its race over the allowed tokens with the same noise); when the mask allows
        none of them, only ``redraw`` says. The first candidate is the draw's own token.
        On a GPU the scores are the race kernels' own (``triton_ops.race_top``); the torch
        race divides the probabilities by the noise, and its redraw those renormalised
        over the allowed tokens: the same order up to rounding."""
        meta = draw.meta
        # The Gumbel kernel's row seeds are raced by the kernels wherever they came from.
        fused = use_fused_ops(draw.logits) or (draw.noise is not None and draw.noise.dim() == 1)
        greedy = None
        if meta.all_greedy or meta.greedy_mask is not None:
            greedy = (triton_ops.race_top(draw.logits, rows, count + 1) if fused
                      else _all_columns(draw.logits.index_select(0, rows).float()))
        ranked = greedy
        if not meta.all_greedy:
            if fused:
                ranked = triton_ops.race_top(draw.logits, rows, count + 1, meta.temperature,
                                             draw.noise)
            else:
                temperature = meta.temperature.index_select(0, rows).unsqueeze(-1)
                probs = (draw.logits.index_select(0, rows).float() / temperature).softmax(dim=-1)
                ranked = _all_columns(probs.div_(draw.noise.index_select(0, rows)))
            if greedy is not None:
                chosen = meta.greedy_mask.index_select(0, rows).unsqueeze(-1)
                ranked = tuple(torch.where(chosen, g, r) for g, r in zip(greedy, ranked))
        return ranked_candidates(*ranked, count)

    @staticmethod
    def _sample_random(logits: torch.Tensor, meta: SamplingMetadata
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draw per row from its filtered, temperature-scaled distribution, and the
        race's noise (see ``Draw``).

        On a GPU every batch draws with the Gumbel kernel from one seed per row, the
        filters (top-k, top-p, min-p, on the scaled logits) only masking tokens of the raw
        logits: a row's draw, and how far its generator advances, do not depend on which
        other rows share the batch or what filters they carry."""
        filtered = meta.top_k is not None or meta.top_p is not None or meta.min_p is not None
        if use_fused_ops(logits):
            if filtered:
                logits = logits.float()
                removed = _filter(logits / meta.temperature.unsqueeze(-1), meta) == _NEG_INF
                logits = logits.masked_fill(removed, _NEG_INF)
            seeds = _row_seeds(logits, meta)
            return triton_ops.gumbel_sample(logits, meta.temperature, seeds), seeds
        probs = sampling_probs(logits, meta)
        noise = exponential_noise(probs, meta.generators)
        return probs.div_(noise).argmax(dim=-1), noise


def ranked_candidates(scores: torch.Tensor, columns: torch.Tensor, count: int) -> torch.Tensor:
    """Each row's ``count`` best columns as argmax ranks them (higher score first, the
    first column of a tie first), from ``scores`` and ``columns`` ``[R, C]``: candidates
    that include every row's ``count + 1`` best. int64 ``[R, count]``, -1 where the
    ranking is not settled by the candidates (a score tied with the ``count + 1``-th best,
    which may share it with a column not among them) or the score is -inf."""
    take = min(count + 1, scores.shape[-1])
    values, picked = scores.topk(take, dim=-1)
    index = columns.gather(-1, picked)
    order = index.argsort(dim=-1)  # by column, then stably by score: a tie's first column first
    values, index = values.gather(-1, order), index.gather(-1, order)
    order = values.argsort(dim=-1, descending=True, stable=True)
    values, index = values.gather(-1, order), index.gather(-1, order)
    settled = values > float("-inf")
    if take > count:
        settled &= values > values[:, -1:]
    return torch.where(settled, index, -1)[:, :count]


def _all_columns(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores [R, V]`` with every column as a candidate (see ``ranked_candidates``)."""
    columns = torch.arange(scores.shape[-1], device=scores.device).expand(scores.shape)
    return scores, columns


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token (int64 ``[B]``): the greedy choice."""
    return triton_ops.greedy_argmax(logits) if use_fused_ops(logits) else logits.argmax(dim=-1)


def penalized_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """``logits`` after the allowed tokens, the logit bias, the penalties and ``min_tokens``
    (float32 when any applies, else ``logits`` itself; never modified in place): what greedy
    rows take the argmax of."""
    if meta.allowed_rows is not None:
        rows = logits.float().index_select(0, meta.allowed_rows)
        logits = logits.float().index_copy(
            0, meta.allowed_rows, rows.masked_fill(~meta.allowed_mask, _NEG_INF))
    if meta.logit_bias_rows is not None:
        logits = logits.float().index_put(
            (meta.logit_bias_rows, meta.logit_bias_token_ids), meta.logit_bias_values,
            accumulate=True)
    if not meta.no_penalties:
        logits = apply_penalties(logits.float(), meta)
    if meta.min_tokens_rows is not None:
        logits = logits.float().index_put(
            (meta.min_tokens_rows, meta.min_tokens_token_ids),
            torch.full((), _NEG_INF, dtype=logits.dtype, device=logits.device),
        )
    if meta.bad_word_rows is not None:
        # -inf added where an entry applies, 0 where not (entries may repeat a token).
        logits = logits.float().index_put(
            (meta.bad_word_rows, meta.bad_word_token_ids),
            torch.where(meta.bad_word_applies, _NEG_INF, 0.0), accumulate=True)
    return logits


def sampling_probs(penalized: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows draw from, float32 ``[B, V]`` summing to 1 per row:
    ``penalized`` (see ``penalized_logits``) over the temperature, then top-k, top-p and
    min-p, then softmax. Greedy rows (temperature 1 here) get their plain softmax."""
    scaled = penalized.float() / meta.temperature.unsqueeze(-1)
    if meta.top_k is not None or meta.top_p is not None or meta.min_p is not None:
        scaled = _filter(scaled, meta)
    return scaled.softmax(dim=-1)


def exponential_noise(like: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Exp(1) draws shaped as ``like`` ``[B, V]``: row ``r`` from ``generators[r]`` when it
    has one (one draw of ``V`` values), the others from the global generator.
    ``argmax(probs / noise)`` samples each row from ``probs`` (the exponential race)."""
    noise = torch.empty_like(like, dtype=torch.float32)
    if len(generators) < like.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return noise


def _filter(scaled: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """``scaled`` (temperature-scaled float32 logits) with the tokens that top-k, top-p and
    min-p remove set to -inf."""
    if meta.top_k is not None or meta.top_p is not None:
        scaled = apply_top_k_top_p(scaled, meta.top_k, meta.top_p)
    if meta.min_p is not None:
        scaled = apply_min_p(scaled, meta.min_p)
    return scaled


def _row_seeds(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """One noise seed per row for ``gumbel_sample``: from the row's own generator for a
    seeded request, from the global generator for the others (no host sync)."""
    seeds = torch.randint(0, 2**31 - 1, (meta.num_rows,), dtype=torch.int64, device=logits.device)
    for row, generator in meta.generators.items():
        seeds[row] = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=logits.device,
                                   generator=generator)[0]
    return seeds


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` (not modified) with the tokens ``bitmask`` disallows set to -inf in ``rows``.

    ``bitmask`` is int32 ``[len(rows), W]`` with ``32 * W >= V``: token ``t`` of row ``i``
    is allowed when bit ``t % 32`` of ``bitmask[i, t // 32]`` is set. ``rows`` are distinct.
    On a GPU: a copy of ``logits`` with the refused tokens written by one kernel
    (``triton_ops.refuse_masked_tokens_``), not the rows rebuilt through a bool mask.
    """
    if use_fused_ops(logits):
        copy = logits.clone(memory_format=torch.contiguous_format)
        return triton_ops.refuse_masked_tokens_(copy, rows, bitmask)
    return logits.index_copy(0, rows, masked_rows(logits, rows, bitmask))


def masked_rows(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of ``logits`` (``[len(rows), V]``, a copy) with the tokens ``bitmask``
    disallows set to -inf (``bitmask`` as in ``apply_token_bitmask``)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    return logits.index_select(0, rows).masked_fill(~allowed, _NEG_INF)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output), then presence and frequency (output) penalties."""
    rep = meta.repetition_penalties.unsqueeze(-1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(meta.seen_mask, penalized, logits)
    logits = logits - meta.frequency_penalties.unsqueeze(-1) * meta.output_counts
    return logits - meta.presence_penalties.unsqueeze(-1) * (meta.output_counts > 0)


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """Mask to -inf the tokens outside each row's top ``k`` and outside its top-``p`` nucleus.

    Ties with the k-th largest logit are kept. The nucleus is the smallest set of most
    likely tokens whose probability sum reaches ``p``; the most likely token always stays.
    """
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        kth = logits_sort.gather(-1, (logits_sort.shape[-1] - k).unsqueeze(-1))
        logits_sort = logits_sort.masked_fill(logits_sort < kth, _NEG_INF)
    if p is not None:
        cumulative = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= (1 - p).unsqueeze(-1)
        outside[:, -1] = False
        logits_sort = logits_sort.masked_fill(outside, _NEG_INF)
    return logits_sort.scatter(-1, logits_idx, logits_sort)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf tokens whose probability is below ``min_p`` times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1)
    return logits.masked_fill(probs < threshold, _NEG_INF)
