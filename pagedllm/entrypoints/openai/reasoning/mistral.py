"""``mistral``: Magistral's reasoning between the ``[THINK]`` and ``[/THINK]`` special tokens.

    [THINK]The user asks ...[/THINK]The answer is 4.

An output that opens with ``[THINK]`` is reasoning up to ``[/THINK]`` (or to its end, when
generation stopped while thinking) and content after it; any other output is content
throughout, as a stream must decide on the first characters. The markers are special
tokens, so decoding keeps special tokens.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning.base import ReasoningParser


class MistralReasoningParser(ReasoningParser):
    name = "mistral"
    start_token = "[THINK]"
    end_token = "[/THINK]"
    keeps_special_tokens = True

    def split(self, text: str, final: bool) -> tuple[str, str]:
        if self.opens_undecided(text, final):
            return "", ""
        if text.lstrip().startswith(self.start_token):
            return self.split_reasoning_first(text, final)
        return "", text
