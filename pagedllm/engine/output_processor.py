"""Front-end output processing: core outputs -> detokenized ``RequestOutput``s.

Owns, per user request, the detokenizer of each of its ``n`` sequences. Stop strings are
found here (they live in text, not tokens): a sequence that hits one is finished here and
its core request is returned in ``requests_to_abort`` so the core frees its blocks at once.

Without a tokenizer (``skip_tokenizer_init``), or for a request with ``detokenize=False``,
outputs carry token ids and empty text, logprobs carry no decoded tokens, and nothing is
decoded.

Output kinds: ``"final"`` (one ``RequestOutput`` when every sequence is done; the offline
API), ``"delta"`` (new text and tokens since the last output; streaming), ``"cumulative"``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.core.outputs import EngineCoreOutput, LogprobsEntry
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.processor import child_request_id
from pagedllm.engine.tokenizer import Tokenizer
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

OUTPUT_KINDS = ("final", "delta", "cumulative")


class _NoTextDetokenizer:
    """Stands in for ``IncrementalDetokenizer`` in token-id mode: no text, no stop strings."""

    output_text = ""
    stop: tuple[str, ...] = ()

    def update(self, new_token_ids, stop_terminated: bool = False) -> None:
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        return ""


def _no_text(token_id: int) -> None:
    return None


@dataclass
class _SequenceState:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detokenize_at_end: bool = False
    # Tokens that end generation (EOS unless ignored, stop_token_ids): a sequence the core
    # stops on one of them leaves its text out; one stopped by a completed grammar keeps it.
    stop_token_ids: frozenset[int] = frozenset()
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: str
    sequences: list[_SequenceState]
    arrival_time: float
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_sent_prompt_logprobs: int = 0
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    decode: bool = True  # text and decoded logprob tokens (a tokenizer and detokenize=True)
    num_finished: int = 0  # sequences whose finish_reason is set

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.sequences)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._children: dict[str, tuple[_RequestState, _SequenceState]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: str = "final",
        arrival_time: float | None = None,
    ) -> None:
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}.")
        if request_id in self._requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        decode = self.tokenizer is not None and params.detokenize
        stop_token_ids = self._stop_token_ids(params)
        sequences = [
            _SequenceState(
                index=i,
                detokenizer=_NoTextDetokenizer() if not decode else IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                ),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
                # When nobody reads the text before the end and no stop string needs it, it
                # is decoded once, at the end (without text, nothing is decoded at all).
                detokenize_at_end=not decode or (output_kind == "final" and not params.stop),
                stop_token_ids=stop_token_ids,
            )
            for i in range(params.n)
        ]
        state = _RequestState(
            request_id, prompt, prompt_token_ids, params, output_kind, sequences,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            decode=decode,
        )
        self._requests[request_id] = state
        for seq in sequences:
            self._children[child_request_id(request_id, seq.index, params.n)] = (state, seq)

    def _stop_token_ids(self, params: SamplingParams) -> frozenset[int]:
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        return params.stop_token_ids_with(eos)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a user request; returns its core request ids (for the core to abort)."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return []
        children = [child_request_id(request_id, s.index, state.params.n) for s in state.sequences]
        for child in children:
            self._children.pop(child, None)
        return children

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def request_ids(self) -> set[str]:
        """The user requests this processor holds any state of."""
        return set(self._requests) | {state.request_id for state, _ in self._children.values()}

    def num_unfinished_sequences(self) -> int:
        """Sequences (core requests) not finished yet, over every request."""
        return sum(1 for state in self._requests.values() for seq in state.sequences
                   if seq.finish_reason is None)

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to hand to users and the core request ids to abort."""
        touched: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        now = time.monotonic()
        for out in core_outputs:
            entry = self._children.get(out.request_id)
            if entry is None:  # aborted by the user meanwhile
                continue
            state, seq = entry
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None and seq.index == 0:
                state.prompt_logprobs.extend(
                    None if e is None else self._to_logprob_dict(e, state.decode)
                    for e in out.new_prompt_logprobs
                )
            if out.new_token_ids and state.first_token_time is None:
                state.first_token_time = now
            if self._update_sequence(seq, out, state.decode):
                to_abort.append(out.request_id)
            if seq.finish_reason is not None:
                state.num_finished += 1
                self._children.pop(out.request_id, None)
            # A "final" request has nothing to hand out until one of its sequences ends.
            if state.output_kind != "final" or seq.finish_reason is not None:
                touched[state.request_id] = state

        results = []
        for state in touched.values():
            output = self._make_output(state)
            if output is not None:
                results.append(output)
            if state.finished:
                self._requests.pop(state.request_id, None)
        return results, to_abort

    # -- helpers ------------------------------------------------------------------------
    def _update_sequence(self, seq: _SequenceState, out: EngineCoreOutput, decode: bool) -> bool:
        """Apply one core output; True if a stop string ended a sequence the core still runs.

        Several new tokens (speculative decoding) go to the detokenizer one at a time when
        the sequence has stop strings, so the tokens after the one that completes a stop
        string are dropped, as if they had never been generated."""
        new_token_ids = out.new_token_ids
        if new_token_ids:
            stop_str = None
            if not seq.detokenize_at_end:
                stop_str, new_token_ids = self._detokenize(seq, out)
            seq.token_ids.extend(new_token_ids)
            if out.new_logprobs and seq.logprobs is not None:
                for entry in out.new_logprobs[:len(new_token_ids)]:
                    seq.logprobs.append(self._to_logprob_dict(entry, decode))
                    seq.cumulative_logprob += entry[1][0]
            if stop_str is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop_str
                return out.finish_reason is None
        if out.finish_reason is not None:
            if seq.detokenize_at_end:
                seq.detokenizer.update(seq.token_ids, stop_terminated=self._on_stop_token(seq, out))
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _detokenize(self, seq: _SequenceState, out: EngineCoreOutput) -> tuple[str | None, list[int]]:
        """Feed the output's new tokens to ``seq``'s detokenizer: (the stop string found,
        or None; the tokens up to the one that completed it, or all)."""
        new_token_ids = out.new_token_ids
        stop_terminated = (out.finish_reason == "stop"
                           and new_token_ids[-1] in seq.stop_token_ids)
        if len(new_token_ids) == 1 or not seq.detokenizer.stop:
            return seq.detokenizer.update(new_token_ids, stop_terminated=stop_terminated), new_token_ids
        for i, token_id in enumerate(new_token_ids):
            last = i == len(new_token_ids) - 1
            stop_str = seq.detokenizer.update([token_id], stop_terminated=stop_terminated and last)
            if stop_str is not None:
                return stop_str, new_token_ids[:i + 1]
        return None, new_token_ids

    @staticmethod
    def _on_stop_token(seq: _SequenceState, out: EngineCoreOutput) -> bool:
        """Whether the core stopped ``seq`` on a stop token (whose text is not output)."""
        return (out.finish_reason == "stop" and bool(seq.token_ids)
                and seq.token_ids[-1] in seq.stop_token_ids)

    def _to_logprob_dict(self, entry: LogprobsEntry, decode: bool) -> dict[int, Logprob]:
        token_ids, logprobs, sampled_rank = entry
        decode_one = self._decode_one if decode else _no_text
        result = {token_ids[0]: Logprob(logprobs[0], sampled_rank, decode_one(token_ids[0]))}
        for rank, (tid, lp) in enumerate(zip(token_ids[1:], logprobs[1:]), start=1):
            if tid not in result:
                result[tid] = Logprob(lp, rank, decode_one(tid))
        return result

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _make_output(self, state: _RequestState) -> RequestOutput | None:
        finished = state.finished
        kind = state.output_kind
        if kind == "final" and not finished:
            return None
        delta = kind == "delta"
        completions = []
        for seq in state.sequences:
            if delta and len(seq.token_ids) == seq.num_sent_tokens and seq.finish_reason is None:
                continue
            done = seq.finish_reason is not None
            text = seq.detokenizer.get_next_output_text(finished=done, delta=delta)
            start = seq.num_sent_tokens if delta else 0
            lp_start = seq.num_sent_logprobs if delta else 0
            completions.append(CompletionOutput(
                index=seq.index,
                text=text,
                token_ids=seq.token_ids[start:],
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=None if seq.logprobs is None else seq.logprobs[lp_start:],
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            ))
            seq.num_sent_tokens = len(seq.token_ids)
            if seq.logprobs is not None:
                seq.num_sent_logprobs = len(seq.logprobs)
        prompt_logprobs = state.prompt_logprobs
        if delta and prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs[state.num_sent_prompt_logprobs:]
            state.num_sent_prompt_logprobs = len(state.prompt_logprobs)
        metrics = {"arrival_time": state.arrival_time, "first_token_time": state.first_token_time}
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids, prompt_logprobs=prompt_logprobs,
            outputs=completions, finished=finished, num_cached_tokens=state.num_cached_tokens,
            metrics=metrics,
        )
