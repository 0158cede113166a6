"""``POST /v1/chat/completions``: messages -> the chat template -> a completion.

Message content is a string or a list of text parts (joined with newlines, so every chat
template sees a plain string); other part types (images, audio, files) are refused, as the
served models read text only. The template is the model's own, or ``--chat-template``.

Streaming follows OpenAI: each choice's first chunk carries ``{"role": "assistant",
"content": ""}``, later chunks carry content deltas, and the chunk that ends a choice has
its ``finish_reason``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import jinja2

from pagedllm.engine.async_engine import AsyncEngine, RequestStream
from pagedllm.entrypoints.openai.protocol import (
    ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
    ChatMessage, ChatResponseMessage, OpenAIError,
)
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE, OpenAIServing, random_id, sse, sse_error, usage,
)
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.outputs import Logprob

# Request fields this server does not implement, with the value(s) that mean "off".
_UNSUPPORTED_FIELDS = {
    "tools": "tools (function calling) is not supported by this server yet",
    "functions": "functions (function calling) is not supported by this server yet",
    "function_call": "function_call is not supported by this server yet",
    "audio": "audio output is not supported: the served models produce text",
    "prediction": "prediction (predicted outputs) is not supported by this server",
    "reasoning_effort": "reasoning_effort is not supported by this server",
    "web_search_options": "web_search_options is not supported by this server",
}
# Template variables the request sets through its own fields; chat_template_kwargs may not.
_RESERVED_TEMPLATE_KWARGS = {"messages", "add_generation_prompt", "continue_final_message",
                             "chat_template", "tools", "documents"}


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file path, a template literal, or a name among the model's templates."""
    if value is None:
        return None
    from pathlib import Path

    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--chat-template: cannot read {path}: {exc}") from exc
    if any(mark in value for mark in ("{{", "{%")) or value.isidentifier():
        return value
    raise ValueError(
        f"--chat-template {value!r} is neither a file nor a Jinja template: pass the path of a "
        ".jinja file, a template string, or the name of one of the model's templates."
    )


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncEngine, models: OpenAIServingModels,
                 chat_template: str | None = None) -> None:
        super().__init__(engine, models)
        self.chat_template = chat_template

    async def create_chat_completion(self, request: ChatCompletionRequest, arrival_time: float
                                     ) -> ChatCompletionResponse | AsyncIterator[str]:
        model = self.check_common(request, "chat.completions")
        self._check_supported(request)
        # Rendering and tokenizing a long conversation would stall every other stream.
        prompt_text, prompt_ids = await asyncio.to_thread(self._prompt, request)

        max_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs set to true.", param="top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        try:
            params = self.sampling_params(request, max_tokens, logprobs)
        except OpenAIError as exc:
            exc.param = {"logprobs": "top_logprobs", "max_tokens": max_param}.get(exc.param, exc.param)
            raise
        params.max_tokens = self.check_context(len(prompt_ids), params.max_tokens, "messages", max_param)
        request_id = random_id("chatcmpl")
        stream = self.submit(request_id, prompt_text, prompt_ids, params, arrival_time, request.priority)
        created = int(time.time())
        if request.stream:
            return self._stream(request, request_id, created, model, prompt_ids, stream)
        try:
            return await self._full(request, request_id, created, model, prompt_ids, stream)
        finally:
            stream.close()

    # -- prompt -------------------------------------------------------------------------
    def _prompt(self, request: ChatCompletionRequest) -> tuple[str, list[int]]:
        """The request's prompt text and token ids (no special tokens unless asked)."""
        text = self.render(request.messages, request.add_generation_prompt,
                           request.continue_final_message, request.chat_template_kwargs)
        return text, self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False, template_kwargs: dict | None = None) -> str:
        """The prompt text for ``messages``; template errors become a 400 on ``messages``."""
        tokenizer = self.require_tokenizer("A chat (its template)", "messages")
        template_kwargs = dict(template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(template_kwargs))
        if reserved:
            raise OpenAIError(f"chat_template_kwargs may not set {', '.join(reserved)}: use the "
                              "request fields of the same name.", param="chat_template_kwargs")
        conversation = [self._plain_message(i, m) for i, m in enumerate(messages)]
        try:
            return tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=self.chat_template, **template_kwargs,
            )
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise OpenAIError(f"Could not apply the chat template to these messages: {exc}",
                              param="messages") from None

    @staticmethod
    def _plain_message(index: int, message: ChatMessage) -> dict:
        plain = {"role": message.role, **(message.model_extra or {})}
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type")
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise OpenAIError(
                        f"messages[{index}].content has a part of type {kind!r}: this server "
                        "accepts only text parts ({\"type\": \"text\", \"text\": ...}).",
                        param=f"messages[{index}].content",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        plain["content"] = content
        return plain

    @staticmethod
    def _check_supported(request: ChatCompletionRequest) -> None:
        for name, reason in _UNSUPPORTED_FIELDS.items():
            if getattr(request, name):
                raise OpenAIError(f"{reason}; remove {name}.", param=name)
        if request.tool_choice not in (None, "none", "auto"):
            raise OpenAIError("tool_choice is not supported by this server yet; remove it.",
                              param="tool_choice")
        fmt = request.response_format
        if fmt and fmt.get("type", "text") != "text":
            raise OpenAIError(
                f"response_format of type {fmt.get('type')!r} is not supported by this server "
                "yet; only {\"type\": \"text\"}.", param="response_format")
        if request.modalities and request.modalities != ["text"]:
            raise OpenAIError("Only the 'text' modality is supported.", param="modalities")

    # -- responses ----------------------------------------------------------------------
    def _choice_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
                         request: ChatCompletionRequest) -> ChatChoiceLogprobs | None:
        if not request.logprobs:
            return None
        return ChatChoiceLogprobs(content=self.chat_logprobs(token_ids, logprobs or [],
                                                             request.top_logprobs or 0))

    async def _full(self, request: ChatCompletionRequest, request_id: str, created: int, model: str,
                    prompt_ids: list[int], stream: RequestStream) -> ChatCompletionResponse:
        n = request.n
        texts = [""] * n
        token_ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[dict[int, Logprob]]] = [[] for _ in range(n)]
        finish: list[tuple[str | None, int | str | None]] = [(None, None)] * n
        cached = 0
        async for out in stream:
            cached = max(cached, out.num_cached_tokens)
            for c in out.outputs:
                texts[c.index] += c.text
                token_ids[c.index].extend(c.token_ids)
                if c.logprobs:
                    logprobs[c.index].extend(c.logprobs)
                finish[c.index] = (c.finish_reason, c.stop_reason)
        with_ids = self.wants_token_ids(request)
        choices = [
            ChatCompletionChoice(
                index=i, message=ChatResponseMessage(content=texts[i]),
                logprobs=self._choice_logprobs(token_ids[i], logprobs[i], request),
                finish_reason=finish[i][0], stop_reason=finish[i][1],
                token_ids=token_ids[i] if with_ids else None,
            )
            for i in range(n)
        ]
        return ChatCompletionResponse(
            id=request_id, created=created, model=model, choices=choices,
            usage=usage(len(prompt_ids), sum(len(t) for t in token_ids), cached),
            prompt_token_ids=prompt_ids if with_ids else None,
        )

    async def _stream(self, request: ChatCompletionRequest, request_id: str, created: int,
                      model: str, prompt_ids: list[int], stream: RequestStream) -> AsyncIterator[str]:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        with_ids = self.wants_token_ids(request)
        role_sent = [False] * request.n
        num_completion_tokens = 0
        cached = 0

        def chunk(index: int, delta: dict, logprobs, finish_reason=None, stop_reason=None,
                  token_ids: list[int] | None = None) -> str:
            """``token_ids`` None: the choice's opening chunk (role, and prompt ids if asked)."""
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
            body = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [choice]}
            if with_ids:
                if token_ids is None:
                    body["prompt_token_ids"] = prompt_ids
                else:
                    choice["token_ids"] = token_ids
            if include_usage:
                body["usage"] = None
            return sse(body)

        try:
            async for out in stream:
                cached = max(cached, out.num_cached_tokens)
                for c in out.outputs:
                    if not role_sent[c.index]:
                        role_sent[c.index] = True
                        yield chunk(c.index, {"role": "assistant", "content": ""}, None)
                    num_completion_tokens += len(c.token_ids)
                    delta = {"content": c.text} if c.text else {}
                    logprobs = None
                    if request.logprobs and c.token_ids:
                        logprobs = self._choice_logprobs(c.token_ids, c.logprobs, request).model_dump()
                    if not (delta or logprobs or c.finish_reason or (with_ids and c.token_ids)):
                        continue
                    yield chunk(c.index, delta, logprobs, c.finish_reason, c.stop_reason,
                                c.token_ids)
            if include_usage:
                info = usage(len(prompt_ids), num_completion_tokens, cached)
                yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                           "model": model, "choices": [], "usage": info.model_dump()})
        except Exception as exc:  # the status line is sent: report in the stream
            yield sse_error(exc)
        finally:
            stream.close()
        yield SSE_DONE
