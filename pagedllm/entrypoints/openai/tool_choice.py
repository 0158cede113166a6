"""Tools in a chat request: the checks, the constraint a forced call imposes, and the reader
that turns each choice's output into reasoning, content and tool calls.

``tool_choice`` (default ``"auto"`` with tools, ``"none"`` without):

| choice | prompt | output | ``tool_calls`` from |
| --- | --- | --- | --- |
| ``none`` | tools in the template | free text | nothing |
| ``auto`` | tools in the template | free text | the ``--tool-call-parser`` of the model's format |
| ``required`` | tools in the template | constrained: ``[{"name": ..., "arguments": {...}}, ...]`` | that JSON array |
| ``{"type": "function", "function": {"name": N}}`` | tools in the template | constrained: N's parameters schema | the output, as N's arguments |

The forced forms hold for any model, random weights included: the calls' arguments always
validate against the tools' parameter schemas. ``parallel_tool_calls: false`` allows one
call. Arguments are JSON text in one spelling (``json.dumps`` with non-ASCII kept), the same
streamed or not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError
from pagedllm.entrypoints.openai.reasoning import ReasoningParser
from pagedllm.entrypoints.openai.tool_parsers import (
    DeltaMessage, DeltaToolCall, ToolCall, ToolParser,
)
from pagedllm.entrypoints.openai.tool_parsers.base import HOLD, PartialCall, Segment, read_json_calls
from pagedllm.entrypoints.openai.tool_parsers.partial import (
    decode_json_at, dumps_json, parse_partial_json, skip_space, stable_dumps,
)
from pagedllm.structured.json_schema import resource_id

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass
class ToolPlan:
    """What a request's tools mean for its prompt, its constraint and its output."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict] | None  # for the chat template
    constraint: dict[str, Any] | None  # StructuredOutputsParams keywords (required, named)
    parser: ToolParser | None  # reads the calls (auto, required, named)
    single_call: bool = False  # parallel_tool_calls is false


def plan_tools(request: ChatCompletionRequest, auto_parser: ToolParser | None) -> ToolPlan:
    """Check ``tools`` / ``tool_choice`` (400s naming the field); ``auto_parser`` is the
    server's ``--tool-call-parser`` (None without ``--enable-auto-tool-choice``)."""
    tools = request.tools
    choice = request.tool_choice
    if not tools:
        if tools is not None:
            raise OpenAIError("tools is empty: give at least one tool, or remove tools.",
                              param="tools")
        if choice not in (None, "none"):
            raise OpenAIError("tool_choice needs tools: add tools, or remove tool_choice.",
                              param="tool_choice")
        return ToolPlan("none", None, None, None)
    functions = _check_tools(tools)
    single = request.parallel_tool_calls is False
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolPlan("none", tools, None, None)
    if choice == "auto":
        if auto_parser is None:
            raise OpenAIError(
                'tool_choice "auto" (the default with tools) needs the server to run with '
                "--enable-auto-tool-choice and --tool-call-parser: restart it so, or send "
                'tool_choice "required", a named function, or "none".', param="tool_choice")
        return ToolPlan("auto", tools, None, auto_parser.for_tools(tools), single)
    if choice == "required":
        return ToolPlan("required", tools, {"json": _required_schema(functions, single)},
                        RequiredCallsParser(), single)
    name = _named_function(choice)
    if name not in functions:
        raise OpenAIError(f"tool_choice names the function {name!r}, which is not in tools "
                          f"({', '.join(functions)}).", param="tool_choice")
    return ToolPlan("named", tools, {"json": _parameters(functions[name])},
                    NamedCallParser(name), True)


def _check_tools(tools: list[dict[str, Any]]) -> dict[str, dict]:
    """Each tool's function by name; a 400 for a malformed tool."""
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise OpenAIError(f'{where} must be {{"type": "function", "function": {{...}}}}; '
                              "only function tools are supported.", param=where)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise OpenAIError(f"{where}.function must be an object with a name.", param=where)
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise OpenAIError(f"{where}.function.name must be 1 to 64 letters, digits, '_', "
                              f"'.' or '-', got {name!r}.", param=f"{where}.function.name")
        if name in functions:
            raise OpenAIError(f"{where}: two tools are named {name!r}.", param=where)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise OpenAIError(f"{where}.function.parameters must be a JSON schema object.",
                              param=f"{where}.function.parameters")
        functions[name] = function
    return functions


def _named_function(choice: Any) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    raise OpenAIError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                      '"function": {"name": ...}}.', param="tool_choice")


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object"}


def _required_schema(functions: dict[str, dict], single: bool) -> dict:
    """An array of ``{"name", "arguments"}`` calls, each one tool's. Each tool's parameters
    are a schema resource of their own (``_tool_resource``), so the references inside them
    (``#/$defs/...``, ``#/definitions/...``, ``#``, their own ``$id``) resolve within them
    wherever they sit in the array's schema."""
    variants = []
    taken: set[str] = set()
    for name, function in functions.items():
        variants.append({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": _tool_resource(function, name, taken)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    schema = {"type": "array", "minItems": 1,
              "items": variants[0] if len(variants) == 1 else {"anyOf": variants}}
    if single:
        schema["maxItems"] = 1
    return schema


def _tool_resource(function: dict, name: str, taken: set[str]) -> dict:
    """The function's parameters as an embedded resource: ``$id`` their own (or their
    draft-4 ``id``), else ``urn:pagedllm:tool:<name>``, also for an id another tool took
    first (``taken``); their ``$schema`` kept, since drafts 3-7 read a ``$ref`` without the
    keywords beside it (the backend reads each resource's draft)."""
    parameters = dict(_parameters(function))
    resource = resource_id(parameters)
    if resource is None or resource in taken:
        resource = f"urn:pagedllm:tool:{name}"
    taken.add(resource)
    parameters["$id"] = resource
    return parameters


class RequiredCallsParser(ToolParser):
    """The output of ``tool_choice: "required"``: a JSON array of ``{"name", "arguments"}``.
    An output its grammar did not finish (cut by a length limit) gives the calls it began,
    the last with the arguments written so far, as its stream gave them."""

    name = "required"

    def scan(self, text: str, final: bool) -> list[Segment]:
        start = skip_space(text, 0)
        found = read_json_calls(text, start, final, args_required=True)
        if found is None and final:
            found = read_json_calls(text, start, False, args_required=True)
        if found is None:
            return [text] if final else [HOLD]
        calls, end = found
        return [*calls, HOLD] if end is None and not final else calls


class NamedCallParser(ToolParser):
    """The output of a named ``tool_choice``: the arguments object of that one function (of
    an output cut by a length limit, the arguments written so far, as its stream gave them)."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def scan(self, text: str, final: bool) -> list[Segment]:
        start = skip_space(text, 0)
        decoded = decode_json_at(text, start) if start < len(text) else None
        if decoded is not None and isinstance(decoded[0], dict):
            return [PartialCall(0, self.function_name, dumps_json(decoded[0]))]
        partial = parse_partial_json(text[start:])
        is_object = partial is not None and isinstance(partial[0], dict)
        arguments = stable_dumps(*partial) if is_object else None
        if not final:
            return [PartialCall(0, self.function_name, arguments or ""), HOLD]
        if not text.strip():
            return [PartialCall(0, self.function_name, "{}")]
        return [text] if arguments is None else [PartialCall(0, self.function_name, arguments)]


@dataclass
class ChoiceMessage:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


class ChoiceReader:
    """Splits a choice's output: reasoning first (``--reasoning-parser``), then the tool
    calls in what follows (the plan's parser); what is left is content."""

    def __init__(self, reasoning: ReasoningParser | None, plan: ToolPlan) -> None:
        self.reasoning = reasoning
        self.plan = plan

    def read(self, text: str) -> ChoiceMessage:
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.extract(text)
        calls: list[ToolCall] = []
        if self.plan.parser is not None and content is not None:
            extracted = self.plan.parser.extract(content)
            content, calls = extracted.content, extracted.tool_calls
            if self.plan.single_call:
                calls = calls[:1]
        return ChoiceMessage(reasoning, content, calls)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """The deltas of one streamed choice; ``num_calls`` counts the calls begun so far."""

    def __init__(self, reader: ChoiceReader) -> None:
        self._single = reader.plan.single_call
        self._reasoning = None if reader.reasoning is None else reader.reasoning.stream()
        self._tools = None if reader.plan.parser is None else reader.plan.parser.stream()
        self.num_calls = 0

    def feed(self, text: str) -> DeltaMessage | None:
        return self._step(text, final=False)

    def finish(self) -> DeltaMessage | None:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> DeltaMessage | None:
        delta = DeltaMessage(content=text)
        if self._reasoning is not None:
            delta = (self._reasoning.finish() if final else self._reasoning.feed(text)) or DeltaMessage()
        if self._tools is not None:
            found = self._tools.feed(delta.content) if delta.content else None
            if final:
                found = join_deltas(found, self._tools.finish())
            delta.content = found.content if found else None
            calls = found.tool_calls if found else []
            delta.tool_calls = [c for c in calls if not (self._single and c.index > 0)]
            self.num_calls = max([self.num_calls, *(c.index + 1 for c in delta.tool_calls)])
        if delta.content or delta.reasoning_content or delta.tool_calls:
            return delta
        return None


def join_deltas(first: DeltaMessage | None, second: DeltaMessage | None) -> DeltaMessage | None:
    """Two consecutive deltas of one choice as one: texts joined, a call's argument
    fragments joined when the second continues the first's last call."""
    if first is None or second is None:
        return first or second
    calls: list[DeltaToolCall] = list(first.tool_calls)
    for call in second.tool_calls:
        if calls and calls[-1].index == call.index and call.id is None:
            calls[-1] = DeltaToolCall(calls[-1].index, calls[-1].id, calls[-1].name,
                                      (calls[-1].arguments or "") + (call.arguments or ""))
        else:
            calls.append(call)
    return DeltaMessage(
        content=((first.content or "") + (second.content or "")) or None,
        reasoning_content=((first.reasoning_content or "") + (second.reasoning_content or "")) or None,
        tool_calls=calls,
    )
