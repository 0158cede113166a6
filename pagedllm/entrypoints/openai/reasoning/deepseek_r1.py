"""``deepseek_r1``: the output opens inside the reasoning (DeepSeek-R1, QwQ, and thinking
models whose chat template writes ``<think>`` into the prompt).

    <think>            (optional: it may be in the prompt)
    The user asks ...
    </think>

    The answer is 4.

Everything up to ``</think>`` is reasoning, what follows is content. Without ``</think>``
(generation stopped while thinking) the whole output is reasoning and the content is None.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def split(self, text: str, final: bool) -> tuple[str, str]:
        if self.opens_undecided(text, final):
            return "", ""
        return self.split_reasoning_first(text, final)
