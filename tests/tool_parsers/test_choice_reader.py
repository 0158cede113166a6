"""A chat choice's output read whole and streamed agree, however it is cut: reasoning first,
then the calls of the plan's parser (auto's format, ``required``'s array, a named
function's arguments), then the content."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.reasoning import get_reasoning_parser
from pagedllm.entrypoints.openai.tool_choice import (
    ChoiceReader, NamedCallParser, RequiredCallsParser, ToolPlan, join_deltas,
)
from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser

CASES = {
    "reasoning_then_hermes": (
        "deepseek_r1", ToolPlan("auto", [], None, get_tool_parser("hermes")()),
        '<think>The user wants "weather".</think>Checking.\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2]}}\n</tool_call>'),
    "required_array": (
        None, ToolPlan("required", [], {}, RequiredCallsParser()),
        '[{"name":"get_weather","arguments":{"city":"Paris \\"FR\\""}},'
        '{"name":"get_time","arguments":{"zone":"UTC"}}]'),
    "named_arguments": (
        None, ToolPlan("named", [], {}, NamedCallParser("get_time"), single_call=True),
        '{"zone":"CET","verbose":true,"nested":{"a":[1,2.5,null]}}'),
    "plain_content_with_reasoning": (
        "qwen3", ToolPlan("none", None, None, None), "<think>\nhmm\n</think>\n\nThe answer is 4."),
}


def streamed(reader: ChoiceReader, chunks: list[str]):
    stream, total = reader.stream(), None
    for chunk in chunks:
        total = join_deltas(total, stream.feed(chunk))
    return join_deltas(total, stream.finish()), stream.num_calls


@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_deltas_add_up_to_the_whole_reading_at_every_cut(name):
    reasoning, plan, text = CASES[name]
    reader = ChoiceReader(get_reasoning_parser(reasoning)() if reasoning else None, plan)
    whole = reader.read(text)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for chunks in cuts:
        delta, num_calls = streamed(reader, chunks)
        assert (delta.reasoning_content if delta else None) == whole.reasoning
        assert (delta.content if delta else None) == whole.content
        calls = delta.tool_calls if delta else []
        assert num_calls == len(whole.tool_calls) == len(calls)
        assert [(c.name, c.arguments) for c in calls] == [
            (c.function.name, c.function.arguments) for c in whole.tool_calls]
        for call in whole.tool_calls:
            json.loads(call.function.arguments)
