"""``qwen3``: Qwen3 models, whose thinking can be switched off.

    <think>
    The user asks ...
    </think>

    The answer is 4.

``extract``: an output with ``</think>`` has reasoning up to it (a leading ``<think>`` is
dropped) and content after it. Without ``</think>`` the whole output is content: thinking was
off (the template then writes an empty think block into the prompt).

A stream cannot wait for ``</think>`` to decide, so it decides on the output's first
characters: one that opens with ``<think>`` is reasoning up to ``</think>`` and content after;
any other is content throughout, ``</think>`` included. The two readings differ only for an
output that opens with ``<think>`` and never closes it (the stream has sent it as reasoning,
``extract`` calls it content) and for one with ``</think>`` but no ``<think>`` (the stream has
sent it all as content). Models that keep ``<think>`` in the prompt (Qwen3 thinking-only
releases) write the latter: serve those with ``deepseek_r1``.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def split(self, text: str, final: bool) -> tuple[str, str]:
        if self.opens_undecided(text, final):
            return "", ""
        if text.lstrip().startswith(self.start_token):
            return self.split_reasoning_first(text, final)
        return "", text

    def extract(self, text: str) -> tuple[str | None, str | None]:
        if self.end_token not in text:
            return None, text or None
        reasoning, content = self.split_reasoning_first(text, final=True)
        return reasoning or None, content or None
