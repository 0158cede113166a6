"""Reasoning parsers: split an output into its reasoning and its content.

Models that think first write ``<think>`` (often already in the prompt), their reasoning,
``</think>``, then the answer. The whitespace that only separates the reasoning from the
tags and from the answer is dropped; an empty part is None.

``ReasoningStream`` re-reads the text received so far on every delta and emits what grew:
``split(text, final=False)`` returns only what no later text can change (a possible
``</think>`` at the end, or whitespace that may turn out to separate parts, is held back), so
the deltas add up to ``split(whole output, final=True)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from pagedllm.entrypoints.openai.tool_parsers.base import DeltaMessage, TextStream
from pagedllm.entrypoints.openai.tool_parsers.partial import extension, held_suffix_len

if TYPE_CHECKING:
    from pagedllm.engine.tokenizer import Tokenizer


class ReasoningParser:
    """One reasoning format. Subclasses set ``name`` and implement ``split``."""

    name: ClassVar[str]
    start_token: str = "<think>"
    end_token: str = "</think>"
    # True when the markers are special tokens that must not be skipped in decoding.
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self.tokenizer = tokenizer

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) as a stream reads them; with ``final=False`` the text is a
        prefix of the output and both parts returned are prefixes of the final ones."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output."""
        reasoning, content = self.split(text, final=True)
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        """A new stream state, for one choice."""
        return ReasoningStream(self)

    def opens_undecided(self, text: str, final: bool) -> bool:
        """True while a partial output may still turn out to open with ``start_token``."""
        return not final and self.start_token.startswith(text.lstrip())

    def split_reasoning_first(self, text: str, final: bool) -> tuple[str, str]:
        """An output that opens in its reasoning (after an optional ``start_token``): the
        reasoning runs to ``end_token``, or to the end when there is none."""
        body = text.lstrip()
        if body.startswith(self.start_token):
            body = body[len(self.start_token):]
        end = body.find(self.end_token)
        if end < 0:
            if not final:
                body = body[: len(body) - held_suffix_len(body, (self.end_token,))]
            return body.strip(), ""
        return body[:end].strip(), body[end + len(self.end_token):].lstrip()


class ReasoningStream(TextStream):
    """The deltas of one streamed output (see the module docstring)."""

    def __init__(self, parser: ReasoningParser) -> None:
        super().__init__()
        self._parser = parser
        self._reasoning = ""
        self._content = ""

    def _emit(self, final: bool) -> DeltaMessage | None:
        reasoning, content = self._parser.split(self._text, final)
        delta = DeltaMessage(reasoning_content=extension(self._reasoning, reasoning) or None,
                             content=extension(self._content, content) or None)
        if delta.reasoning_content:
            self._reasoning = reasoning
        if delta.content:
            self._content = content
        return delta if delta.reasoning_content or delta.content else None
