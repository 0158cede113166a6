"""Reasoning parsers, by the name ``--reasoning-parser`` takes (see ``base`` for the contract)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning.base import ReasoningParser, ReasoningStream
from pagedllm.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from pagedllm.entrypoints.openai.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``; ValueError naming the known ones otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"Unknown reasoning parser {name!r} (--reasoning-parser): "
                         f"choose one of {known}.") from None


__all__ = [
    "REASONING_PARSERS", "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser",
    "ReasoningParser", "ReasoningStream", "get_reasoning_parser",
]
