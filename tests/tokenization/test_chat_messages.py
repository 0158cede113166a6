"""OpenAI chat messages as the server and ``LLM.chat`` hand them to chat templates
(``pagedllm.engine.chat_messages``: vLLM's conventions)."""

from __future__ import annotations

import pytest

from pagedllm.engine.chat_messages import ChatMessageError, messages_for_template

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_a_tool_calling_turn_reads_as_templates_expect():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL],
                 "reasoning_content": "Paris, then."},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C", "name": None}]
    user, assistant, tool = messages_for_template(messages)
    assert assistant["content"] == ""
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert {assistant[k] for k in ("reasoning_content", "reasoning", "thinking")} == {"Paris, then."}
    assert tool == {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}
    assert messages[1]["content"] is None  # the caller's messages are left as they were


def test_null_tool_calls_are_no_calls():
    (message,) = messages_for_template([{"role": "assistant", "content": "Hi", "tool_calls": None}])
    assert message == {"role": "assistant", "content": "Hi"}


@pytest.mark.parametrize("message, param", [
    ({"content": "no role"}, "messages[0]"),
    ({"role": "assistant", "tool_calls": {"id": "x"}}, "messages[0].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"id": "x"}]}, "messages[0].tool_calls"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{"}}]},
     "messages[0].tool_calls"),
])
def test_malformed_messages_are_errors_that_name_the_field(message, param):
    with pytest.raises(ChatMessageError) as failed:
        messages_for_template([message])
    assert failed.value.param == param

