"""Admission under a burst of arrivals: each request reaches the engine as soon as its own
body is parsed, not after every other arrival has had its turn on the event loop (the
engine would otherwise idle while the API process works through the burst)."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import TypeAdapter, ValidationError

from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from tests.server.app_stub import stub_app


class OneToken:
    """A request stream that yields one finished output."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.done = False

    def __aiter__(self) -> "OneToken":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        self.done = True
        return RequestOutput(self.request_id, None, [1, 2, 3], None,
                             [CompletionOutput(0, "x", [7], finish_reason="length")],
                             finished=True)

    def close(self) -> None:
        pass


async def call(app, body: bytes) -> list[dict]:
    """One POST /v1/completions through the ASGI app; the ASGI messages it sent back. The
    client never leaves (``receive`` after the body waits forever)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "root_path": "", "query_string": b"", "server": ("testserver", 80),
             "client": ("testclient", 1234),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if pending:
            return pending.pop()
        await asyncio.Event().wait()

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def test_a_burst_of_requests_reaches_the_engine_one_by_one_as_each_is_parsed():
    app, engine = stub_app()
    entered: list[int] = []  # requests that have entered the app
    seen_at_submit: list[int] = []  # how many had entered when each reached the engine

    def add_request(request_id, prompt, params, **kwargs):
        seen_at_submit.append(len(entered))
        return OneToken(request_id)

    engine.add_request = add_request

    async def one(index: int) -> list[dict]:
        body = json.dumps({"model": "stub", "prompt": [1, 2, 3], "max_tokens": 1,
                           "stream": index % 2 == 0}).encode()
        entered.append(index)
        return await call(app, body)

    async def burst() -> list[list[dict]]:
        return await asyncio.gather(*(one(i) for i in range(8)))

    results = asyncio.run(burst())
    # Streaming and full responses alike: submitted before the next arrival was looked at.
    assert seen_at_submit == list(range(1, 9))
    for index, sent in enumerate(results):
        assert sent[0]["status"] == 200
        body = b"".join(m.get("body", b"") for m in sent[1:])
        if index % 2 == 0:
            first_event, done = body.split(b"\n\n")[:2]
            assert json.loads(first_event[len(b"data: "):])["choices"][0]["text"] == "x"
            assert done == b"data: [DONE]"
        else:
            assert json.loads(body)["choices"][0]["text"] == "x"


def test_prompt_forms_validate_as_the_plain_union_does():
    """Token-id prompts take a strict fast path; every form ends as the union decides."""
    union = TypeAdapter(str | list[str] | list[int] | list[list[int]])
    for prompt in ["hi", ["a", "b"], [1, 2], [[1], [2, 3]], [1.0, 2.0], [True, 2], ["1", "2"],
                   [], [1, "a"], [1, None], [[1], 2]]:
        try:
            expected = union.validate_python(prompt)
        except ValidationError:
            with pytest.raises(ValidationError):
                CompletionRequest.model_validate({"model": "m", "prompt": prompt})
            continue
        got = CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt
        assert got == expected and type(got) is type(expected), prompt
        if isinstance(got, list) and got:
            assert [type(x) for x in got] == [type(x) for x in expected], prompt
