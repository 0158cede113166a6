"""Input limits, the API key on every route, and errors that never leak internals: the app
of ``build_app`` in-process (a stand-in engine), plus the limits on a live server."""

from __future__ import annotations

import hmac
import inspect

import httpx
import pytest
from fastapi.testclient import TestClient
from starlette.routing import Route

from pagedllm.entrypoints.openai import api_server
from pagedllm.entrypoints.openai.protocol import INTERNAL_ERROR_MESSAGE
from pagedllm.entrypoints.openai.serving_engine import RequestLimits
from tests.server.app_stub import stub_app
from tests.server.conftest import MODEL_NAME

KEY = "sk-limits"
OPEN = {"/health", "/metrics", "/version", "/"}


def concrete(path: str) -> str:
    """A route path with its parameters filled in."""
    import re

    return re.sub(r"\{[^}]+\}", "x", path)


def test_with_an_api_key_only_health_metrics_version_and_the_playground_are_open():
    app, _ = stub_app(api_key=KEY)
    routes = [r for r in app.routes if isinstance(r, Route)]
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/openapi.json",
            "/docs"} <= {r.path for r in routes}
    with TestClient(app, raise_server_exceptions=False) as client:
        for route in routes:
            for method in sorted(route.methods):
                response = client.request(method, concrete(route.path))
                if route.path in OPEN:
                    assert response.status_code != 401, (method, route.path)
                else:
                    assert response.status_code == 401, (method, route.path)
                    if method != "HEAD":
                        assert response.json()["error"]["code"] == "invalid_api_key"
                    keyed = client.request(method, concrete(route.path),
                                           headers={"Authorization": f"Bearer {KEY}"})
                    assert keyed.status_code != 401, (method, route.path)
        assert client.get("/no/such/path").status_code == 401  # unknown paths reveal nothing


def test_pages_of_the_allowed_origins_may_call_the_api_from_a_browser():
    """CORS (--allowed-origins and friends): a preflight from an allowed origin is answered
    before the key is asked for (browsers send none with it), the answers name that origin,
    and another origin gets no permission."""
    cors = {"allow_origins": ["https://app.example"], "allow_methods": ["*"],
            "allow_headers": ["*"], "allow_credentials": False}
    app, _ = stub_app(api_key=KEY, cors=cors)
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with TestClient(app) as client:
        allowed = client.options("/v1/chat/completions", headers=preflight)
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        other = client.options("/v1/chat/completions",
                               headers={**preflight, "Origin": "https://elsewhere.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        answer = client.get("/v1/models", headers={"Origin": "https://app.example",
                                                   "Authorization": f"Bearer {KEY}"})
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "https://app.example"


def test_a_server_lets_pages_of_any_origin_call_it_by_default(http):
    preflight = http.options("/v1/responses", headers={
        "Origin": "https://any.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"


def test_the_api_key_is_compared_in_constant_time():
    source = inspect.getsource(api_server.APIKeyMiddleware)
    assert "hmac.compare_digest" in source and hmac.compare_digest is not None


def test_an_unexpected_handler_error_is_a_generic_500_without_internals(caplog):
    app, _ = stub_app()
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert response.status_code == 500
    assert response.json() == {"error": {"message": INTERNAL_ERROR_MESSAGE,
                                         "type": "server_error", "param": None, "code": None}}
    assert "stand-in engine" not in response.text and "Traceback" not in response.text
    assert "stand-in engine runs nothing" in caplog.text  # the log keeps the details


def test_body_over_the_limit_is_413_naming_the_flag_whether_sized_or_chunked():
    app, _ = stub_app(limits=RequestLimits(max_request_body_bytes=1000))
    body = b'{"prompt": "' + b"a" * 2000 + b'"}'
    with TestClient(app, raise_server_exceptions=False) as client:
        sized = client.post("/v1/completions", content=body,
                            headers={"Content-Type": "application/json"})
        chunked = client.post("/v1/completions", content=iter([body[:600], body[600:]]),
                              headers={"Content-Type": "application/json"})
    for response in (sized, chunked):
        assert response.status_code == 413
        error = response.json()["error"]
        assert "--max-request-body-bytes" in error["message"] and "1000" in error["message"]
        assert error["code"] == "request_too_large"


LIMIT_CASES = [
    ({"n": 129}, "n", "--max-n"),
    ({"best_of": 129, "n": 129}, "n", "--max-n"),
    ({"stop": [f"s{i}" for i in range(65)]}, "stop", "--max-stop-sequences"),
    ({"logprobs": 21}, "logprobs", "20"),
    ({"max_tokens": 5000}, "max_tokens", "context length"),
]


@pytest.mark.parametrize("fields,param,names", LIMIT_CASES)
def test_completion_past_a_limit_is_400_naming_it(http, fields, param, names):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and names in error["message"]


def test_chat_past_a_limit_is_400_naming_it(http):
    base = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for fields, param, names in [({"n": 1000}, "n", "--max-n"),
                                 ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
                                 ({"stop": ["x"] * 65}, "stop", "--max-stop-sequences")]:
        response = http.post("/v1/chat/completions", json={**base, **fields})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and names in error["message"]


def test_limits_at_their_value_are_accepted(http):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, "n": 128,
            "stop": [f"s{i}" for i in range(64)], "logprobs": 20}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 128


def test_live_body_over_the_limit_is_413(server):
    body = b'{"model": "tiny", "prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}'
    response = httpx.post(f"{server.api_url}/completions", content=body, timeout=60,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert "--max-request-body-bytes" in response.json()["error"]["message"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
