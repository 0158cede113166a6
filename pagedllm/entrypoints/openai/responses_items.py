"""The Responses API's conversation items as chat messages, and its output items as they
grow.

``/v1/responses`` (``serving_responses.py``) runs on the chat path. Its ``instructions``,
the stored turns of ``previous_response_id`` and its ``input`` become one list of chat
messages for the model's chat template:

- ``input`` as a string: ``{"role": "user", "content": text}``;
- ``{"type": "message", "role", "content"}``: a message of that role (``developer`` as
  ``system``), its text parts joined with newlines;
- ``{"type": "reasoning", "content" or "summary"}``: the ``reasoning_content`` of the
  assistant message that follows it;
- ``{"type": "function_call", "call_id", "name", "arguments"}``: an entry of the assistant
  message's ``tool_calls`` (consecutive calls: one message);
- ``{"type": "function_call_output", "call_id", "output"}``: ``{"role": "tool",
  "tool_call_id", "name", "content"}``.

Other items (images, files, audio, built-in tools' calls, item references) are refused with
a 400 naming the item. A reasoning item that no assistant message follows describes no
turn and is left out.

``OutputItems`` builds a response's ``output`` from a choice's parsed deltas (reasoning,
content, tool calls; ``tool_choice.ChoiceStream``) and says each change as a Responses
stream event: an item is added, takes its deltas, and is done when the next one begins or
the output ends, so items never interleave and ``output_index`` counts up from 0.
"""

from __future__ import annotations

import uuid
from typing import Any

from pagedllm.entrypoints.openai.protocol import OpenAIError
from pagedllm.entrypoints.openai.tool_parsers import DeltaMessage, DeltaToolCall

_TEXT_PARTS = ("input_text", "output_text", "text")
# The id prefix of each item type (a function_call_output's otherwise).
_ID_PREFIXES = {"message": "msg", "reasoning": "rs", "function_call": "fc"}


def item_id(prefix: str) -> str:
    """An id in OpenAI's form: ``resp_``, ``msg_``, ``rs_``, ``fc_`` and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


# -- input items -> chat messages -----------------------------------------------------------
def input_messages(value: str | list[dict[str, Any]] | None) -> list[dict]:
    """The chat messages of a request's ``input`` (see the module docstring)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict] = []
    reasoning: str | None = None  # a reasoning item's text, for the next assistant message

    def assistant() -> dict:
        """The assistant message an output item of this turn belongs to."""
        nonlocal reasoning
        last = messages[-1] if messages else None
        if reasoning is None and last is not None and last["role"] == "assistant":
            return last
        message = {"role": "assistant", "content": ""}
        if reasoning is not None:
            message["reasoning_content"], reasoning = reasoning, None
        messages.append(message)
        return message

    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise OpenAIError(f"{where} must be an object (a message or another input item).",
                              param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(f"{where}.role must be 'user', 'system', 'developer' or "
                                  f"'assistant', got {role!r}.", param=f"{where}.role")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                message = assistant()
                if message["content"] or message.get("tool_calls"):
                    message = {"role": "assistant", "content": ""}
                    messages.append(message)
                message["content"] = text
            else:
                messages.append({"role": "system" if role == "developer" else role,
                                 "content": text})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, where)
        elif kind == "function_call":
            call_id, name, arguments = (item.get(k) for k in ("call_id", "name", "arguments"))
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise OpenAIError(f"{where} (a function_call) needs string call_id, name and "
                                  "arguments.", param=where)
            assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function",
                 "function": {"name": name, "arguments": arguments}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise OpenAIError(f"{where} (a function_call_output) needs a string call_id.",
                                  param=where)
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text(item.get("output"), f"{where}.output")})
        else:
            raise OpenAIError(f"{where} is an item of type {kind!r}: this server takes "
                              "message, reasoning, function_call and function_call_output "
                              "items.", param=where)
    return messages


def listed_items(value: str | list[dict[str, Any]] | None) -> list[dict]:
    """A request's ``input`` as ``GET /v1/responses/{id}/input_items`` lists it: each item
    with its ``type`` and an ``id`` (its own, or a new one), a message's content as parts
    (``input_text``; an assistant's ``output_text``). Checked by ``input_messages`` first."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    listed = []
    for item in value:
        item = {"type": "message", **item}
        if item["type"] == "message":
            if isinstance(item.get("content"), str):
                kind = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": item["content"]}]
            item.setdefault("status", "completed")
        item.setdefault("id", item_id(_ID_PREFIXES.get(item["type"], "fco")))
        listed.append(item)
    return listed


def name_tool_results(messages: list[dict]) -> list[dict]:
    """Each tool result given the ``name`` of the call it answers (chat templates print it;
    the Responses item carries only the call's id)."""
    names: dict[str, str] = {}
    for message in messages:
        for call in message.get("tool_calls") or ():
            names[call["id"]] = call["function"]["name"]
        if message["role"] == "tool" and "name" not in message:
            name = names.get(message["tool_call_id"])
            if name is not None:
                message["name"] = name
    return messages


def assistant_message(items: list[dict]) -> dict:
    """The chat message of a response's output items (to continue the conversation)."""
    message: dict = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "reasoning":
            message["reasoning_content"] = "".join(part["text"] for part in item["content"])
        elif item["type"] == "message":
            message["content"] += "".join(part["text"] for part in item["content"])
        else:
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    return message


def _text(content: Any, where: str) -> str:
    """A message's (or tool output's) text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where} must be a string or a list of text parts.", param=where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise OpenAIError(f"{where}[{index}] is a part of type {kind!r}: this server "
                              "accepts only text parts (input_text, output_text).",
                              param=f"{where}[{index}]")
    return "\n".join(texts)


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its ``content`` (reasoning_text parts), else its summary."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise OpenAIError(f"{where} (a reasoning item) needs content or summary as a list of "
                          '{"type", "text"} parts.', param=where)
    return "\n".join(part["text"] for part in parts)


# -- output items, and the stream events that build them -----------------------------------
class OutputItems:
    """A response's ``output`` as it grows from parsed deltas (``add``), and the events that
    tell a stream's client of each change (dicts without ``sequence_number``, which the
    stream numbers). ``close`` ends the open item."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None

    def add(self, delta: DeltaMessage | None) -> list[dict]:
        events: list[dict] = []
        if delta is None:
            return events
        if delta.reasoning_content:
            events += self._part("reasoning", "reasoning_text", delta.reasoning_content)
        if delta.content:
            events += self._part("message", "output_text", delta.content)
        for call in delta.tool_calls:
            events += self._call(call)
        return events

    def close(self, status: str = "completed") -> list[dict]:
        """Ends the open item with ``status`` ("completed", or "incomplete" when the output
        was cut short)."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        events: list[dict] = []
        if item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done", **where,
                           "name": item["name"], "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            done = {"type": f"response.{kind}.done", **where, "content_index": 0,
                    "text": part["text"]}
            if kind == "output_text":
                done["logprobs"] = []
            events += [done, {"type": "response.content_part.done", **where,
                              "content_index": 0, "part": dict(part)}]
        events.append({"type": "response.output_item.done", "output_index": where["output_index"],
                       "item": _copy(item)})
        return events

    def _begin(self, item: dict, part: dict | None) -> list[dict]:
        """Closes the open item and opens ``item`` (with its one content ``part``)."""
        events = self.close()
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        events.append({"type": "response.output_item.added", "output_index": index,
                       "item": _copy(item)})
        if part is not None:
            item["content"].append(part)
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": index, "content_index": 0, "part": dict(part)})
        return events

    def _part(self, item_type: str, part_type: str, text: str) -> list[dict]:
        """``text`` appended to the open item of ``item_type``, begun if need be."""
        events: list[dict] = []
        if self._open is None or self._open["type"] != item_type:
            if item_type == "message":
                item = {"id": item_id("msg"), "type": "message", "status": "in_progress",
                        "role": "assistant", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                        "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            events = self._begin(item, part)
        item = self._open
        item["content"][0]["text"] += text
        delta = {"type": f"response.{part_type}.delta", "item_id": item["id"],
                 "output_index": len(self.items) - 1, "content_index": 0, "delta": text}
        if part_type == "output_text":
            delta["logprobs"] = []
        return events + [delta]

    def _call(self, call: DeltaToolCall) -> list[dict]:
        """A call begins with its id and name; later deltas add to its arguments."""
        events: list[dict] = []
        if call.id is not None:
            events = self._begin({"id": item_id("fc"), "type": "function_call",
                                  "call_id": call.id, "name": call.name, "arguments": "",
                                  "status": "in_progress"}, None)
        item = self._open
        if call.arguments and item is not None and item["type"] == "function_call":
            item["arguments"] += call.arguments
            events.append({"type": "response.function_call_arguments.delta",
                           "item_id": item["id"], "output_index": len(self.items) - 1,
                           "delta": call.arguments})
        return events


def _copy(item: dict) -> dict:
    """A copy of ``item`` that later deltas do not change (the events are sent as built)."""
    copied = dict(item)
    if "content" in copied:
        copied["content"] = [dict(part) for part in copied["content"]]
    return copied
