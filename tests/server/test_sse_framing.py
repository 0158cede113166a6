"""Server-sent events read back whole by line-splitting clients."""

import json

import httpx

from pagedllm.entrypoints.openai.serving_engine import SSE_DONE, sse


def test_text_with_unicode_line_separators_stays_one_event_line() -> None:
    """Generated text may hold U+0085, U+2028 or U+2029, which httpx's ``iter_lines``
    (like ``str.splitlines``) breaks lines at; each event must still read as one line
    that decodes to the same text."""
    payload = {"choices": [{"index": 0, "text": "a\u2028b\x85c\u2029d \u00e9\u4e2d\n\r\t"}]}
    stream = (sse(payload) + sse({"choices": []}) + SSE_DONE).encode()
    lines = [line for line in httpx.Response(200, content=stream).iter_lines() if line]
    assert len(lines) == 3 and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][len("data: "):]) == payload
