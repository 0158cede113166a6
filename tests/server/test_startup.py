"""``pagedllm serve`` fails fast, non-zero and with a message that says what to change."""

from __future__ import annotations

import argparse
import subprocess

import pytest

from pagedllm.entrypoints.openai.cli_args import add_serve_args, validate_serve_args
from pagedllm.entrypoints.openai.serving_chat import load_chat_template
from tests.server.conftest import REPO_ROOT, free_port, serve_command, server_env


def run_serve(model_dir, *extra: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
    return subprocess.run(serve_command(model_dir, free_port(), *extra), cwd=REPO_ROOT,
                          env=server_env(), capture_output=True, text=True, timeout=timeout)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(list(argv))


def test_kv_cache_too_small_exits_nonzero_with_the_reason(server_model_dir):
    # serve_command asks for 512 blocks; the last --num-kv-blocks wins: 4 blocks = 64 tokens.
    result = run_serve(server_model_dir, "--num-kv-blocks", "4")
    assert result.returncode != 0
    assert "KV cache holds 64 tokens" in result.stderr
    assert "--max-model-len" in result.stderr


def test_unimplemented_flag_exits_nonzero_naming_it(server_model_dir):
    result = run_serve(server_model_dir, "--lora-modules", "a=b", timeout=60)
    assert result.returncode == 2
    assert "--lora-modules is not supported" in result.stderr


@pytest.mark.parametrize("flags, expected", [
    (["--tool-call-parser", "hermes"], "takes effect with --enable-auto-tool-choice"),
    (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "nope"],
     "Unknown tool call parser 'nope'.*hermes, llama3_json, llama4_pythonic, mistral, "
     "phi4_mini_json, pythonic, qwen3_coder"),
    (["--reasoning-parser", "r1"], "Unknown reasoning parser 'r1'.*deepseek_r1, mistral, qwen3"),
    (["--guided-decoding-backend", "xgrammar"], "'xgrammar' is not available"),
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile needs --ssl-certfile too"),
    (["--ssl-cert-reqs", "2"], "take effect with HTTPS"),
    (["--ssl-keyfile", "no/k.pem", "--ssl-certfile", "no/c.pem"], "no/k.pem: no such readable"),
    (["--port", "0"], "--port must be in 1..65535"),
    (["--api-key", " "], "--api-key is empty"),
    (["a-model", "--model", "another"], "The model is given twice"),
    (["--api-server-count", "0"], "--api-server-count must be >= 1"),
    (["--allowed-origins", "https://a.example"], "--allowed-origins takes a JSON list"),
    (["--api-server-count", "3", "--max-num-waiting", "2"],
     "split between the 3 API server processes: give at least 3"),
])
def test_serve_flags_are_checked_with_clear_messages(flags, expected):
    with pytest.raises(ValueError, match=expected):
        validate_serve_args(parse(*flags))


def test_vllm_flags_that_change_nothing_here_are_accepted():
    """Command lines copied from vLLM: --trust-remote-code (pagedllm runs no repository
    code) and --disable-log-requests (no request is logged) start the same server."""
    args = parse("--trust-remote-code", "--disable-log-requests")
    validate_serve_args(args)
    assert args.trust_remote_code and args.disable_log_requests


def test_positional_model_and_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_API_KEY", "from-env")
    args = parse("some/model")
    validate_serve_args(args)
    assert args.model == "some/model" and args.api_key == "from-env"


def test_chat_template_flag_takes_a_file_a_literal_or_a_name(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}").startswith("{%")
    assert load_chat_template("tool_use") == "tool_use"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template("no/such/file.jinja")


def test_an_unsupported_kv_cache_dtype_exits_nonzero_naming_the_flag(server_model_dir):
    result = run_serve(server_model_dir, "--kv-cache-dtype", "int8", timeout=60)
    assert result.returncode != 0
    assert "--kv-cache-dtype int8" in result.stderr and "use auto" in result.stderr
