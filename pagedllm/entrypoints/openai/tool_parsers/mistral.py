"""``mistral``: calls after the ``[TOOL_CALLS]`` special token.

Two forms, by tokenizer version:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (before v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}      (v11 and later)

In the v11 form ``[ARGS]`` may be missing (decoders that drop control tokens) and a
``[CALL_ID]...`` may sit between the name and ``[ARGS]`` (v13). Content may come before the
first ``[TOOL_CALLS]``, and after the calls. Markup that does not parse is content from its
``[TOOL_CALLS]`` to the end. ``[TOOL_CALLS]`` is a special token, so decoding must keep
special tokens; call ids are 9 alphanumerics, as Mistral's templates require.
"""

from __future__ import annotations

import re

from pagedllm.entrypoints.openai.tool_parsers.base import (
    HOLD, PartialCall, Segment, ToolParser, content_tail, read_json_calls,
)
from pagedllm.entrypoints.openai.tool_parsers.partial import (
    decode_json_at, dumps_json, parse_partial_json, skip_space, stable_dumps,
)

TOOL_CALLS = "[TOOL_CALLS]"
_V11_HEAD = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?")


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True
    id_kind = "mistral"

    def scan(self, text: str, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos = 0
        while (start := text.find(TOOL_CALLS, pos)) >= 0:
            segments.append(text[pos:start])
            found = _calls(text, start, final)
            if found is None:
                return [*segments, text[start:] if final else HOLD]
            calls, end = found
            segments.extend(calls)
            if end is None:
                return [*segments, HOLD]
            pos = end
        segments.extend(content_tail(text[pos:], (TOOL_CALLS,), final))
        return segments


def _calls(text: str, start: int, final: bool) -> tuple[list[PartialCall], int | None] | None:
    """The calls after the ``[TOOL_CALLS]`` at ``start`` (as ``read_json_calls`` gives them)."""
    body = skip_space(text, start + len(TOOL_CALLS))
    if text.startswith(("[", "{"), body):
        return read_json_calls(text, body, final)
    head = _V11_HEAD.match(text, body)
    if head is None or not text.startswith("{", args := skip_space(text, head.end())):
        return None
    decoded = decode_json_at(text, args)
    if decoded is not None:
        obj, end = decoded
        arguments = dumps_json(obj)
    else:
        partial = None if final else parse_partial_json(text[args:])
        if partial is None:
            return None
        (obj, closers), end = partial, None
        arguments = stable_dumps(obj, closers)
    if not isinstance(obj, dict):
        return None
    return [PartialCall(start, head.group(1), arguments)], end
