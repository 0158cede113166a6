"""Tool calling over HTTP through the official openai client: ``tool_choice`` required and
named (enforced by a grammar, so even random weights call tools with valid arguments),
``auto`` with a tool-call parser, streaming deltas that add up to the full response, the
chat template seeing tools and earlier calls, and the 400s for malformed tool requests."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL_NAME, openai_client, started_server

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "unit": {"enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "$defs": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "type": "object",
    "properties": {"zone": {"$ref": "#/$defs/zone"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def create(client, **kw):
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 1.0)
    return client.chat.completions.create(model=MODEL_NAME, messages=kw.pop("messages", MESSAGES),
                                          tools=kw.pop("tools", TOOLS), **kw)


def check_calls(calls, only: str | None = None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == only if only else call.function.name in SCHEMAS
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def collect_stream(stream):
    """Per choice: (content, {index: [id, name, arguments]}, finish_reason), from the deltas."""
    choices: dict[int, list] = {}
    for chunk in stream:
        for choice in chunk.choices:
            content, calls, _ = choices.setdefault(choice.index, ["", {}, None])
            choices[choice.index][0] = content + (choice.delta.content or "")
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.index not in calls, "a call's id was sent twice"
                    calls[delta.index] = [delta.id, delta.function.name, ""]
                calls[delta.index][2] += delta.function.arguments or ""
            if choice.finish_reason:
                choices[choice.index][2] = choice.finish_reason
    return choices


def test_required_calls_validate_for_every_choice(client):
    response = create(client, tool_choice="required", n=4, seed=11)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls)


def test_required_with_parallel_tool_calls_false_makes_one_call(client):
    for choice in create(client, tool_choice="required", parallel_tool_calls=False, n=3,
                         seed=2).choices:
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls)


def test_named_function_is_called_with_valid_arguments(client):
    response = create(client, n=3, seed=5,
                      tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in response.choices:
        assert choice.finish_reason == "stop"  # as OpenAI answers a forced function
        check_calls(choice.message.tool_calls, only="get_time")


@pytest.mark.parametrize("tool_choice, seed", [
    ("required", 11), ({"type": "function", "function": {"name": "get_weather"}}, 21)])
def test_streamed_calls_add_up_to_the_full_response(client, tool_choice, seed):
    full = create(client, tool_choice=tool_choice, n=2, seed=seed)
    streamed = collect_stream(create(client, tool_choice=tool_choice, n=2, seed=seed, stream=True))
    for choice in full.choices:
        content, calls, finish = streamed[choice.index]
        assert finish == choice.finish_reason and content == ""
        assert [(name, args) for _, name, args in calls.values()] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_cut_by_max_tokens_is_the_call_begun(client, tool_choice):
    whole = create(client, tool_choice=tool_choice, temperature=0.0)
    # Greedy, so the same output, cut inside the last call's arguments.
    cut_at = whole.usage.completion_tokens - 4
    cut = create(client, tool_choice=tool_choice, temperature=0.0, max_tokens=cut_at)
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    expected = [(c.function.name, c.function.arguments)
                for c in whole.choices[0].message.tool_calls][:len(calls)]
    # The calls before the last as they were; the last one's arguments begun, not finished.
    assert calls[:-1] == expected[:-1] and calls[-1][0] == expected[-1][0]
    assert expected[-1][1].startswith(calls[-1][1].rstrip("}")) and calls[-1] != expected[-1]
    content, streamed, finish = collect_stream(create(client, tool_choice=tool_choice,
                                                      temperature=0.0, max_tokens=cut_at,
                                                      stream=True))[0]
    assert finish == "length" and content == ""
    assert [(name, args) for _, name, args in streamed.values()] == calls


@pytest.mark.parametrize("kw, param, message", [
    ({"tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"},
     "tools[0].function.name", "bad name!"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
      "tool_choice": "required"}, "tools", "wat"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "constrains the output already"),
])
def test_malformed_tool_requests_are_400s(client, kw, param, message):
    if kw.get("tools", TOOLS) is None:
        kw = {k: v for k, v in kw.items() if k != "tools"}
        call = lambda: client.chat.completions.create(  # noqa: E731
            model=MODEL_NAME, messages=MESSAGES, max_tokens=4, **kw)
    else:
        call = lambda: create(client, max_tokens=4, **kw)  # noqa: E731
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.body["param"] == param and message in info.value.body["message"]
    assert create(client, tool_choice="none", max_tokens=2).choices[0].finish_reason == "length"


# -- auto, with a parser -------------------------------------------------------------------
HERMES_CALL = ('<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "Paris", '
               '"unit": "celsius"\\}\\}\\n</tool_call>')


QWEN_TEMPLATE = Path(__file__).parent / "templates" / "qwen2_5_tools.jinja"
# Short enough for the tiny model's context once Qwen's template has listed it.
SHORT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def auto_server(server_model_dir, tmp_path_factory):
    """Qwen 2.5's chat template (it speaks the hermes format) and auto tool choice."""
    with started_server(server_model_dir, tmp_path_factory, "auto-tools", "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", "--chat-template", str(QWEN_TEMPLATE)) as remote:
        yield remote


@pytest.fixture(scope="module")
def qwen3_coder_server(server_model_dir, tmp_path_factory):
    with started_server(server_model_dir, tmp_path_factory, "qwen3-coder-tools",
                        "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
                        "--chat-template", str(QWEN_TEMPLATE)) as remote:
        yield remote


@pytest.fixture(scope="module")
def reasoning_server(server_model_dir, tmp_path_factory):
    with started_server(server_model_dir, tmp_path_factory, "reasoning", "--reasoning-parser",
                        "deepseek_r1", "--chat-template", str(QWEN_TEMPLATE)) as remote:
        yield remote


def test_tools_and_earlier_calls_render_as_transformers_renders_them(auto_server, server_model_dir):
    from transformers import AutoTokenizer

    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    with openai_client(auto_server) as client:
        reply = create(client, messages=messages, tools=SHORT_TOOLS, tool_choice="none",
                       max_tokens=1, extra_body={"return_token_ids": True})
    # transformers renders tool calls whose arguments are objects, as templates expect.
    hf_messages = json.loads(json.dumps(messages))
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "unit": "celsius"}
    tokenizer = AutoTokenizer.from_pretrained(server_model_dir)
    text = tokenizer.apply_chat_template(hf_messages, tools=SHORT_TOOLS, add_generation_prompt=True,
                                         tokenize=False, chat_template=QWEN_TEMPLATE.read_text())
    assert '"arguments": {"city": "Paris"' in text and "<tool_response>\n18 degrees" in text
    assert reply.model_extra["prompt_token_ids"] == tokenizer.encode(text, add_special_tokens=False)


def test_auto_reads_hermes_calls_streamed_or_not(auto_server):
    # The output is forced into the hermes format with a regex, as a model trained on it writes.
    body = {"guided_regex": "Let me check\\.\\n" + HERMES_CALL}
    with openai_client(auto_server) as client:
        full = create(client, tools=SHORT_TOOLS, extra_body=body)
        [choice] = full.choices
        assert (choice.message.content, choice.finish_reason) == ("Let me check.", "tool_calls")
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
        content, calls, finish = collect_stream(
            create(client, tools=SHORT_TOOLS, extra_body=body, stream=True))[0]
        assert (content, finish) == ("Let me check.", "tool_calls")
        assert [(n, a) for _, n, a in calls.values()] == [("get_weather", call.function.arguments)]


def test_auto_reads_qwen3_coder_calls_typed_by_the_request_tools(qwen3_coder_server):
    """Qwen3-Coder's format: each parameter's text is typed by the request's tool (days is
    an integer there), streamed or not."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer"}}}}}]
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    body = {"guided_regex": "Let me check\\.\n" + call}
    with openai_client(qwen3_coder_server) as client:
        [choice] = create(client, tools=tools, extra_body=body).choices
        assert (choice.message.content, choice.finish_reason) == ("Let me check.", "tool_calls")
        [made] = choice.message.tool_calls
        assert made.function.name == "get_weather"
        assert json.loads(made.function.arguments) == {"city": "Paris", "days": 3}
        content, calls, finish = collect_stream(
            create(client, tools=tools, extra_body=body, stream=True))[0]
        assert (content, finish) == ("Let me check.", "tool_calls")
        assert [(n, a) for _, n, a in calls.values()] == [("get_weather", made.function.arguments)]


def test_auto_without_a_call_is_plain_content(auto_server):
    with openai_client(auto_server) as client:
        choice = create(client, tools=SHORT_TOOLS,
                        extra_body={"guided_regex": "No tools needed"}).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (
        "No tools needed", [], "stop")


def test_reasoning_is_split_from_the_answer(reasoning_server):
    # A prompt that closes the reasoning (as templates do when thinking is off): the
    # constraint applies at once, and forces an output with reasoning and an answer.
    messages = [{"role": "system", "content": "<think>\n\n</think>"}, *MESSAGES]
    body = {"guided_regex": "<think>\nIt is sunny\\.\n</think>\n\nSunny\\."}
    with openai_client(reasoning_server) as client:
        message = create(client, messages=messages, tools=SHORT_TOOLS, tool_choice="none",
                         extra_body=body).choices[0].message
        assert (message.model_extra["reasoning_content"], message.content) == ("It is sunny.", "Sunny.")
        stream = create(client, messages=messages, tools=SHORT_TOOLS, tool_choice="none",
                        extra_body=body, stream=True)
        deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "It is sunny."
    assert "".join(d.content or "" for d in deltas) == "Sunny."


def test_a_constraint_waits_for_the_end_of_the_reasoning(reasoning_server):
    # The prompt leaves the model reasoning; a random model never writes </think>, so the
    # constraint never starts and the whole output is reasoning.
    body = {"guided_regex": "[0-9]"}
    with openai_client(reasoning_server) as client:
        choice = create(client, tools=SHORT_TOOLS, tool_choice="none", max_tokens=12, seed=1,
                        extra_body={**body, "ignore_eos": True}).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert len(choice.message.model_extra["reasoning_content"]) > 1


EFFORT_TEMPLATE = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                   "{% if reasoning_effort is defined %}[effort: {{ reasoning_effort }}]{% endif %}")


@pytest.fixture(scope="module")
def effort_server(server_model_dir, tmp_path_factory):
    with started_server(server_model_dir, tmp_path_factory, "effort",
                        "--chat-template", EFFORT_TEMPLATE) as remote:
        yield remote


def test_reasoning_effort_reaches_a_template_that_reads_it(effort_server, server, server_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server_model_dir)
    with openai_client(effort_server) as client:
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=1, reasoning_effort="low",
            extra_body={"return_token_ids": True})
    assert tokenizer.decode(reply.model_extra["prompt_token_ids"]).endswith("[effort: low]")
    # The demo model's template never reads it: refused, not ignored.
    with openai_client(server) as client, pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1,
                                       reasoning_effort="low")
    assert refused.value.body["param"] == "reasoning_effort"
