"""``POST /v1/chat/completions``: messages -> the chat template -> a completion.

Message content is a string or a list of text parts (joined with newlines, so every chat
template sees a plain string); other part types (images, audio, files) are refused, as the
served models read text only. The template is the model's own, or ``--chat-template``.

Streaming follows OpenAI: each choice's first chunk carries ``{"role": "assistant",
"content": ""}``, later chunks carry content deltas, and the chunk that ends a choice has
its ``finish_reason``.

Tools (``tool_choice.py``): the tools go to the chat template; calls come back in
``message.tool_calls`` (streamed as OpenAI's ``delta.tool_calls``: a call's id and name
first, then its argument fragments) with ``finish_reason: "tool_calls"`` (``"stop"`` for a
named function, as OpenAI answers). With ``--reasoning-parser`` the reasoning comes back
in ``reasoning_content`` and an output constraint applies after it. Assistant messages
carrying ``tool_calls`` reach the template with their arguments as objects, as chat
templates expect.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

import jinja2

from pagedllm.engine.async_engine import AsyncEngine, RequestStream
from pagedllm.engine.chat_messages import ChatMessageError, message_for_template
from pagedllm.entrypoints.openai.protocol import (
    ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
    ChatMessage, ChatResponseMessage, OpenAIError,
)
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE, OpenAIServing, random_id, sse, sse_error, usage,
)
from pagedllm.entrypoints.openai.reasoning import ReasoningParser
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.structured_outputs import constraint_params, requested_constraint
from pagedllm.entrypoints.openai.tool_choice import (
    ChoiceReader, ChoiceStream, ToolPlan, join_deltas, plan_tools,
)
from pagedllm.entrypoints.openai.tool_parsers import DeltaMessage, ToolParser
from pagedllm.outputs import Logprob
from pagedllm.structured import StructuredOutputsParams

# Request fields this server does not implement, with the value(s) that mean "off".
_UNSUPPORTED_FIELDS = {
    "functions": "functions (the deprecated form of tools) is not supported: send tools",
    "function_call": "function_call (the deprecated form of tool_choice) is not supported: "
                     "send tool_choice",
    "audio": "audio output is not supported: the served models produce text",
    "prediction": "prediction (predicted outputs) is not supported by this server",
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


class ChatStart(NamedTuple):
    """A chat request submitted: the model name to answer with, its id, its prompt, the
    engine's stream of its outputs, and the reader of each choice's output."""

    model: str
    request_id: str
    prompt_ids: list[int]
    stream: RequestStream
    reader: ChoiceReader


class OpenAIServingChat(OpenAIServing):
    """``tool_parser``: the ``--tool-call-parser`` (given with ``--enable-auto-tool-choice``);
    ``reasoning_parser``: the ``--reasoning-parser``."""

    def __init__(self, engine: AsyncEngine, models: OpenAIServingModels,
                 chat_template: str | None = None, tool_parser: ToolParser | None = None,
                 reasoning_parser: ReasoningParser | None = None) -> None:
        super().__init__(engine, models)
        self.chat_template = chat_template
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser

    async def create_chat_completion(self, request: ChatCompletionRequest, arrival_time: float
                                     ) -> ChatCompletionResponse | AsyncIterator[str]:
        started = await self.start(request, arrival_time, random_id("chatcmpl"))
        created = int(time.time())
        if request.stream:
            return self._stream(request, created, *started)
        try:
            return await self._full(request, created, *started)
        finally:
            started.stream.close()

    async def start(self, request: ChatCompletionRequest, arrival_time: float,
                    request_id: str) -> ChatStart:
        """Check the request, render and tokenize its prompt, and submit it to the engine
        (400s naming the field); the caller reads and closes ``ChatStart.stream``."""
        model = self.check_common(request, "chat.completions")
        self._check_supported(request)
        plan = plan_tools(request, self.tool_parser)
        # Rendering and tokenizing a long conversation, or checking a grammar, would stall
        # every other stream: off the loop, in one hop.
        prompt_text, prompt_ids, constraint = await asyncio.to_thread(self._prepare, request, plan)

        max_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs set to true.", param="top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        try:
            params = self.sampling_params(request, max_tokens, logprobs,
                                          structured_outputs=constraint)
        except OpenAIError as exc:
            exc.param = {"logprobs": "top_logprobs", "max_tokens": max_param}.get(exc.param, exc.param)
            raise
        if any(parser is not None and parser.keeps_special_tokens
               for parser in (plan.parser, self.reasoning_parser)):
            params.skip_special_tokens = False  # the markers are special tokens
        params.max_tokens = self.check_context(len(prompt_ids), params.max_tokens, "messages", max_param)
        stream = self.submit(request_id, prompt_text, prompt_ids, params, arrival_time, request.priority)
        return ChatStart(model, request_id, prompt_ids, stream,
                         ChoiceReader(self.reasoning_parser, plan))

    # -- prompt -------------------------------------------------------------------------
    def _prompt(self, request: ChatCompletionRequest, tools: list[dict] | None
                ) -> tuple[str, list[int]]:
        """The request's prompt text and token ids (no special tokens unless asked)."""
        text = self.render(request.messages, request.add_generation_prompt,
                           request.continue_final_message, self._template_kwargs(request, tools),
                           tools)
        return text, self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)

    def _template_kwargs(self, request: ChatCompletionRequest, tools: list[dict] | None
                         ) -> dict | None:
        """``chat_template_kwargs``, with ``reasoning_effort`` as the template variable of that
        name (gpt-oss's templates read it, as vLLM passes it); a 400 where the chat template
        never reads it, rather than a setting that changes nothing."""
        if request.reasoning_effort is None:
            return request.chat_template_kwargs
        tokenizer = self.require_tokenizer("A chat (its template)", "messages")
        try:
            template = tokenizer.get_chat_template(self.chat_template, tools)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="messages") from None
        if "reasoning_effort" not in template:
            raise OpenAIError("reasoning_effort is given, but this model's chat template does not "
                              "read it: remove reasoning_effort.", param="reasoning_effort")
        return {**(request.chat_template_kwargs or {}),
                "reasoning_effort": request.reasoning_effort}

    def _prepare(self, request: ChatCompletionRequest, plan: ToolPlan
                 ) -> tuple[str, list[int], StructuredOutputsParams | None]:
        prompt_text, prompt_ids = self._prompt(request, plan.tools)
        kept = self.truncated(request, prompt_ids)
        if len(kept) < len(prompt_ids):
            prompt_text, prompt_ids = None, kept
        return prompt_text, prompt_ids, self._constraint(request, plan, prompt_ids)

    def _constraint(self, request: ChatCompletionRequest, plan: ToolPlan,
                    prompt_ids: list[int]) -> StructuredOutputsParams | None:
        """The output constraint: a forced tool call's, or the request's own (not both)."""
        form = requested_constraint(request)
        if plan.constraint is not None:
            if form is not None:
                raise OpenAIError(f'tool_choice "{plan.mode}" constrains the output already: '
                                  f"remove {form[0]}.", param=form[0])
            form = ("tools", plan.constraint)
        if form is None:
            return None
        self.require_tokenizer(f"{form[0]} (an output constraint)", form[0])
        constraint = constraint_params(*form)
        if self.reasoning_parser is not None and not self._reasoning_closed(prompt_ids):
            constraint.reasoning_end_token_ids = self.tokenizer.encode(
                self.reasoning_parser.end_token, add_special_tokens=False)
        return constraint

    def _reasoning_closed(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt itself ends the reasoning (a template that turns thinking off
        writes an empty ``<think></think>``): the constraint then applies from the start."""
        encode = self.tokenizer.encode
        start = encode(self.reasoning_parser.start_token, add_special_tokens=False)
        end = encode(self.reasoning_parser.end_token, add_special_tokens=False)
        last_start = _rfind(prompt_ids, start)
        last_end = _rfind(prompt_ids, end)
        return last_end >= 0 and last_end > last_start

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False, template_kwargs: dict | None = None,
               tools: list[dict] | None = None) -> str:
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
                chat_template=self.chat_template, tools=tools, **template_kwargs,
            )
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise OpenAIError(f"Could not apply the chat template to these messages: {exc}",
                              param="messages") from None

    @staticmethod
    def _plain_message(index: int, message: ChatMessage) -> dict:
        """The message as the template reads it (``chat_messages``), its text parts joined."""
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
        plain = {"role": message.role, **(message.model_extra or {}), "content": content}
        try:
            return message_for_template(index, plain)
        except ChatMessageError as exc:
            raise OpenAIError(str(exc), param=exc.param) from None

    @staticmethod
    def _check_supported(request: ChatCompletionRequest) -> None:
        for name, reason in _UNSUPPORTED_FIELDS.items():
            if getattr(request, name):
                raise OpenAIError(f"{reason}; remove {name}.", param=name)
        if request.modalities and request.modalities != ["text"]:
            raise OpenAIError("Only the 'text' modality is supported.", param="modalities")

    # -- responses ----------------------------------------------------------------------
    def _choice_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
                         request: ChatCompletionRequest) -> ChatChoiceLogprobs | None:
        if not request.logprobs:
            return None
        return ChatChoiceLogprobs(content=self.chat_logprobs(token_ids, logprobs or [],
                                                             request.top_logprobs or 0))

    async def _full(self, request: ChatCompletionRequest, created: int, model: str,
                    request_id: str, prompt_ids: list[int], stream: RequestStream,
                    reader: ChoiceReader) -> ChatCompletionResponse:
        n = request.n
        texts = [""] * n
        token_ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[dict[int, Logprob]]] = [[] for _ in range(n)]
        finish: list[tuple[str | None, int | str | None]] = [(None, None)] * n
        cached = 0
        prompt_logprobs: list = []
        async for out in stream:
            cached = max(cached, out.num_cached_tokens)
            prompt_logprobs.extend(out.prompt_logprobs or [])
            for c in out.outputs:
                texts[c.index] += c.text
                token_ids[c.index].extend(c.token_ids)
                if c.logprobs:
                    logprobs[c.index].extend(c.logprobs)
                finish[c.index] = (c.finish_reason, c.stop_reason)
        with_ids = self.wants_token_ids(request)
        choices = []
        for i in range(n):
            message = reader.read(texts[i])
            choices.append(ChatCompletionChoice(
                index=i,
                message=ChatResponseMessage(
                    content=message.content, reasoning_content=message.reasoning,
                    tool_calls=[{"id": c.id, "type": c.type, "function": {
                        "name": c.function.name, "arguments": c.function.arguments}}
                        for c in message.tool_calls]),
                logprobs=self._choice_logprobs(token_ids[i], logprobs[i], request),
                finish_reason=_finish_reason(finish[i][0], reader.plan, len(message.tool_calls)),
                stop_reason=finish[i][1],
                token_ids=token_ids[i] if with_ids else None,
            ))
        return ChatCompletionResponse(
            id=request_id, created=created, model=model, choices=choices,
            usage=usage(len(prompt_ids), sum(len(t) for t in token_ids), cached),
            prompt_token_ids=prompt_ids if with_ids else None,
            prompt_logprobs=self.prompt_logprobs(request, prompt_ids, prompt_logprobs),
        )

    async def _stream(self, request: ChatCompletionRequest, created: int, model: str,
                      request_id: str, prompt_ids: list[int], stream: RequestStream,
                      reader: ChoiceReader) -> AsyncIterator[str]:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        usage_in_chunks = bool(request.stream_options and request.stream_options.usage_in_chunks())
        with_ids = self.wants_token_ids(request)
        role_sent = [False] * request.n
        choice_streams: list[ChoiceStream] = [reader.stream() for _ in range(request.n)]
        num_completion_tokens = 0
        cached = 0
        prompt_logprobs: list = []

        def chunk(index: int, delta: dict, logprobs, finish_reason=None, stop_reason=None,
                  token_ids: list[int] | None = None) -> str:
            """``token_ids`` None: the choice's opening chunk (role, and prompt ids if asked)."""
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
            body = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [choice]}
            if token_ids is None and request.prompt_logprobs is not None:
                body["prompt_logprobs"] = self.prompt_logprobs(request, prompt_ids, prompt_logprobs)
            if with_ids:
                if token_ids is None:
                    body["prompt_token_ids"] = prompt_ids
                else:
                    choice["token_ids"] = token_ids
            if include_usage:
                body["usage"] = (usage(len(prompt_ids), num_completion_tokens, cached).model_dump()
                                 if usage_in_chunks else None)
            return sse(body)

        try:
            async for out in stream:
                cached = max(cached, out.num_cached_tokens)
                prompt_logprobs.extend(out.prompt_logprobs or [])
                for c in out.outputs:
                    if not role_sent[c.index]:
                        role_sent[c.index] = True
                        yield chunk(c.index, {"role": "assistant", "content": ""}, None)
                    num_completion_tokens += len(c.token_ids)
                    choice_stream = choice_streams[c.index]
                    message = choice_stream.feed(c.text) if c.text else None
                    finish_reason = c.finish_reason
                    if finish_reason is not None:
                        message = join_deltas(message, choice_stream.finish())
                        finish_reason = _finish_reason(finish_reason, reader.plan,
                                                       choice_stream.num_calls)
                    delta = _delta(message)
                    logprobs = None
                    if request.logprobs and c.token_ids:
                        logprobs = self._choice_logprobs(c.token_ids, c.logprobs, request).model_dump()
                    if not (delta or logprobs or finish_reason or (with_ids and c.token_ids)):
                        continue
                    yield chunk(c.index, delta, logprobs, finish_reason, c.stop_reason,
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


def _finish_reason(reason: str | None, plan: ToolPlan, num_calls: int) -> str | None:
    """``tool_calls`` for a choice that ended by calling tools (auto or required)."""
    if reason == "stop" and num_calls and plan.mode in ("auto", "required"):
        return "tool_calls"
    return reason


def _delta(message: DeltaMessage | None) -> dict:
    """OpenAI's ``delta`` object for a parsed piece of output."""
    if message is None:
        return {}
    delta: dict = {}
    if message.reasoning_content:
        delta["reasoning_content"] = message.reasoning_content
    if message.content:
        delta["content"] = message.content
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            entry: dict = {"index": call.index}
            function: dict = {}
            if call.id is not None:
                entry.update(id=call.id, type="function")
                function["name"] = call.name
            function["arguments"] = call.arguments or ""
            entry["function"] = function
            calls.append(entry)
        delta["tool_calls"] = calls
    return delta


def _rfind(sequence: list[int], pattern: list[int]) -> int:
    """The start of the last occurrence of ``pattern`` in ``sequence``, or -1."""
    if not pattern:
        return -1
    first = pattern[0]
    for start in range(len(sequence) - len(pattern), -1, -1):
        if sequence[start] == first and sequence[start:start + len(pattern)] == pattern:
            return start
    return -1
