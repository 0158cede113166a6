"""Tool-call parsers: whole outputs, streamed outputs cut every way, malformed markup."""

from __future__ import annotations

import json
import random
import re

import pytest

from pagedllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS, HermesToolParser, Llama3JsonToolParser, MistralToolParser,
    Phi4MiniJsonToolParser, PythonicToolParser, Qwen3CoderToolParser, ToolParser, get_tool_parser, make_tool_call_id,
)
from pagedllm.entrypoints.openai.tool_parsers.partial import (
    dumps_json, parse_partial_json, stable_dumps,
)
from tests.tool_parsers import chunkings

WEATHER = {"city": "San Francisco", "unit": "celsius"}
# Unicode, escaped quotes, backslashes, control characters, nesting, every JSON type.
NOTE = {
    "title": 'Café "Le Dôme" ☕ 東京',
    "body": "Line 1\nLine 2\t\\ end 😀 </tool_call> [TOOL_CALLS]",
    "tags": ["food", "paris", []],
    "meta": {"rating": 4.5, "visits": 12, "visited": True, "closed": False, "notes": None,
             "hours": [{"open": 9, "close": 17.25}]},
}
LONG_TEXT = {"path": "notes/essay.md", "text": "word " * 60 + 'with "quotes" and ünïcödé'}


def streamed(parser: ToolParser, chunks: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) calls as a client rebuilds them from the deltas, checking
    the delta protocol on the way."""
    stream = parser.stream()
    deltas = [stream.feed(chunk) for chunk in chunks] + [stream.finish()]
    content, calls, ids = "", {}, set()
    for delta in filter(None, deltas):
        assert delta.content or delta.tool_calls, "an empty delta is returned as None"
        content += delta.content or ""
        for call in delta.tool_calls:
            if call.index not in calls:
                assert call.index == len(calls) and call.id not in ids and call.name
                calls[call.index] = [call.name, call.arguments or ""]
                ids.add(call.id)
            else:
                assert call.id is None and call.name is None and call.arguments
                calls[call.index][1] += call.arguments
    return content, [tuple(calls[i]) for i in range(len(calls))]


def extracted(parser: ToolParser, text: str) -> tuple[str, list[tuple[str, str]]]:
    result = parser.extract(text)
    calls = [(call.function.name, call.function.arguments) for call in result.tool_calls]
    return result.content or "", calls


def assert_streams_like_extract(parser: ToolParser, text: str) -> None:
    expected = extracted(parser, text)
    for chunks in chunkings(text):
        assert streamed(parser, chunks) == expected, chunks


def assert_extracts(parser: ToolParser, text: str, content: str | None,
                    calls: list[tuple[str, dict]]) -> None:
    result = parser.extract(text)
    assert result.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in result.tool_calls] == calls
    for call in result.tool_calls:
        assert call.type == "function"
        assert call.function.arguments == dumps_json(json.loads(call.function.arguments))


def hermes_block(name: str, arguments: dict) -> str:
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


# Each case: (text, content, calls); every one also streams exactly as it extracts.
HERMES_CASES = [
    (hermes_block("get_weather", WEATHER), None, [("get_weather", WEATHER)]),
    ("I'll check both cities.\n\n" + hermes_block("get_weather", {"city": "Paris"}) + "\n"
     + hermes_block("get_weather", {"city": "Tokyo"}),
     "I'll check both cities.", [("get_weather", {"city": "Paris"}),
                                 ("get_weather", {"city": "Tokyo"})]),
    ("<tool_call>\n" + json.dumps({"name": "save_note", "arguments": NOTE}) + "\n</tool_call>",
     None, [("save_note", NOTE)]),
    (hermes_block("a", {}) + "\nDone: the first call.\n" + hermes_block("b", {"x": [1, 2]})
     + "\n\nAll set.\n", "Done: the first call.\nAll set.\n", [("a", {}), ("b", {"x": [1, 2]})]),
    ('<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>', None,
     [("search", {"q": "x"})]),
    ('<tool_call>\n{"name": "get_time"}\n</tool_call>', None, [("get_time", {})]),
    ('<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}', None,
     [("get_time", {"tz": "UTC"})]),
    ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ("Write <tool> or <tool_call or </tool_call> in prose.\n",
     "Write <tool> or <tool_call or </tool_call> in prose.\n", []),
    ("Let me see.\n<tool_call>\nget_weather(city='Paris')\n</tool_call>",
     "Let me see.\n<tool_call>\nget_weather(city='Paris')\n</tool_call>", []),
    ('<tool_call>\n{"function": "get_weather", "city": "Paris"}\n</tool_call>\nok',
     '<tool_call>\n{"function": "get_weather", "city": "Paris"}\n</tool_call>\nok', []),
    (hermes_block("a", {}) + '\n<tool_call>{"name": 7}</tool_call>',
     '<tool_call>{"name": 7}</tool_call>', [("a", {})]),
    # Arguments written as a JSON string (Granite's models): the object it holds, else the
    # string itself.
    ('<tool_call>\n{"name": "get_config", "arguments": "{\\"param\\": \\"max_connections\\"}"}'
     '\n</tool_call>', None, [("get_config", {"param": "max_connections"})]),
    ('<tool_call>{"name": "echo", "arguments": "{oops"}</tool_call>', None, [("echo", "{oops")]),
]

LLAMA3_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "celsius"}}', None,
     [("get_weather", WEATHER)]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}', None,
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]),
    ("Let me look that up.\n<|python_tag|>"
     + json.dumps({"name": "save_note", "parameters": NOTE}, ensure_ascii=False),
     "Let me look that up.", [("save_note", NOTE)]),
    ('\n{"name": "a", "parameters": {}};\n{"name": "b", "parameters": {"n": -1.5e3}};',
     None, [("a", {}), ("b", {"n": -1500.0})]),
    ('{"name": "a", "parameters": {}}\n\nThat is all.', "That is all.", [("a", {})]),
    ("Sure, the answer is 42.", "Sure, the answer is 42.", []),
    ('{"answer": 42, "unit": "km"}', '{"answer": 42, "unit": "km"}', []),
    ('{"name": "Ada Lovelace", "born": 1815}', '{"name": "Ada Lovelace", "born": 1815}', []),
    ("Here is JSON: {\"a\": 1} and <|python_ta", "Here is JSON: {\"a\": 1} and <|python_ta", []),
    ('<|python_tag|>print("hello")', '<|python_tag|>print("hello")', []),
    # Calls after prose; objects of the prose that are no calls, and braces that are no JSON.
    ('Here is the result: {"name": "get_time", "parameters": {}} Would you like more?',
     "Here is the result:\nWould you like more?", [("get_time", {})]),
    ('The answer is {"answer": 42, "unit": "km"} and {"name": "x"}; use {x} in f-strings. '
     '{"name": "get_weather", "arguments": {"city": "Paris"}}',
     'The answer is {"answer": 42, "unit": "km"} and {"name": "x"}; use {x} in f-strings.',
     [("get_weather", {"city": "Paris"})]),
]

MISTRAL_CASES = [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "San Francisco", '
     '"unit": "celsius"}}, {"name": "get_time", "arguments": {"tz": "PST"}}]', None,
     [("get_weather", WEATHER), ("get_time", {"tz": "PST"})]),
    ("Let me check.[TOOL_CALLS] "
     + json.dumps([{"name": "save_note", "arguments": NOTE}], ensure_ascii=False),
     "Let me check.", [("save_note", NOTE)]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', None,
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ('Checking.[TOOL_CALLS]save_note[ARGS]' + json.dumps(NOTE), "Checking.",
     [("save_note", NOTE)]),
    ('[TOOL_CALLS]get_weather{"city": "Paris"}', None, [("get_weather", {"city": "Paris"})]),
    ('[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}\nDone.', "Done.",
     [("get_weather", {"city": "Paris"})]),
    ("No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    ("[TOOL_CALLS] I cannot do that.", "[TOOL_CALLS] I cannot do that.", []),
    ('Hm.[TOOL_CALLS][{"function": "f"}]', 'Hm.[TOOL_CALLS][{"function": "f"}]', []),
    ("A list: [TOOL_CALL", "A list: [TOOL_CALL", []),
]

PYTHONIC_CASES = [
    ('[get_weather(city="San Francisco", unit="celsius"), get_time(timezone=\'Europe/Paris\')]',
     None, [("get_weather", WEATHER), ("get_time", {"timezone": "Europe/Paris"})]),
    ("[create_event(title='Team \\'sync\\' ☕ \"now\"', attendees=[\"ana@example.com\", 'bo'], "
     "when={'day': 3, 'hour': 9.5, 'slots': (1, 2)}, remote=True, notes=None, n=-7)]", None,
     [("create_event", {"title": "Team 'sync' ☕ \"now\"", "attendees": ["ana@example.com", "bo"],
                        "when": {"day": 3, "hour": 9.5, "slots": [1, 2]}, "remote": True,
                        "notes": None, "n": -7})]),
    ("\n[get_time()]\n", None, [("get_time", {})]),
    ("[ search ( query = 'a) b] c' ) ]\nHere you go.", "Here you go.",
     [("search", {"query": "a) b] c"})]),
    ("Hello [world]!", "Hello [world]!", []),
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("[Note] keep this.", "[Note] keep this.", []),
    ("[get weather]", "[get weather]", []),
    # Llama 4's markers, kept when decoding keeps special tokens.
    ("<|python_start|>[get_weather(city='LA'), get_time()]<|python_end|>\nDone.", "Done.",
     [("get_weather", {"city": "LA"}), ("get_time", {})]),
    ("<|python_start|>[get_time()]", None, [("get_time", {})]),
]

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "lat": {"type": "number"}, "tags": {"type": "array"}, "where": {"type": "object"},
        "note": {"type": "string"}}}}}


# Unions as Pydantic writes them (``Optional[int]``, a nested model by ``$ref``).
RECORD_TOOL = {"type": "function", "function": {"name": "set_record", "parameters": {
    "type": "object", "$defs": {"Point": {"properties": {"x": {"type": "number"}}}},
    "properties": {
        "count": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "ratio": {"type": ["number", "null"]}, "flag": {"oneOf": [{"type": "boolean"},
                                                                  {"type": "null"}]},
        "point": {"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}]},
        "label": {"type": "string"}, "maybe": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "data": {"type": "object"}, "amount": {"type": ["integer", "boolean"]}}}}}


def qwen3_coder_parser() -> Qwen3CoderToolParser:
    """The parser as a request with ``WEATHER_TOOL`` and ``RECORD_TOOL`` gets it."""
    return Qwen3CoderToolParser().for_tools([WEATHER_TOOL, RECORD_TOOL])


def record_call(**values: str) -> str:
    parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function=set_record>\n{parameters}</function>\n</tool_call>"


QWEN3_CODER_CASES = [
    ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n"
     "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
     "Let me check.", [("get_weather", {"city": "San Francisco", "days": 3})]),
    # Every type; a value with newlines, tags of other formats and quotes kept as text;
    # an undeclared parameter as text; two functions in one block, then a second block.
    ("<tool_call>\n<function=get_weather>\n<parameter=extra>\n7\n</parameter>\n"
     "<parameter=metric>\nTrue\n</parameter>\n"
     "<parameter=lat>\n-33.5\n</parameter>\n<parameter=tags>\n[\"a\", 2]\n</parameter>\n"
     "<parameter=where>\n{'x': (1, 2)}\n</parameter>\n<parameter=note>\nline 1\n\n"
     "\"quoted\" </tool_call> ☕\n</parameter>\n"
     "</function>\n<function=get_weather>\n<parameter=days>\nnull\n</parameter>\n</function>\n"
     "</tool_call>\nDone.\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     "Done.", [("get_weather", {"extra": "7", "metric": True, "lat": -33.5,
                                "tags": ["a", 2], "where": {"x": [1, 2]},
                                "note": 'line 1\n\n"quoted" </tool_call> ☕'}),
               ("get_weather", {"days": None}), ("get_time", {})]),
    # Values that do not read as their type stay text; missing end tags (the next
    # parameter, not given yet, ends a value; generation stopped in the last block).
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n"
     "<parameter=lat>\nnan\n<parameter=city>\nOslo\n</parameter>\n<parameter=note>\nnullable"
     "\n</function>",
     None, [("get_weather", {"days": "three", "lat": "nan", "city": "Oslo",
                             "note": "nullable"})]),
    # A value holding the markup itself (a coding agent's fixture): a tag ends a value only
    # where the call's markup goes on around it.
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
     "<parameter=note>\nfixture = \"\"\"\n<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\nRome\n</parameter>\n<parameter=path>\nx\n</function>\n</tool_call>\n"
     "\"\"\"\n</parameter>\n<parameter=undeclared>\n1\n</parameter>\n</parameter>\n</function>\n"
     "</tool_call>\nDone.", "Done.",
     [("get_weather", {"city": "Oslo", "note": (
         'fixture = """\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n'
         '</parameter>\n<parameter=path>\nx\n</function>\n</tool_call>\n"""\n</parameter>\n'
         '<parameter=undeclared>\n1\n</parameter>')})]),
    # A bare function block (no wrapper).
    ("Sure: <function=get_weather><parameter=city>Paris</parameter></function> ok",
     "Sure:\nok", [("get_weather", {"city": "Paris"})]),
    # No function in the block, or no name: content as written.
    ("<tool_call>\nnot a call\n</tool_call> and <function=> here",
     "<tool_call>\nnot a call\n</tool_call> and <function=> here", []),
    ("Use <tool_call> tags for calls.", "Use <tool_call> tags for calls.", []),
    # Union types; "null" stays text for a string that may not be null, "None" is null where
    # null is allowed; an object given as a JSON string of its text.
    (record_call(count="42", ratio="0.5", flag="true", point='{"x": 1.5}', label="null",
                 maybe="None", data='"{\'key\': \'value\', \'n\': 1}"', amount="true"), None,
     [("set_record", {"count": 42, "ratio": 0.5, "flag": True, "point": {"x": 1.5},
                      "label": "null", "maybe": None, "data": {"key": "value", "n": 1},
                      "amount": True})]),
    # What reads as none of a union's types stays text.
    (record_call(count="many", ratio="None", amount="yes"), None,
     [("set_record", {"count": "many", "ratio": None, "amount": "yes"})]),
    # A template's placeholder left in the text is no function name.
    ("<tool_call>\n<function={{ tool.name }}>\n<parameter={{ k }}>\nv\n</parameter>\n</function>"
     "\n</tool_call>\n" + "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
     "</parameter>\n</function>\n</tool_call>",
     "<tool_call>\n<function={{ tool.name }}>\n<parameter={{ k }}>\nv\n</parameter>\n</function>"
     "\n</tool_call>", [("get_weather", {"city": "Oslo"})]),
]

ALL_CASES = [(HermesToolParser, case) for case in HERMES_CASES] + [
    (Llama3JsonToolParser, case) for case in LLAMA3_CASES] + [
    (MistralToolParser, case) for case in MISTRAL_CASES] + [
    (PythonicToolParser, case) for case in PYTHONIC_CASES]
PHI4_MINI_CASES = [
    ('functools[{"name": "get_weather", "arguments": {"city": "San Francisco", "unit": '
     '"celsius"}}, {"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}]', None,
     [("get_weather", WEATHER), ("get_time", {"timezone": "Europe/Paris"})]),
    ('Checking. functools [{"name": "note", "arguments": ' + json.dumps(NOTE) + '}]\nDone.',
     "Checking.\nDone.", [("note", NOTE)]),
    ("import functools\nfunctools.reduce(f, xs)", "import functools\nfunctools.reduce(f, xs)", []),
    ("functools[1, 2] and functools[]", "functools[1, 2] and functools[]", []),
]

ALL_CASES += [(qwen3_coder_parser, case) for case in QWEN3_CODER_CASES]
ALL_CASES += [(Phi4MiniJsonToolParser, case) for case in PHI4_MINI_CASES]
CASE_IDS = [f"{getattr(cls, 'name', 'qwen3_coder')}-{i}" for i, (cls, _) in enumerate(ALL_CASES)]


@pytest.mark.parametrize(("parser_cls", "case"), ALL_CASES, ids=CASE_IDS)
def test_extract_finds_calls_and_content(parser_cls, case):
    text, content, calls = case
    assert_extracts(parser_cls(), text, content, calls)


@pytest.mark.parametrize(("parser_cls", "case"), ALL_CASES, ids=CASE_IDS)
def test_stream_cut_anywhere_adds_up_to_extract(parser_cls, case):
    assert_streams_like_extract(parser_cls(), case[0])


def test_qwen3_coder_streams_a_text_value_as_it_is_generated_and_types_the_rest_whole():
    """A text parameter's value grows with the text (its closing newline held back); a
    typed one arrives whole once its end is certain; without the request's tools every
    value is text."""
    head = "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Fr"
    stream = qwen3_coder_parser().stream()
    first = stream.feed(head)
    assert first.tool_calls[0].name == "get_weather"
    assert first.tool_calls[0].arguments == '{"city": "San Fr'
    assert stream.feed("ancisco\n").tool_calls[0].arguments == "ancisco"
    assert stream.feed("</parameter>\n<parameter=days>\n1").tool_calls[0].arguments == '"'
    assert stream.feed("2\n") is None  # a number may still grow
    assert stream.feed("</parameter>") is None  # the tag may yet be text of the value
    assert stream.feed("\n<parameter=metric>").tool_calls[0].arguments == ', "days": 12'
    # The call's end is known once nothing can follow it that reopens its last value.
    assert stream.feed("\ntrue\n</parameter>\n</function>\n</tool_call>") is None
    assert stream.finish().tool_calls[0].arguments == ', "metric": true}'
    untyped = Qwen3CoderToolParser().extract(head + "\n</parameter><parameter=days>2</parameter>"
                                             "</function></tool_call>")
    assert json.loads(untyped.tool_calls[0].function.arguments) == {"city": "San Fr", "days": "2"}


RENDERERS = {
    "hermes": (HermesToolParser, lambda calls: "Sure.\n" + "\n".join(
        hermes_block(name, args) for name, args in calls)),
    "llama3_json": (Llama3JsonToolParser, lambda calls: "<|python_tag|>" + "; ".join(
        json.dumps({"name": name, "parameters": args}, ensure_ascii=False)
        for name, args in calls)),
    "mistral": (MistralToolParser, lambda calls: "[TOOL_CALLS]" + json.dumps(
        [{"name": name, "arguments": args} for name, args in calls])),
    "mistral_v11": (MistralToolParser, lambda calls: "".join(
        f"[TOOL_CALLS]{name}[ARGS]{json.dumps(args)}" for name, args in calls)),
    "phi4_mini_json": (Phi4MiniJsonToolParser, lambda calls: "functools" + json.dumps(
        [{"name": name, "arguments": args} for name, args in calls])),
}


@pytest.mark.parametrize("form", RENDERERS)
def test_random_arguments_stream_like_extract(form):
    """Seeded random argument objects (strings full of escapes and brackets, numbers, nesting)
    in each JSON format, streamed in random cuts."""
    parser_cls, render = RENDERERS[form]
    parser = parser_cls()
    rng = random.Random(7)
    for _ in range(25):
        calls = [(f"tool_{i}", _random_object(rng)) for i in range(rng.randint(1, 3))]
        text = render(calls)
        assert_extracts(parser, text, "Sure." if form == "hermes" else None, calls)
        expected = extracted(parser, text)
        cuts = list(chunkings(text, seed=rng.randrange(100), num_random=8))
        for chunks in cuts[-9:]:
            assert streamed(parser, chunks) == expected


def test_qwen3_coder_random_values_stream_like_extract():
    """Seeded random text values (quotes, backslashes, newlines, brackets, non-ASCII, tag
    fragments) and typed numbers, in blocks with and without end tags, streamed in random
    cuts."""
    properties = {**{f"p{i}": {"type": "string"} for i in range(3)}, "days": {"type": "integer"}}
    parser = Qwen3CoderToolParser().for_tools([{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": properties}}}])
    rng = random.Random(11)
    alphabet = ["a", " ", '"', "\\", "\n", "é", "😀", "<", ">", "/", "=", "<parameter", "</"]
    for _ in range(40):
        calls, blocks = [], []
        for _ in range(rng.randint(1, 3)):
            values = {f"p{i}": "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10)))
                      for i in range(rng.randint(0, 3))}
            # "null" reads as null; a whole tag cannot be a value's text in this format.
            values = {k: v for k, v in values.items()
                      if v.lower() != "null" and "<parameter=" not in v}
            params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
            days = rng.randint(-5, 500)
            calls.append(("get_weather", {**values, "days": days}))
            blocks.append(f"<tool_call>\n<function=get_weather>\n{params}"
                          f"<parameter=days>\n{days}\n</parameter>\n</function>\n</tool_call>")
        text = "Sure.\n" + "\n".join(blocks)
        assert_extracts(parser, text, "Sure.", calls)
        expected = extracted(parser, text)
        for chunks in list(chunkings(text, seed=rng.randrange(100), num_random=8))[-9:]:
            assert streamed(parser, chunks) == expected


def _random_object(rng: random.Random, depth: int = 0) -> dict:
    return {_random_string(rng): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _random_value(rng: random.Random, depth: int):
    kind = rng.randrange(6 if depth < 3 else 4)
    if kind == 0:
        return _random_string(rng) * 3
    if kind == 1:
        return rng.choice([0, -1, 17, 3.25, -0.5, 1e21, 12345678901234567890])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return _random_string(rng)
    if kind == 4:
        return _random_object(rng, depth)
    return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def _random_string(rng: random.Random) -> str:
    alphabet = ["a", "Z", " ", '"', "\\", "\n", "é", "😀", "東", "]", "}", "{", ",", ":", "/"]
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))


@pytest.mark.parametrize(("parser_cls", "text", "held"), [
    (HermesToolParser, "Let me check. <tool_", " <tool_"),
    (Llama3JsonToolParser, "Looking it up <|python", " <|python"),
    (MistralToolParser, "One moment.\n[TOOL_CA", "\n[TOOL_CA"),
    (PythonicToolParser, "[get_weather", "[get_weather"),
])
def test_possible_marker_is_held_back_then_flushed(parser_cls, text, held):
    stream = parser_cls().stream()
    delta = stream.feed(text)
    assert (delta.content if delta else "") == text[: len(text) - len(held)]
    assert stream.finish().content == held


@pytest.mark.parametrize(("parser_cls", "text"), [
    (HermesToolParser, hermes_block("write_file", LONG_TEXT)),
    (Llama3JsonToolParser, json.dumps({"name": "write_file", "parameters": LONG_TEXT})),
    (MistralToolParser, "[TOOL_CALLS]" + json.dumps([{"name": "write_file",
                                                      "arguments": LONG_TEXT}])),
    (MistralToolParser, "[TOOL_CALLS]write_file[ARGS]" + json.dumps(LONG_TEXT)),
])
def test_long_string_arguments_stream_as_they_are_generated(parser_cls, text):
    stream = parser_cls().stream()
    arguments = ""
    for char in text[: text.index("with")]:
        delta = stream.feed(char)
        arguments += "".join(call.arguments or "" for call in delta.tool_calls) if delta else ""
    assert arguments == '{"path": "notes/essay.md", "text": "' + "word " * 60


def test_pythonic_call_arguments_arrive_whole_when_the_call_closes():
    text = "[get_weather(city='Paris', unit='celsius'), get_time(tz='UTC')]"
    stream = PythonicToolParser().stream()
    deltas = [(i, delta) for i, char in enumerate(text) if (delta := stream.feed(char))]
    calls = [(i, c.index, c.name, c.arguments) for i, delta in deltas for c in delta.tool_calls]
    assert calls == [
        (text.index("("), 0, "get_weather", None),
        (text.index(")"), 0, None, '{"city": "Paris", "unit": "celsius"}'),
        (text.index("(", text.index(")")), 1, "get_time", None),
        (len(text) - 2, 1, None, '{"tz": "UTC"}'),
    ]
    assert stream.finish() is None


@pytest.mark.parametrize(("parser_cls", "text", "name", "streamed_arguments"), [
    (HermesToolParser, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     "get_weather", '{"city": "Par'),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Paris"}, "x": [}',
     "get_weather", '{"city": "Paris"}'),
    (MistralToolParser, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, 5]',
     "get_weather", '{"city": "Paris"}'),
    (PythonicToolParser, "[get_weather(city=San_Francisco)]", "get_weather", ""),
])
def test_call_that_breaks_after_its_name_was_streamed(parser_cls, text, name, streamed_arguments):
    """extract() reads the markup as content; a stream cannot withdraw the call it began, so
    the call stays as streamed and the markup's text follows as content, as extract has it."""
    parser = parser_cls()
    assert parser.extract(text).tool_calls == []
    assert parser.extract(text).content == text
    for chunks in chunkings(text):
        assert streamed(parser, chunks)[0] == text
    assert streamed(parser, list(text))[1] == [(name, streamed_arguments)]


GARBAGE = [
    "", " ", "\n\n", "<tool_call>", "<tool_call></tool_call>", "<tool_call>{]</tool_call>",
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "</tool_call>",
    '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>',
    "[TOOL_CALLS]", "[TOOL_CALLS][", "[TOOL_CALLS][]", "[TOOL_CALLS]f[ARGS]",
    "[TOOL_CALLS]f[ARGS][1]",
    "[TOOL_CALLS]{", '[TOOL_CALLS]{"name": ""}', "<|python_tag|>", "<|python_tag|>{", "{", "{}",
    '{"name": "f", "parameters": 3}', '{"name": "f", "parameters": {}} {"name"', ";;", "[", "[f(",
    "[f(a=1", "[f(1)]", "[f(**kw)]", "[f(a={1, 2})]", "[f(a=1e999)]", "[f(a=b'x')]", "[f()][0]",
    "[f(a=1) for f in g]", "[f(a=__import__('os').getcwd())]", "[" * 300, "{" * 300,
    '<tool_call>{"name": "f", "arguments": ' + "[" * 300, "\ud83d", '{"name": "\\ud83d',
]


@pytest.mark.parametrize("parser_cls", TOOL_PARSERS.values())
def test_malformed_markup_never_raises(parser_cls):
    parser = parser_cls()
    for text in GARBAGE:
        result = parser.extract(text)
        for call in result.tool_calls:
            json.loads(call.function.arguments)
        for chunks in ([text], list(text)):
            streamed(parser, chunks)


def test_python_is_never_evaluated():
    text = "[f(a=__import__('os').getcwd())]"
    assert PythonicToolParser().extract(text).content == text
    assert PythonicToolParser().extract(text).tool_calls == []


def test_tool_call_ids():
    assert re.fullmatch(r"call_[0-9a-f]{24}", make_tool_call_id())
    assert re.fullmatch(r"[A-Za-z0-9]{9}", make_tool_call_id("mistral"))
    with pytest.raises(ValueError, match="mistral"):
        make_tool_call_id("uuid")
    text = MISTRAL_CASES[0][0]
    ids = [c.id for c in MistralToolParser().extract(text).tool_calls]
    ids += [c.id for c in MistralToolParser().stream().feed(text).tool_calls]
    assert len(set(ids)) == 4 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    hermes_ids = [c.id for c in HermesToolParser().extract(HERMES_CASES[1][0]).tool_calls]
    assert len(set(hermes_ids)) == 2 and all(i.startswith("call_") for i in hermes_ids)


def test_only_mistral_needs_special_tokens_kept():
    assert {name for name, cls in TOOL_PARSERS.items() if cls.keeps_special_tokens} == {"mistral"}


def test_registry_names_the_parsers():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "llama4_pythonic", "mistral",
                                 "phi4_mini_json", "pythonic", "qwen3_coder"}
    for name, cls in TOOL_PARSERS.items():
        assert get_tool_parser(name) is cls and cls.name == name


def test_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"'qwen'.*hermes, llama3_json, llama4_pythonic, "
                                         r"mistral, phi4_mini_json, pythonic, qwen3_coder"):
        get_tool_parser("qwen")


@pytest.mark.parametrize("doc", [
    '{"text": "caf\\u00e9 \\ud83d\\ude00 \\"q\\" \\\\ \\/ end", "n": [1, 22, -3.5e2], "t": true}',
    '{"a": {"b": [{"c": null}, [], {}]}, "d": false, "e": 1234567890123456789012}',
    '{ "spaced" : [ "x]}" , { "k" : "}{[" } ] , "f" : 0.25 }',
])
def test_stable_json_prefix_is_a_prefix_of_the_final_text(doc):
    final = dumps_json(json.loads(doc))
    prefixes = [stable_dumps(*parsed) for i in range(len(doc) + 1)
                if (parsed := parse_partial_json(doc[:i])) is not None]
    assert all(final.startswith(prefix) for prefix in prefixes)
    assert prefixes[-1] == final


def test_half_a_surrogate_pair_is_held_back():
    value, closers = parse_partial_json('{"e": "x\\ud83d')
    assert stable_dumps(value, closers) == '{"e": "x'
    value, closers = parse_partial_json('{"e": "x\\ud83d\\ude00')
    assert stable_dumps(value, closers) == '{"e": "x😀'


def test_stable_json_prefix_of_random_documents_in_any_layout():
    rng = random.Random(3)
    for _ in range(150):
        value = _random_object(rng)
        doc = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]),
                         separators=rng.choice([None, (",", ":"), (" , ", " : ")]))
        final = dumps_json(value)
        for i in range(len(doc) + 1):
            parsed = parse_partial_json(doc[:i])
            assert parsed is None or final.startswith(stable_dumps(*parsed)), doc[:i]
        assert stable_dumps(*parse_partial_json(doc)) == final
