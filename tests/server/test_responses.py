"""``/v1/responses`` through the official openai client: a response is the chat completion
of the same conversation (the same prompt, the same greedy text), ``previous_response_id``
continues a stored conversation, function tools come back as ``function_call`` items whose
arguments validate, the stream's events build the final response (the SDK's own stream
helper checks them), reasoning comes as a reasoning item, and what is not implemented is a
400 that names the field."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.protocol import OpenAIError
from pagedllm.entrypoints.openai.responses_items import OutputItems, input_messages
from pagedllm.entrypoints.openai.tool_parsers import DeltaMessage, DeltaToolCall
from tests.server.conftest import MODEL_NAME, openai_client, started_server

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather.",
          "parameters": WEATHER},
         {"type": "function", "name": "get_time", "parameters": TIME}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# Renders every field a conversation's messages carry, so that two requests render alike
# only when their conversations are the same.
EVERY_FIELD_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %}({{ m.tool_call_id }} {{ m.name }}){% endif %}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def create(client, **kw):
    kw.setdefault("max_output_tokens", 24)
    kw.setdefault("temperature", 0.0)
    return client.responses.create(model=MODEL_NAME, **kw)


def chat(client, messages, **kw):
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0.0,
                                          **kw)


def calls_of(response) -> list:
    calls = [item for item in response.output if item.type == "function_call"]
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


# -- input items as chat messages -------------------------------------------------------------
def test_input_items_become_the_chat_conversation():
    items = [
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                         {"type": "input_text", "text": "there"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_a", "name": "get_time", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "noon"},
        {"type": "function_call_output", "call_id": "call_b",
         "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "function_call", "call_id": "call_c", "name": "get_time", "arguments": "{}"},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi\nthere"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Look it up.",
         "tool_calls": [
             {"id": "call_a", "type": "function",
              "function": {"name": "get_time", "arguments": "{}"}},
             {"id": "call_b", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "noon"},
        {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_c", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}}]},
    ]
    assert input_messages("Hello") == [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize("item, param", [
    ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
     "input[0].content[0]"),
    ({"type": "web_search_call", "id": "ws_1"}, "input[0]"),
    ({"type": "item_reference", "id": "msg_1"}, "input[0]"),
    ({"role": "tool", "content": "x"}, "input[0].role"),
    ({"type": "function_call", "call_id": "c", "name": "f"}, "input[0]"),
])
def test_input_items_this_server_cannot_run_are_refused(item, param):
    with pytest.raises(OpenAIError) as info:
        input_messages([item])
    assert info.value.param == param


def test_output_events_add_up_to_the_items_however_the_deltas_fall():
    deltas = [DeltaMessage(reasoning_content="Think"), DeltaMessage(reasoning_content=" more"),
              DeltaMessage(reasoning_content=".", content="Sure: "),
              DeltaMessage(content="calling.",
                           tool_calls=[DeltaToolCall(0, "call_a", "f", '{"x"')]),
              DeltaMessage(tool_calls=[DeltaToolCall(0, None, None, ": 1}"),
                                       DeltaToolCall(1, "call_b", "g", "{}")])]
    streamed = OutputItems()
    events = [e for delta in deltas for e in streamed.add(delta)] + streamed.close("incomplete")
    whole = OutputItems()
    whole.add(DeltaMessage(reasoning_content="Think more.", content="Sure: calling.",
                           tool_calls=[DeltaToolCall(0, "call_a", "f", '{"x": 1}'),
                                       DeltaToolCall(1, "call_b", "g", "{}")]))
    whole.close("incomplete")
    strip = lambda items: [{k: v for k, v in item.items() if k != "id"} for item in items]
    assert strip(streamed.items) == strip(whole.items)
    assert [item["type"] for item in streamed.items] == ["reasoning", "message", "function_call",
                                                         "function_call"]
    assert [item["status"] for item in streamed.items] == ["completed"] * 3 + ["incomplete"]
    # Each item is added, takes its deltas, and is done before the next is added.
    opened: list[int] = []
    texts: dict[int, str] = {}
    for event in events:
        kind, index = event["type"], event["output_index"]
        if kind == "response.output_item.added":
            assert index == len(opened) and (not opened or opened[-1] is None)
            opened.append(index)
        elif kind == "response.output_item.done":
            assert opened[-1] == index and event["item"] == streamed.items[index]
            opened[-1] = None
        else:
            assert opened[-1] == index
            if kind.endswith(".delta"):
                texts[index] = texts.get(index, "") + event["delta"]
    assert texts == {0: "Think more.", 1: "Sure: calling.", 2: '{"x": 1}', 3: "{}"}


# -- the shared server ------------------------------------------------------------------------
def test_a_response_is_the_chat_completion_of_its_conversation(client):
    response = create(client, instructions="You are terse.", input="Once upon a time")
    reference = chat(client, [{"role": "system", "content": "You are terse."},
                              {"role": "user", "content": "Once upon a time"}])
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == reference.choices[0].message.content
    assert response.usage.input_tokens == reference.usage.prompt_tokens
    assert response.usage.output_tokens == reference.usage.completion_tokens
    assert response.usage.total_tokens == reference.usage.total_tokens
    assert response.instructions == "You are terse." and response.model == MODEL_NAME
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    if reference.choices[0].finish_reason == "length":
        assert response.status == "incomplete" and message.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None


def test_previous_response_id_continues_the_stored_conversation(client):
    first = create(client, instructions="Old rules.", input="Tell me a story",
                   max_output_tokens=12)
    second = create(client, previous_response_id=first.id, instructions="New rules.",
                    input=[{"role": "user", "content": "Go on"}])
    # The earlier turns, not the earlier instructions, begin the conversation.
    reference = chat(client, [{"role": "system", "content": "New rules."},
                              {"role": "user", "content": "Tell me a story"},
                              {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "Go on"}])
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == reference.usage.prompt_tokens
    assert second.output_text == reference.choices[0].message.content

    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    with pytest.raises(openai.BadRequestError):
        client.responses.retrieve(first.id, stream=True)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        create(client, previous_response_id=first.id, input="Again")
    assert info.value.body["param"] == "previous_response_id"


def test_input_items_lists_a_stored_request_s_input_in_pages(client):
    items = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "More"}]}]
    response = create(client, input=items, max_output_tokens=4)
    newest_first = client.responses.input_items.list(response.id)
    assert [(item.role, item.content[0].text) for item in newest_first.data] == [
        ("user", "More"), ("assistant", "Hello"), ("user", "Hi")]
    assert newest_first.data[1].content[0].type == "output_text"
    page = client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [item.content[0].text for item in page.data] == ["Hi", "Hello"] and page.has_more
    rest = client.responses.input_items.list(response.id, order="asc", after=page.data[-1].id)
    assert [item.content[0].text for item in rest.data] == ["More"] and not rest.has_more
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(response.id, limit=0)


def test_store_false_keeps_nothing(client):
    response = create(client, input="Hello", store=False, max_output_tokens=4)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_required_and_named_tool_choice_return_valid_function_calls(client):
    required = create(client, input="Weather in Oslo?", tools=TOOLS, tool_choice="required",
                      temperature=1.0, extra_body={"seed": 3}, max_output_tokens=120)
    assert required.status == "completed" and calls_of(required)
    single = create(client, input="Weather?", tools=TOOLS, tool_choice="required",
                    parallel_tool_calls=False, temperature=1.0, extra_body={"seed": 4},
                    max_output_tokens=120)
    assert len(calls_of(single)) == 1 and single.parallel_tool_calls is False
    named = create(client, input="Time?", tools=TOOLS,
                   tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=60)
    [call] = calls_of(named)
    assert call.name == "get_time"
    assert named.tool_choice.name == "get_time" and named.tools[1].name == "get_time"


def test_a_forced_call_cut_by_max_output_tokens_is_an_incomplete_function_call(client):
    kw = {"input": "Weather?", "tools": TOOLS,
          "tool_choice": {"type": "function", "name": "get_weather"}}
    whole = create(client, max_output_tokens=120, **kw)
    cut_at = whole.usage.output_tokens - 4  # greedy: the same output, cut in its arguments
    cut = create(client, max_output_tokens=cut_at, **kw)
    [call] = cut.output
    assert cut.status == "incomplete" and call.type == "function_call"
    assert call.status == "incomplete" and call.name == "get_weather"
    assert whole.output[0].arguments.startswith(call.arguments) and call.arguments != "{"
    events = list(create(client, max_output_tokens=cut_at, stream=True, **kw))
    [streamed] = events[-1].response.output
    assert (streamed.arguments, streamed.status) == (call.arguments, "incomplete")


def test_empty_tools_are_no_tools_and_a_forced_call_outranks_text_format(client):
    plain = create(client, input="Hello", tools=[], max_output_tokens=4)
    assert plain.tools == [] and plain.output[0].type == "message"
    # What instructor and agent libraries send: a forced call and a format for text.
    forced = create(client, input="Time?", tools=TOOLS, tool_choice="required",
                    text={"format": {"type": "json_schema", "name": "t", "schema": TIME}},
                    temperature=1.0, extra_body={"seed": 6}, max_output_tokens=120)
    assert calls_of(forced) and forced.text.format.type == "json_schema"


def test_the_stream_helper_builds_the_final_response_from_the_events(client):
    with client.responses.stream(model=MODEL_NAME, input="Time?", tools=TOOLS,
                                 tool_choice="required", temperature=1.0, extra_body={"seed": 5},
                                 max_output_tokens=120) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    assert arguments == "".join(call.arguments for call in calls_of(final))
    assert client.responses.retrieve(final.id).output[0].arguments == final.output[0].arguments


def test_a_streamed_text_adds_up_to_the_response_made_without_streaming(client):
    full = create(client, input="Once upon a time", max_output_tokens=16)
    events = list(create(client, input="Once upon a time", max_output_tokens=16, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text
    last = events[-1]
    assert last.type == f"response.{full.status}" and last.response.output_text == text
    assert last.response.usage.output_tokens == full.usage.output_tokens


class City(BaseModel):
    name: str = Field(max_length=10)
    capital: bool


def test_text_format_json_schema_parses_into_the_model(client):
    response = client.responses.parse(model=MODEL_NAME, input="A city", text_format=City,
                                      max_output_tokens=80, temperature=1.0, extra_body={"seed": 2})
    assert response.status == "completed"
    assert isinstance(response.output_parsed, City)


@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"truncation": "auto"}, "truncation"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}, "tools": TOOLS},
     "tool_choice"),
    ({"text": {"format": {"type": "json_object"}}, "extra_body": {"guided_regex": "a+"}},
     "text.format"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"extra_body": {"return_token_ids": True}}, "return_token_ids"),
])
def test_what_is_not_implemented_is_a_400_naming_the_field(client, kw, param):
    kw.setdefault("input", "Hello")
    with pytest.raises(openai.BadRequestError) as info:
        create(client, **kw)
    assert info.value.body["param"] == param
    assert create(client, input="Still serving", max_output_tokens=2).usage.output_tokens >= 1


# -- reasoning, and conversations with every kind of item ---------------------------------------
@pytest.fixture(scope="module")
def reasoning_client(server_model_dir, tmp_path_factory):
    with started_server(server_model_dir, tmp_path_factory, "responses-reasoning",
                        "--reasoning-parser", "deepseek_r1",
                        "--chat-template", EVERY_FIELD_TEMPLATE) as remote:
        with openai_client(remote) as c:
            yield c


def test_function_call_items_render_as_the_chat_messages_do(reasoning_client):
    items = [{"role": "user", "content": "Time?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Ask the clock."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_time",
              "arguments": '{"zone": "UTC"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "noon"}]
    messages = [{"role": "user", "content": "Time?"},
                {"role": "assistant", "content": None, "reasoning_content": "Ask the clock.",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_time",
                                              "arguments": '{"zone": "UTC"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "name": "get_time", "content": "noon"}]
    response = create(reasoning_client, input=items)
    reference = chat(reasoning_client, messages)
    assert response.usage.input_tokens == reference.usage.prompt_tokens
    [reasoning] = response.output
    assert reasoning.type == "reasoning"
    assert reasoning.content[0].text == reference.choices[0].message.reasoning_content


def test_reasoning_comes_as_a_reasoning_item_and_counts_its_tokens(reasoning_client):
    with reasoning_client.responses.stream(model=MODEL_NAME, input="Think", temperature=0.0,
                                           max_output_tokens=12) as stream:
        events = list(stream)
    final = events[-1].response
    # deepseek_r1: an output with no end marker is reasoning throughout.
    [item] = final.output
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert item.type == "reasoning" and item.content[0].text == text != ""
    assert final.usage.output_tokens_details.reasoning_tokens == final.usage.output_tokens
