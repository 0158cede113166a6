"""The README's structured-output, tool-calling and Responses examples run, as printed,
against a server of the bundled demo model (what ``make serve`` starts), on a free port."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.server.conftest import REPO_ROOT, RemoteServer, server_env


def readme_example(heading: str) -> str:
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_examples(tmp_path, *headings: str) -> list[str]:
    """Each example's standard output, run in turn against one demo-model server."""
    remote = RemoteServer(None, tmp_path / "server.log")
    outputs = []
    try:
        for heading in headings:
            code = readme_example(heading)
            assert 'base_url="http://localhost:8000/v1"' in code
            script = code.replace("http://localhost:8000/v1", remote.api_url)
            result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                                    text=True, timeout=300, env=server_env())
            assert result.returncode == 0, result.stderr
            outputs.append(result.stdout)
    finally:
        remote.stop()
    return outputs


def test_structured_output_and_responses_examples_run_against_the_demo_model(tmp_path):
    structured, responses = run_examples(tmp_path, "## Structured outputs and tool calling",
                                         "### The Responses API")
    schema_line, regex_line, call_line, stream_line = structured.splitlines()
    assert schema_line.startswith("{'name': ") and "'age': " in schema_line
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4} (happy|sad)", regex_line)
    assert call_line.startswith("tool_calls get_weather {'city': ")
    assert stream_line.startswith('get_weather{"city": ')
    call_line, continued_line, stream_line = responses.splitlines()
    assert call_line.startswith('function_call get_weather {"city": ')
    assert re.fullmatch(r"(completed|incomplete) True", continued_line)
    assert stream_line == "True"
