"""Reasoning parsers, by the name ``--reasoning-parser`` takes (see ``base`` for the contract)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning.base import ReasoningParser, ReasoningStream
from pagedllm.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from pagedllm.entrypoints.openai.reasoning.mistral import MistralReasoningParser
from pagedllm.entrypoints.openai.reasoning.qwen3 import Qwen3ReasoningParser
from pagedllm.entrypoints.openai.tool_parsers.base import registered

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser
    for parser in (DeepSeekR1ReasoningParser, MistralReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``; ValueError naming the known ones otherwise."""
    return registered(REASONING_PARSERS, name, "reasoning parser", "--reasoning-parser")


__all__ = [
    "REASONING_PARSERS", "DeepSeekR1ReasoningParser", "MistralReasoningParser", "Qwen3ReasoningParser",
    "ReasoningParser", "ReasoningStream", "get_reasoning_parser",
]
