"""The README's structured-output and tool-calling example runs, as printed, against a
server of the bundled demo model (what ``make serve`` starts), on a free port."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.server.conftest import REPO_ROOT, RemoteServer, server_env


def readme_example(heading: str) -> str:
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_structured_output_example_runs_against_the_demo_model(tmp_path):
    code = readme_example("## Structured outputs and tool calling")
    assert 'base_url="http://localhost:8000/v1"' in code
    remote = RemoteServer(None, tmp_path / "server.log")
    try:
        script = code.replace("http://localhost:8000/v1", remote.api_url)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                timeout=300, env=server_env())
    finally:
        remote.stop()
    assert result.returncode == 0, result.stderr
    schema_line, regex_line, call_line, stream_line = result.stdout.splitlines()
    assert schema_line.startswith("{'name': ") and "'age': " in schema_line
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4} (happy|sad)", regex_line)
    assert call_line.startswith("tool_calls get_weather {'city': ")
    assert stream_line.startswith('get_weather{"city": ')
