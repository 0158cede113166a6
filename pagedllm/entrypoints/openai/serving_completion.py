"""``POST /v1/completions``: prompts as text, lists of text, token ids or lists of token ids.

Choice ``i * n + j`` is completion ``j`` of prompt ``i``. ``echo`` prepends the prompt (and,
with ``logprobs``, its logprobs, the first one null) to each choice. Usage counts each
prompt once, whatever ``n``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagedllm.engine.async_engine import RequestStream
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, OpenAIError,
)
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE, OpenAIServing, merge_streams, random_id, sse, sse_error, usage, finite_logprob,
)
from pagedllm.outputs import Logprob, RequestOutput


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]

    def echo_text(self, tokenizer) -> str:
        """The prompt as text; empty in token-id mode (no tokenizer) for token-id prompts."""
        if self.text is not None:
            return self.text
        return "" if tokenizer is None else tokenizer.decode(self.token_ids)


@dataclass
class _Choice:
    """One choice accumulated from deltas (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, arrival_time: float
                                ) -> CompletionResponse | AsyncIterator[str]:
        """A full response, or (``stream``) an iterator of SSE lines ending with ``[DONE]``."""
        model = self.check_common(request, "completions")
        if request.suffix:
            raise OpenAIError("suffix is not supported by this server; remove it.", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of is not supported (only best_of == n); remove it.",
                              param="best_of")
        # Tokenizing a long prompt, or checking a constraint, takes long enough to stall every
        # other stream: off the loop (token ids alone are cheaper inline than a thread's hop).
        if _has_text(request.prompt):
            prompts = await asyncio.to_thread(self._prompts, request)
        else:
            prompts = self._prompts(request)
        prompt_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
        # ``echo`` with ``max_tokens: 0`` scores the prompt alone (vLLM's): one token is
        # generated, for the engine needs one, and left out of the response.
        max_tokens = 1 if prompt_only(request) else request.max_tokens
        constraint = await self.structured_outputs(request)
        request_id = random_id("cmpl")
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                params = self.sampling_params(request, max_tokens, request.logprobs,
                                              prompt_logprobs, constraint)
                params.max_tokens = self.check_context(len(prompt.token_ids), params.max_tokens,
                                                       "prompt", "max_tokens")
                streams.append(self.submit(f"{request_id}-{i}", prompt.text, prompt.token_ids,
                                           params, arrival_time, request.priority))
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        created = int(time.time())
        if request.stream:
            return self._stream(request, request_id, created, model, prompts, streams)
        try:
            return await self._full(request, request_id, created, model, prompts, streams)
        finally:
            for stream in streams:
                stream.close()

    def _prompts(self, request: CompletionRequest) -> list[_Prompt]:
        raw = request.prompt
        if isinstance(raw, str):
            items: list = [raw]
        elif raw and isinstance(raw[0], int):  # the body's schema: a list of ids, all int
            items = [list(raw)]
        else:
            items = list(raw)
        if not items:
            raise OpenAIError("prompt is empty: give a string, a list of strings, a list of "
                              "token ids or a list of token-id lists.", param="prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                tokenizer = self.require_tokenizer("A text prompt", "prompt")
                ids = tokenizer.encode(item, add_special_tokens=request.add_special_tokens)
                prompts.append(_Prompt(item, ids))
            else:
                prompts.append(_Prompt(None, list(item)))
        for i, prompt in enumerate(prompts):
            kept = self.truncated(request, prompt.token_ids)
            if len(kept) < len(prompt.token_ids):  # an echo shows what was kept
                prompts[i] = _Prompt(None, kept)
        return prompts

    # -- logprobs -----------------------------------------------------------------------
    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob] | None],
                  offset: int, out: CompletionLogprobs) -> int:
        """Append one run of tokens to ``out``; returns the text offset after them."""
        for token_id, entry in zip(token_ids, entries):
            sampled = entry.get(token_id) if entry else None
            text = self.token_text(token_id, sampled)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if entry is None:  # the first prompt token: nothing predicts it
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(finite_logprob(sampled.logprob) if sampled is not None else None)
            top: dict[str, float] = {}
            for tid, lp in entry.items():  # tokens with the same text share a key: keep the best
                key = self.token_text(tid, lp)
                top[key] = max(top.get(key, -float("inf")), finite_logprob(lp.logprob))
            out.top_logprobs.append(top)
        return offset

    # -- responses ----------------------------------------------------------------------
    async def _full(self, request: CompletionRequest, request_id: str, created: int, model: str,
                    prompts: list[_Prompt], streams: list[RequestStream]) -> CompletionResponse:
        n = request.n
        choices = [_Choice() for _ in range(len(prompts) * n)]
        prompt_logprobs: list[list] = [[] for _ in prompts]
        cached = [0] * len(prompts)
        generated = not prompt_only(request)
        async for i, out in merge_streams(streams):
            assert isinstance(out, RequestOutput)
            cached[i] = max(cached[i], out.num_cached_tokens)
            if out.prompt_logprobs:
                prompt_logprobs[i].extend(out.prompt_logprobs)
            for c in out.outputs:
                choice = choices[i * n + c.index]
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
                if not generated:
                    continue
                choice.text += c.text
                choice.token_ids.extend(c.token_ids)
                if c.logprobs:
                    choice.logprobs.extend(c.logprobs)

        with_ids = self.wants_token_ids(request)
        result = []
        for index, choice in enumerate(choices):
            prompt = prompts[index // n]
            text = choice.text
            logprobs = None
            if request.echo:
                text = prompt.echo_text(self.tokenizer) + text
            if request.logprobs is not None:
                logprobs = CompletionLogprobs()
                offset = 0
                if request.echo:
                    offset = self._logprobs(prompt.token_ids, prompt_logprobs[index // n], 0, logprobs)
                self._logprobs(choice.token_ids, choice.logprobs, offset, logprobs)
            result.append(CompletionChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
                prompt_token_ids=prompt.token_ids if with_ids else None,
                token_ids=choice.token_ids if with_ids else None,
                prompt_logprobs=self.prompt_logprobs(request, prompt.token_ids,
                                                     prompt_logprobs[index // n]),
            ))
        return CompletionResponse(
            id=request_id, created=created, model=model, choices=result,
            usage=usage(sum(len(p.token_ids) for p in prompts),
                        sum(len(c.token_ids) for c in choices), sum(cached)),
        )

    async def _stream(self, request: CompletionRequest, request_id: str, created: int, model: str,
                      prompts: list[_Prompt], streams: list[RequestStream]) -> AsyncIterator[str]:
        n = request.n
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        usage_in_chunks = bool(request.stream_options and request.stream_options.usage_in_chunks())
        with_ids = self.wants_token_ids(request)
        started = [False] * (len(prompts) * n)
        offsets = [0] * (len(prompts) * n)
        prompt_logprobs: list[list] = [[] for _ in prompts]
        cached = [0] * len(prompts)
        num_completion_tokens = 0
        generated = not prompt_only(request)
        try:
            async for i, out in merge_streams(streams):
                assert isinstance(out, RequestOutput)
                cached[i] = max(cached[i], out.num_cached_tokens)
                if out.prompt_logprobs:
                    prompt_logprobs[i].extend(out.prompt_logprobs)
                for c in out.outputs:
                    index = i * n + c.index
                    token_ids, text = (c.token_ids, c.text) if generated else ([], "")
                    num_completion_tokens += len(token_ids)
                    logprobs = CompletionLogprobs() if request.logprobs is not None else None
                    first = not started[index]
                    if first:
                        started[index] = True
                        if request.echo:
                            prompt = prompts[i]
                            text = prompt.echo_text(self.tokenizer) + text
                            if logprobs is not None:
                                offsets[index] = self._logprobs(
                                    prompt.token_ids, prompt_logprobs[i], 0, logprobs)
                    if logprobs is not None and generated:
                        offsets[index] = self._logprobs(token_ids, c.logprobs or [],
                                                        offsets[index], logprobs)
                    if not text and not token_ids and c.finish_reason is None:
                        continue
                    choice = {
                        "index": index, "text": text,
                        "logprobs": None if logprobs is None else logprobs.model_dump(),
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    }
                    if first and request.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = self.prompt_logprobs(
                            request, prompts[i].token_ids, prompt_logprobs[i])
                    if with_ids:
                        if first:
                            choice["prompt_token_ids"] = prompts[i].token_ids
                        choice["token_ids"] = token_ids
                    chunk = {"id": request_id, "object": "text_completion", "created": created,
                             "model": model, "choices": [choice]}
                    if include_usage:
                        chunk["usage"] = None if not usage_in_chunks else usage(
                            sum(len(p.token_ids) for p in prompts), num_completion_tokens,
                            sum(cached)).model_dump()
                    yield sse(chunk)
            if include_usage:
                info = usage(sum(len(p.token_ids) for p in prompts), num_completion_tokens, sum(cached))
                yield sse({"id": request_id, "object": "text_completion", "created": created,
                           "model": model, "choices": [], "usage": info.model_dump()})
        except Exception as exc:  # the status line is sent: report in the stream
            yield sse_error(exc)
        finally:
            for stream in streams:
                stream.close()
        yield SSE_DONE


def prompt_only(request: CompletionRequest) -> bool:
    """Whether the request scores its prompt without generating: ``echo`` with
    ``max_tokens: 0``."""
    return request.echo and request.max_tokens == 0


def _has_text(prompt: str | list[str] | list[int] | list[list[int]]) -> bool:
    """Whether a completion prompt holds text to tokenize (a list is all of one kind)."""
    return isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], str))
