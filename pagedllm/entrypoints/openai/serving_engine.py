"""What completions and chat completions share: sampling params from a request, the context
length check, logprob formatting, request submission, and SSE framing.

Units: token counts are tokens; ``created`` is Unix seconds; arrival times are
``time.monotonic()`` seconds taken when the HTTP request was parsed (so time to first
token includes tokenization).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.async_engine import (
    AsyncEngine, EngineDeadError, EngineOverloadedError, RequestStream, RequestTimeoutError,
)
from pagedllm.engine.tokenizer import Tokenizer
from pagedllm.entrypoints.openai.protocol import (
    INTERNAL_ERROR_MESSAGE, REFUSED_FIELDS, ChatTokenLogprob, OpenAIError, PromptTokensDetails, SamplingFields, TopLogprob,
    UsageInfo, error_body,
)
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.structured_outputs import constraint_params, requested_constraint
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured import StructuredOutputsParams

logger = logging.getLogger(__name__)

_PARAM_IN_MESSAGE = re.compile(r"^(\w+) must\b")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# One encoder for every event (json.dumps with options builds a new one per call).
_SSE_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def sse(payload: dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line.

    The JSON holds no character that a line reader may take for a line break: the SSE
    spec breaks lines at CR and LF only (which JSON escapes), but readers that split like
    ``str.splitlines`` (httpx's ``aiter_lines``, for one) also break at U+0085, U+2028 and
    U+2029, which ``ensure_ascii=False`` leaves raw in generated text; they are sent as
    ``\\u`` escapes, which decode to the same text."""
    data = payload if isinstance(payload, str) else _SSE_JSON.encode(payload)
    if not data.isascii():
        data = data.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029").replace("\x85", "\\u0085")
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"
# Seconds a client refused for overload is told to wait before it retries.
RETRY_AFTER_S = 1


def timeout_error(exc: RequestTimeoutError) -> OpenAIError:
    """A request aborted at its deadline: 504, OpenAI's error shape."""
    return OpenAIError(str(exc), status=504, code="request_timeout")


def sse_error(exc: BaseException) -> str:
    """An error in the middle of a stream (the status line is already sent), as an event."""
    return sse(stream_error_body(exc))


def stream_error_body(exc: BaseException) -> dict:
    """The error body for an error in the middle of a stream: the error's own message when
    it is meant for clients, a generic one (traceback logged) otherwise."""
    if isinstance(exc, OpenAIError):
        return exc.body()
    if isinstance(exc, EngineDeadError):
        return error_body(str(exc), "server_error")
    if isinstance(exc, RequestTimeoutError):
        return timeout_error(exc).body()
    logger.error("Unhandled error in a stream", exc_info=exc)
    return error_body(INTERNAL_ERROR_MESSAGE, "server_error")


# Request fields that take the model's sampling default (--generation-config) when unset.
_DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for; each is a serve flag of the same name. Past a limit a
    request is refused with a 400 (413 for the body) that names the limit and its flag."""

    max_request_body_bytes: int = 10 * 1024 * 1024
    max_n: int = 128
    max_stop_sequences: int = 64


class OpenAIServing:
    """Base of the completion and chat handlers."""

    limits = RequestLimits()

    def __init__(self, engine: AsyncEngine, models: OpenAIServingModels) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.priority_scheduling = engine.config.scheduler_config.policy == "priority"
        # What a request that does not set them samples with (--generation-config).
        self.defaults = engine.config.model_config.sampling_defaults

    # -- request checks -----------------------------------------------------------------
    def require_tokenizer(self, what: str, param: str | None) -> Tokenizer:
        """The tokenizer; a 400 naming ``what`` when the server runs in token-id mode."""
        if self.tokenizer is None:
            raise OpenAIError(
                f"{what} needs a tokenizer, but this server runs in token-id mode (the model "
                "ships no tokenizer, or --skip-tokenizer-init): send token-id prompts to "
                "/v1/completions, or restart the server with --tokenizer DIR.", param=param)
        return self.tokenizer

    def wants_token_ids(self, request: SamplingFields) -> bool:
        """Token ids go in the response on request, and always in token-id mode."""
        return request.return_token_ids or self.tokenizer is None

    def check_common(self, request: SamplingFields, endpoint: str) -> str:
        """Checks every endpoint shares; returns the model name to answer with."""
        model = self.models.resolve(request.model)
        self.check_limits(request)
        if request.stop:
            self.require_tokenizer("stop (matched in the decoded text; use stop_token_ids)", "stop")
        unknown = request.unknown_fields()
        if unknown:
            logger.warning("Ignoring unknown fields in a %s request: %s", endpoint, ", ".join(unknown))
        refused = request.refused_fields()
        if refused:
            raise OpenAIError(f"{REFUSED_FIELDS[refused[0]]} is not supported by this server; "
                              f"remove {refused[0]}.", param=refused[0])
        if request.stream_options is not None and not request.stream:
            raise OpenAIError("stream_options is only allowed when stream is true.",
                              param="stream_options")
        if request.priority and not self.priority_scheduling:
            raise OpenAIError(
                "priority only has an effect when the server runs with --scheduling-policy "
                "priority; remove it or restart the server with that flag.", param="priority")
        return model

    def truncated(self, request: SamplingFields, token_ids: list[int]) -> list[int]:
        """The prompt's ids as ``truncate_prompt_tokens`` keeps them: the last N (-1: the
        last ``max_model_len``); all of them when it is not set. A 400 for another value."""
        keep = request.truncate_prompt_tokens
        if keep is None:
            return token_ids
        if keep == -1:
            keep = self.max_model_len
        if not 1 <= keep <= self.max_model_len:
            raise OpenAIError(f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len}] "
                              f"(the context length), got {request.truncate_prompt_tokens}.",
                              param="truncate_prompt_tokens")
        return token_ids[-keep:]

    def check_limits(self, request: SamplingFields) -> None:
        """A 400 naming the limit and its flag for ``n`` or ``stop`` past ``self.limits``."""
        limits = self.limits
        if request.n > limits.max_n:
            raise OpenAIError(f"n is {request.n}, above this server's limit of {limits.max_n} "
                              "(--max-n): lower n.", param="n")
        best_of = getattr(request, "best_of", None)
        if best_of is not None and best_of > limits.max_n:
            raise OpenAIError(f"best_of is {best_of}, above this server's limit of "
                              f"{limits.max_n} (--max-n): lower best_of.", param="best_of")
        num_stops = 1 if isinstance(request.stop, str) else len(request.stop or [])
        if num_stops > limits.max_stop_sequences:
            raise OpenAIError(f"stop has {num_stops} sequences, above this server's limit of "
                              f"{limits.max_stop_sequences} (--max-stop-sequences): send fewer.",
                              param="stop")

    async def structured_outputs(self, request: SamplingFields) -> StructuredOutputsParams | None:
        """The request's output constraint (see structured_outputs.py), checked; or None.

        Checking a grammar can take long enough to stall every other stream: it runs off
        the event loop (a request without one costs no thread hop)."""
        form = requested_constraint(request)
        if form is None:
            return None
        field, kwargs = form
        self.require_tokenizer(f"{field} (an output constraint)", field)
        return await asyncio.to_thread(constraint_params, field, kwargs)

    def sampling_params(self, request: SamplingFields, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """``SamplingParams`` from the request; a ValueError becomes a 400 naming the field.
        ``prompt_logprobs``: what the endpoint needs of them (an echo's), besides the
        request's own ``prompt_logprobs``."""
        asked = [k for k in (prompt_logprobs, request.prompt_logprobs) if k is not None]
        prompt_logprobs = max(asked) if asked else None
        # The request's value, else the model's default, else SamplingParams' own.
        chosen = {name: self.defaults.get(name) if getattr(request, name) is None
                  else getattr(request, name) for name in _DEFAULTED_FIELDS}
        try:
            return SamplingParams(
                **{name: value for name, value in chosen.items() if value is not None},
                n=request.n,
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                include_stop_str_in_output=request.include_stop_str_in_output,
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                structured_outputs=structured_outputs,
                logit_bias=logit_bias(request),
                allowed_token_ids=request.allowed_token_ids,
                bad_words=request.bad_words,
            )
        except ValueError as exc:
            raise bad_request(exc) from None

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str,
                      max_tokens_param: str) -> int:
        """The output budget: ``max_tokens``, or when it is None the room left (at most the
        model's default, generation_config.json's ``max_new_tokens``).

        Raises a 400 when the prompt leaves no room or prompt + max_tokens exceeds the
        context (the server refuses rather than silently cap, as OpenAI does).
        """
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens, but the "
                f"prompt has {num_prompt_tokens} tokens and at least one token must be generated: "
                "shorten the prompt.",
                param=prompt_param, code="context_length_exceeded",
            )
        if max_tokens is None:
            return min(room, self.defaults.get("max_tokens", room))
        if max_tokens > room:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                f"prompt, {max_tokens} for the completion): reduce the prompt or {max_tokens_param}.",
                param=max_tokens_param, code="context_length_exceeded",
            )
        return max_tokens

    # -- submission ---------------------------------------------------------------------
    def submit(self, request_id: str, prompt_text: str | None, prompt_token_ids: list[int],
               params: SamplingParams, arrival_time: float, priority: int) -> RequestStream:
        try:
            return self.engine.add_request(
                request_id, {"prompt": prompt_text, "prompt_token_ids": prompt_token_ids},
                params, arrival_time=arrival_time, priority=priority,
            )
        except EngineDeadError as exc:
            raise OpenAIError(str(exc), status=503) from None
        except EngineOverloadedError as exc:
            raise OpenAIError(str(exc), status=503, code="overloaded",
                              headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as exc:
            raise bad_request(exc, default_param="prompt") from None

    # -- logprobs -----------------------------------------------------------------------
    def token_text(self, token_id: int, logprob: Logprob | None = None) -> str:
        """A token's text for logprobs; ``token_id:<id>`` in token-id mode."""
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def top_entries(self, entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
        """The ``k`` most likely tokens at one position, most likely first."""
        ranked = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k]
        ranked.sort(key=lambda item: item[1].rank)
        return ranked[:k]

    def prompt_logprobs(self, request: SamplingFields, token_ids: list[int],
                        entries: list[dict[int, Logprob] | None]) -> list | None:
        """vLLM's ``prompt_logprobs`` of a response: per prompt position (None for the first,
        which nothing predicts), the prompt token and the ``request.prompt_logprobs`` most
        likely ones, keyed by token id: ``{"logprob", "rank", "decoded_token"}``. None when
        the request did not ask for them."""
        k = request.prompt_logprobs
        if k is None:
            return None
        result: list[dict[str, dict[str, Any]] | None] = []
        for token_id, entry in zip(token_ids, entries):
            if entry is None:
                result.append(None)
                continue
            kept = dict(self.top_entries(entry, k))
            if token_id in entry:
                kept[token_id] = entry[token_id]
            result.append({str(tid): {"logprob": finite_logprob(lp.logprob), "rank": lp.rank,
                                      "decoded_token": self.token_text(tid, lp)}
                           for tid, lp in kept.items()})
        return result

    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]],
                      top_k: int) -> list[ChatTokenLogprob]:
        result = []
        for token_id, entry in zip(token_ids, logprobs):
            sampled = entry.get(token_id)
            text = self.token_text(token_id, sampled)
            result.append(ChatTokenLogprob(
                token=text,
                logprob=finite_logprob(sampled.logprob if sampled is not None else float("-inf")),
                bytes=list(text.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=(t := self.token_text(tid, lp)), logprob=finite_logprob(lp.logprob),
                               bytes=list(t.encode("utf-8")))
                    for tid, lp in self.top_entries(entry, top_k)
                ],
            ))
        return result


def finite_logprob(value: float) -> float:
    """JSON has no -inf: clamp to the most negative float, as OpenAI-compatible servers do."""
    return max(value, -9999.0)


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
    )


def bad_request(exc: Exception, default_param: str | None = None) -> OpenAIError:
    """A 400 from a user-facing ValueError; ``param`` is the field its message starts with."""
    message = str(exc)
    match = _PARAM_IN_MESSAGE.match(message)
    param = match.group(1) if match else default_param
    return OpenAIError(message, status=400, param=param)


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, object]]:
    """Interleave several streams as ``(stream index, output)`` in arrival order.

    Ends when every stream has ended; an exception from any stream propagates. Streams are
    not closed here: the caller closes them (which aborts unfinished ones).
    """
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    pending: dict[asyncio.Task, int] = {
        asyncio.ensure_future(streams[i].__anext__()): i for i in range(len(streams))
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[index].__anext__())] = index
                yield index, item
    finally:
        for task in pending:
            task.cancel()


LOGIT_BIAS_LIMIT = 100.0


def logit_bias(request: SamplingFields) -> dict[int, float] | None:
    """The request's ``logit_bias`` keyed by token id, each bias clamped to [-100, 100] as
    OpenAI's range is (None when absent or empty); a 400 for a key that is not an integer."""
    if not request.logit_bias:
        return None
    bias: dict[int, float] = {}
    for key, value in request.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise OpenAIError(f"logit_bias maps token ids (integers, as JSON keys) to biases; "
                              f"{key!r} is not a token id.", param="logit_bias") from None
        if not math.isfinite(value):
            raise OpenAIError(f"logit_bias of token {token} is {value}: give a finite number.",
                              param="logit_bias")
        bias[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, value))
    return bias
