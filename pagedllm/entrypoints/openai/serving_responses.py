"""``/v1/responses``: OpenAI's Responses API on the chat path.

A request's ``instructions`` (a system message), the turns stored under its
``previous_response_id`` and its ``input`` items become chat messages
(``responses_items``), which run as a chat completion of one choice: the chat template, the
tools (``tools`` in the Responses form, ``{"type": "function", "name", "parameters"}``),
``tool_choice``, the reasoning parser and the output constraints are the chat path's. The
output comes back as Responses items: ``reasoning`` (its text as ``reasoning_text``
content), ``message`` (``output_text``) and ``function_call`` items.

| Responses field | runs as |
| --- | --- |
| ``max_output_tokens`` | ``max_completion_tokens`` |
| ``text.format`` ``json_schema`` / ``json_object`` | ``response_format`` of the same type |
| ``reasoning.effort`` | ``reasoning_effort`` (a template variable) |
| ``tool_choice`` ``{"type": "function", "name"}`` | a named function |

``tools: []`` is no tools. With ``tool_choice`` ``required`` or a named function the output
is the calls, whatever ``text.format`` says (it shapes message text, which a forced call
does not write); with ``auto``, ``text.format`` constrains the whole output, so no tool is
called (as on vLLM).

A response cut by ``max_output_tokens`` has status ``incomplete``
(``incomplete_details.reason: "max_output_tokens"``); ``usage.output_tokens_details
.reasoning_tokens`` counts the output tokens up to the reasoning parser's end marker.

Streaming sends OpenAI's events, each ``event: <type>`` and its ``data``, numbered by
``sequence_number``: ``response.created``, ``response.in_progress``, the items' events
(``OutputItems``), and ``response.completed`` (or ``response.incomplete``); an error after
the status line is an ``error`` event.

With ``store`` (the default) the response is kept in this API server process's memory, the
last ``STORE_CAPACITY`` of them: ``GET`` and ``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items``, and ``previous_response_id`` (whose turns, not its
instructions, begin the next request's conversation, as OpenAI's do). Refused with a 400:
``background``, ``conversation``, ``prompt``, ``max_tool_calls``, ``include``,
``truncation: "auto"``, ``top_logprobs``, ``reasoning.summary``, ``text.verbosity``, ``n``
above 1, ``return_token_ids``, ``prompt_logprobs``, and tools other than functions.
``stream_options`` has nothing to act on (no obfuscation padding is sent; the usage is in
the final event).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest, OpenAIError, ResponsesRequest, SamplingFields,
)
from pagedllm.entrypoints.openai.responses_items import (
    OutputItems, assistant_message, input_messages, item_id, listed_items, name_tool_results,
)
from pagedllm.entrypoints.openai.serving_chat import ChatStart, OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import sse, stream_error_body
from pagedllm.entrypoints.openai.structured_outputs import requested_constraint
from pagedllm.entrypoints.openai.tool_choice import join_deltas
from pagedllm.entrypoints.openai.tool_parsers import DeltaMessage, DeltaToolCall

# Responses kept for retrieval and previous_response_id, per API server process.
STORE_CAPACITY = 1024
# SamplingFields that mean nothing here or have a Responses field of their own.
_NOT_PASSED_ON = {"stream_options", "response_format"}
# The chat path's names for what a Responses request calls otherwise (in 400s' params).
_PARAM_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


@dataclass
class _Stored:
    response: dict
    previous_id: str | None
    input_items: list[dict]  # the request's input, as input_items lists it


class ResponseStore:
    """The last ``capacity`` stored responses, least recently used out first."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, _Stored] = OrderedDict()

    def put(self, response: dict, previous_id: str | None, input_items: list[dict]) -> None:
        self._entries[response["id"]] = _Stored(response, previous_id, input_items)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> _Stored:
        stored = self._entries.get(response_id)
        if stored is None:
            raise OpenAIError(
                f"No response with id {response_id!r} is stored here: responses are kept in "
                f"the memory of the API server process that made them (the last "
                f"{self.capacity}), when made with store true.", status=404, param=param)
        self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]

    def history(self, response_id: str) -> list[dict]:
        """The chat messages of every turn up to and including ``response_id``'s, oldest
        first: each turn's input (not its instructions) and its output."""
        turns = []
        next_id: str | None = response_id
        while next_id is not None:
            stored = self.get(next_id, param="previous_response_id")
            turns.append(input_messages(stored.input_items)
                         + [assistant_message(stored.response["output"])])
            next_id = stored.previous_id
        return [message for turn in reversed(turns) for message in turn]


class OpenAIServingResponses:
    """``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}`` and ``GET
    /v1/responses/{id}/input_items``."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()

    def retrieve(self, response_id: str) -> dict:
        return self.store.get(response_id).response

    def delete(self, response_id: str) -> dict:
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def input_items(self, response_id: str, after: str | None = None, limit: int = 20,
                    order: str = "desc", include: list[str] | None = None) -> dict:
        """A stored response's input items, a page of ``limit`` (1 to 100) after the item
        ``after``, newest first unless ``order`` is "asc" (OpenAI's list form)."""
        items = list(self.store.get(response_id).input_items)
        if include:
            raise OpenAIError("include is not supported: remove it.", param="include")
        if order not in ("asc", "desc"):
            raise OpenAIError(f"order must be 'asc' or 'desc', got {order!r}.", param="order")
        if not 1 <= limit <= 100:
            raise OpenAIError(f"limit must be in 1..100, got {limit}.", param="limit")
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise OpenAIError(f"after names no input item of {response_id}: {after!r}.",
                                  param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "has_more": len(items) > limit,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None}

    async def create_response(self, request: ResponsesRequest, arrival_time: float
                              ) -> dict | AsyncIterator[str]:
        self.chat.check_common(request, "responses")
        _check_supported(request)
        turn = input_messages(request.input)
        history = ([] if request.previous_response_id is None
                   else self.store.history(request.previous_response_id))
        if not turn and not history:
            raise OpenAIError("input is empty: give the conversation's input (a string or "
                              "items), or a previous_response_id.", param="input")
        instructions = ([] if request.instructions is None
                        else [{"role": "system", "content": request.instructions}])
        messages = name_tool_results(instructions + history + turn)
        response_id = item_id("resp")
        try:
            started = await self.chat.start(_chat_request(request, messages), arrival_time,
                                            response_id)
        except OpenAIError as exc:
            exc.param = _responses_param(exc.param)
            raise
        call = _Call(request, response_id, int(time.time()), started, self.chat.defaults)
        if request.stream:
            return self._stream(call)
        try:
            return await self._full(call)
        finally:
            started.stream.close()

    # -- output ---------------------------------------------------------------------------
    async def _full(self, call: _Call) -> dict:
        async for out in call.started.stream:
            for c in out.outputs:
                call.took(out, c)
        message = call.started.reader.read(call.text)
        items = OutputItems()
        items.add(DeltaMessage(
            content=message.content, reasoning_content=message.reasoning,
            tool_calls=[DeltaToolCall(i, c.id, c.function.name, c.function.arguments)
                        for i, c in enumerate(message.tool_calls)]))
        items.close(call.status)
        return self._finish(call, items.items)

    async def _stream(self, call: _Call) -> AsyncIterator[str]:
        sequence = 0

        def event(payload: dict) -> str:
            nonlocal sequence
            payload["sequence_number"] = sequence
            sequence += 1
            return f"event: {payload['type']}\n" + sse(payload)

        started = call.started
        items = OutputItems()
        choice = started.reader.stream()
        try:
            opening = call.response("in_progress", [])
            yield event({"type": "response.created", "response": opening})
            yield event({"type": "response.in_progress", "response": opening})
            async for out in started.stream:
                for c in out.outputs:
                    call.took(out, c)
                    delta = choice.feed(c.text) if c.text else None
                    if c.finish_reason is not None:
                        delta = join_deltas(delta, choice.finish())
                    for payload in items.add(delta):
                        yield event(payload)
            for payload in items.close(call.status):
                yield event(payload)
            final = self._finish(call, items.items)
            yield event({"type": f"response.{final['status']}", "response": final})
        except Exception as exc:  # the status line is sent: report in the stream
            error = stream_error_body(exc)["error"]
            yield event({"type": "error", "code": error["code"],
                         "message": error["message"], "param": error.get("param")})
        finally:
            started.stream.close()

    def _finish(self, call: _Call, items: list[dict]) -> dict:
        """The final response object, stored when the request asks for it."""
        response = call.response(call.status, items)
        if call.request.store:
            self.store.put(response, call.request.previous_response_id,
                           listed_items(call.request.input))
        return response


class _Call:
    """One Responses request under way: what it asked, and what its output has been."""

    def __init__(self, request: ResponsesRequest, response_id: str, created_at: int,
                 started: ChatStart, defaults: dict) -> None:
        """``defaults``: the sampling defaults of a request that does not set them."""
        self.request = request
        self.defaults = defaults
        self.response_id = response_id
        self.created_at = created_at
        self.started = started
        self.text = ""
        self.token_ids: list[int] = []
        self.cached = 0
        self.finish_reason: str | None = None

    def took(self, out, completion) -> None:
        """Counts one engine output of the (only) choice."""
        self.cached = max(self.cached, out.num_cached_tokens)
        self.text += completion.text
        self.token_ids.extend(completion.token_ids)
        if completion.finish_reason is not None:
            self.finish_reason = completion.finish_reason

    @property
    def status(self) -> str:
        """``incomplete`` when ``max_output_tokens`` cut the output, else ``completed``."""
        return "incomplete" if self.finish_reason == "length" else "completed"

    def reasoning_tokens(self) -> int:
        """Output tokens up to and including the reasoning's end marker; all of them when
        the output never leaves its reasoning; 0 without a reasoning parser."""
        parser = self.started.reader.reasoning
        if parser is None or parser.tokenizer is None or not self.token_ids:
            return 0
        end = parser.tokenizer.encode(parser.end_token, add_special_tokens=False)
        ids = self.token_ids
        for start in range(len(ids) - len(end) + 1):
            if ids[start:start + len(end)] == end:
                return start + len(end)
        reasoning, content = parser.extract(self.text)
        return len(ids) if reasoning and not content else 0

    def response(self, status: str, output: list[dict]) -> dict:
        """The response object: the request's settings echoed, ``output`` and the usage."""
        request = self.request
        done = status != "in_progress"
        output_tokens = len(self.token_ids)
        prompt_tokens = len(self.started.prompt_ids)
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "model": self.started.model,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": (request.reasoning or {}).get("effort"), "summary": None},
            "store": request.store,
            "temperature": (self.defaults.get("temperature", 1.0) if request.temperature is None
                            else request.temperature),
            "text": request.text or {"format": {"type": "text"}},
            "tool_choice": request.tool_choice or ("auto" if request.tools else "none"),
            "tools": request.tools or [],
            "top_p": self.defaults.get("top_p", 1.0) if request.top_p is None else request.top_p,
            "truncation": "disabled",
            "usage": None if not done else {
                "input_tokens": prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens()},
                "total_tokens": prompt_tokens + output_tokens,
            },
            "user": request.user,
        }


# -- the request as a chat request ----------------------------------------------------------
def _check_supported(request: ResponsesRequest) -> None:
    """400s for what this server does not implement (the module docstring's list)."""
    refused = {
        "background": (request.background, "background responses are not supported: "
                       "remove background"),
        "conversation": (request.conversation, "conversations are not supported: continue "
                         "with previous_response_id"),
        "prompt": (request.prompt, "stored prompt templates are not supported: send input"),
        "max_tool_calls": (request.max_tool_calls is not None, "max_tool_calls is not "
                           "supported: limit calls with parallel_tool_calls false"),
        "include": (request.include, "include is not supported (no logprobs, encrypted "
                    "reasoning or built-in tool outputs are returned): remove include"),
        "truncation": (request.truncation not in (None, "disabled"), "truncation 'auto' is "
                       "not supported: a conversation longer than the context is refused"),
        "top_logprobs": (request.top_logprobs, "top_logprobs is not supported on "
                         "/v1/responses: use /v1/chat/completions for logprobs"),
        "reasoning.summary": (
            (request.reasoning or {}).get("summary") or (request.reasoning or {}).get(
                "generate_summary"),
            "reasoning summaries are not supported: the reasoning comes whole, as the "
            "reasoning item's content; remove reasoning.summary"),
        "text.verbosity": ((request.text or {}).get("verbosity"), "text.verbosity is not "
                           "supported: remove it"),
        "n": (request.n != 1, "a response has one output: remove n"),
        "return_token_ids": (request.return_token_ids, "a response carries no token ids: use "
                             "/v1/chat/completions for them"),
        "prompt_logprobs": (request.prompt_logprobs is not None, "a response carries no "
                            "logprobs: use /v1/chat/completions for them"),
    }
    for param, (value, reason) in refused.items():
        if value:
            raise OpenAIError(f"{reason}.", param=param)


def _chat_request(request: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat completion ``request`` runs as (the module docstring's table)."""
    sampling = {name: getattr(request, name) for name in SamplingFields.model_fields
                if name not in _NOT_PASSED_ON}
    tools = [_chat_tool(i, tool) for i, tool in enumerate(request.tools or [])] or None
    tool_choice = _chat_tool_choice(request.tool_choice)
    if tools is None and tool_choice in ("auto", "none"):
        tool_choice = None  # "tools": [] (what agent libraries send for no tools)
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    return ChatCompletionRequest(
        **sampling,
        messages=messages,
        max_completion_tokens=request.max_output_tokens,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=request.parallel_tool_calls,
        # text.format shapes a message's text, which a forced call never writes.
        response_format=request.response_format if forced else _response_format(request),
        reasoning_effort=(request.reasoning or {}).get("effort"),
        chat_template_kwargs=request.chat_template_kwargs,
    )


def _chat_tool(index: int, tool: dict) -> dict:
    """A Responses function tool (``name``, ``parameters`` at its top level) in the chat
    form (under ``function``)."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise OpenAIError(f"tools[{index}] is a tool of type {kind!r}: this server runs "
                          'function tools only ({"type": "function", "name", "parameters"}).',
                          param=f"tools[{index}]")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                      f'"name": ...}}, got {choice!r}.', param="tool_choice")


def _response_format(request: ResponsesRequest) -> dict | None:
    """``text.format`` as chat's ``response_format`` (vLLM's constraint fields, if set
    instead, go on as they stand)."""
    form = (request.text or {}).get("format")
    if form is None or form.get("type") == "text":
        return request.response_format
    other = requested_constraint(request)
    if other is not None:
        raise OpenAIError(f"text.format and {other[0]} both constrain the output: give one.",
                          param="text.format")
    if form.get("type") == "json_object":
        return {"type": "json_object"}
    if form.get("type") == "json_schema":
        schema = {key: form[key] for key in ("name", "schema", "strict", "description")
                  if key in form}
        return {"type": "json_schema", "json_schema": schema}
    raise OpenAIError(f"text.format must be of type text, json_object or json_schema, got "
                      f"{form.get('type')!r}.", param="text.format")


def _responses_param(param: str | None) -> str | None:
    """A chat-path param as the Responses request names it."""
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    base = head.split("[")[0]
    if base in _PARAM_NAMES:
        return _PARAM_NAMES[base] + head[len(base):] + dot + rest
    if base == "tools" and rest.startswith("function."):
        return f"{head}.{rest[len('function.'):]}"
    return param
