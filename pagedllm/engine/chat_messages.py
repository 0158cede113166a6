"""OpenAI chat messages as chat templates read them, the conventions vLLM's server and
``LLM.chat`` follow (``Tokenizer.apply_chat_template`` itself renders messages as given,
as transformers does):

- ``content: null`` (an assistant turn that only calls tools) is the empty string: templates
  print ``None`` for it, or fail on it (``'NoneType' object is not iterable``);
- other keys whose value is null are left out (``"tool_calls": null`` means no calls);
- a tool call's ``arguments``, a JSON string in the OpenAI format, is the object it holds
  (templates write it with ``tojson``, or iterate over it);
- reasoning given under any of ``reasoning_content``, ``reasoning`` or ``thinking`` is
  given under all three (templates read one of them: Qwen3 and DeepSeek
  ``reasoning_content``, gpt-oss ``thinking``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


class ChatMessageError(ValueError):
    """A message a template cannot be given; ``param`` names it (``messages[1].tool_calls``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def messages_for_template(messages: list[Any]) -> list[dict]:
    """``messages`` (dicts, or pydantic models) by the conventions above."""
    return [message_for_template(index, message) for index, message in enumerate(messages)]


def message_for_template(index: int, message: Any) -> dict:
    """Message ``index`` of a conversation by the conventions above."""
    if callable(getattr(message, "model_dump", None)):
        message = message.model_dump()
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ChatMessageError(f"messages[{index}] must be an object with a string 'role', "
                               f"got {message!r}.", f"messages[{index}]")
    plain = {key: value for key, value in message.items() if value is not None}
    if plain.get("content") is None:
        plain["content"] = ""
    if "tool_calls" in plain:
        calls = plain["tool_calls"]
        if not isinstance(calls, list):
            raise _bad_calls(index)
        plain["tool_calls"] = [_call_for_template(index, call) for call in calls]
    reasoning = next((plain[k] for k in REASONING_FIELDS if k in plain), None)
    if reasoning is not None:
        plain.update(dict.fromkeys(REASONING_FIELDS, reasoning))
    return plain


def _call_for_template(index: int, call: Any) -> dict:
    """An assistant message's tool call with its ``arguments`` as an object."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise _bad_calls(index)
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise ChatMessageError(
                f"messages[{index}].tool_calls: the arguments of {function.get('name')!r} are "
                "not valid JSON.", f"messages[{index}].tool_calls") from None
    return {**call, "function": function}


def _bad_calls(index: int) -> ChatMessageError:
    return ChatMessageError(f"messages[{index}].tool_calls must be a list of "
                            '{"id", "type": "function", "function": {"name", "arguments"}}.',
                            f"messages[{index}].tool_calls")
