"""Every endpoint of the OpenAPI schema the server publishes, fuzzed with schemathesis:
no request, however malformed, gets a 5xx, and the server keeps serving afterwards."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("schemathesis", reason="schemathesis is in the test extra")

# Examples per operation and phase: the whole run stays around half a minute on 2 cores.
MAX_EXAMPLES = 10


def test_fuzzed_requests_never_get_a_server_error(server, http, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{server.base_url}/openapi.json",
         "--checks", "not_a_server_error", "--max-examples", str(MAX_EXAMPLES),
         "--seed", "1", "--request-timeout", "60"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)  # its cache stays out of the tree
    assert result.returncode == 0, result.stdout[-4000:]
    assert "passed" in result.stdout
    assert http.get("/health").status_code == 200
    reply = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 1
