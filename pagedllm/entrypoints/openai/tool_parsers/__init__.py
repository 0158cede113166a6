"""Tool-call parsers, by the name ``--tool-call-parser`` takes (see ``base`` for the contract)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import (
    DeltaMessage, DeltaToolCall, ExtractedToolCalls, FunctionCall, ToolCall, ToolCallStream,
    ToolParser, make_tool_call_id, registered,
)
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.phi4_mini_json import Phi4MiniJsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic import (
    Llama4PythonicToolParser, PythonicToolParser,
)
from pagedllm.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, Llama4PythonicToolParser,
                   MistralToolParser, Phi4MiniJsonToolParser, PythonicToolParser,
                   Qwen3CoderToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``; ValueError naming the known ones otherwise."""
    return registered(TOOL_PARSERS, name, "tool call parser", "--tool-call-parser")


__all__ = [
    "TOOL_PARSERS", "DeltaMessage", "DeltaToolCall", "ExtractedToolCalls", "FunctionCall",
    "HermesToolParser", "Llama3JsonToolParser", "Llama4PythonicToolParser", "MistralToolParser",
    "Phi4MiniJsonToolParser", "PythonicToolParser", "Qwen3CoderToolParser", "ToolCall",
    "ToolCallStream", "ToolParser", "get_tool_parser", "make_tool_call_id",
]
