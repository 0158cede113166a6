"""``mistral``: Magistral's reasoning between the ``[THINK]`` and ``[/THINK]`` special tokens.

    [THINK]The user asks ...[/THINK]The answer is 4.

Read as ``qwen3`` reads ``<think>``: an output that opens with ``[THINK]`` is reasoning up to
``[/THINK]`` and content after it; any other output is content throughout. Unlike ``qwen3``,
a whole output that opens with ``[THINK]`` and never closes it is reasoning (generation
stopped while thinking), as a stream reads it too. The markers are special tokens, so
decoding keeps special tokens.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.reasoning.base import ReasoningParser
from pagedllm.entrypoints.openai.reasoning.qwen3 import Qwen3ReasoningParser


class MistralReasoningParser(Qwen3ReasoningParser):
    name = "mistral"
    start_token = "[THINK]"
    end_token = "[/THINK]"
    keeps_special_tokens = True

    extract = ReasoningParser.extract  # the stream's reading, whole
