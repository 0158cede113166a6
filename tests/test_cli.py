"""The ``pagedllm`` command as a user runs it."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import build_parser

REPO = Path(__file__).resolve().parents[1]


def pagedllm(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_generate_prints_prompt_and_completion_with_the_bundled_model():
    result = pagedllm("--log-level", "WARNING", "generate", "def add(a, b):", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def add(a, b):")
    assert "[length, 8 tokens]" in result.stdout or "[stop," in result.stdout


@pytest.fixture(scope="module")
def config_only_model(tmp_path_factory) -> Path:
    """qwen3-0.6b's built-in config shrunk to a tiny shape: no weights, no tokenizer."""
    config = json.loads((REPO / "pagedllm" / "model_configs" / "qwen3-0.6b" / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256)
    del config["bos_token_id"], config["eos_token_id"]  # no EOS: every output is full length
    path = tmp_path_factory.mktemp("qwen3-tiny")
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_generate_takes_token_id_prompts_and_prints_token_ids_without_a_tokenizer(config_only_model):
    result = pagedllm("--log-level", "WARNING", "generate", "--model", str(config_only_model),
                      "--load-format", "dummy", "--prompt-token-ids", "1,2,3",
                      "--prompt-token-ids", "4, 5", "--max-tokens", "4")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "prompt token ids: 1,2,3" and lines[3] == "prompt token ids: 4,5"
    for line in (lines[1], lines[4]):
        label, _, ids = line.partition(": ")
        assert label == "output token ids" and all(0 <= int(t) < 256 for t in ids.split(","))
        assert len(ids.split(",")) == 4
    assert lines[2] == lines[5] == "--- [length, 4 tokens]"


def test_text_prompt_without_a_tokenizer_points_to_prompt_token_ids(config_only_model):
    result = pagedllm("generate", "def f():", "--model", str(config_only_model),
                      "--load-format", "dummy")
    assert result.returncode == 2
    assert "--prompt-token-ids 1,2,3" in result.stderr and "Traceback" not in result.stderr


def test_refused_feature_exits_with_a_clear_message():
    result = pagedllm("generate", "x", "--enable-lora")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: --enable-lora (enable_lora=True) is not supported by pagedllm "
        "yet: drop --enable-lora (the enable_lora keyword in Python).")


@pytest.mark.parametrize("command", [["generate", "x"], ["serve", "--host", "127.0.0.1"]])
def test_cuda_without_a_usable_gpu_is_one_line_that_says_what_to_change(command):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, whatever this torch is
    result = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *command,
                             "--device", "cuda"], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 2
    assert result.stderr.startswith("error: --device cuda (device='cuda') needs an NVIDIA GPU")
    assert "--device cpu" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def all_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The command's parser and every subcommand's, by command line."""
    found = {parser.prog: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found.update(all_parsers(child))
    return found


def test_help_shows_plain_text_and_every_default(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    parsers = all_parsers(build_parser())
    assert {"pagedllm serve", "pagedllm generate", "pagedllm bench throughput"} <= set(parsers)
    for prog, parser in parsers.items():
        text = parser.format_help()
        assert "``" not in text and "(default: None)" not in text, prog
        # An option with no help text would show no default either.
        silent = [a.option_strings[0] for a in parser._actions
                  if a.option_strings and not a.help and a.default not in (None, False)
                  and a.help is not argparse.SUPPRESS and a.default is not argparse.SUPPRESS]
        assert not silent, (prog, silent)
    serve = " ".join(parsers["pagedllm serve"].format_help().split())
    for line in ("--port PORT Port to listen on. (default: 8000)",
                 "--max-num-seqs MAX_NUM_SEQS Most requests running at once (default: 512 on CUDA, "
                 "256 on the CPU).",
                 "--host HOST Interface to listen on (default: 0.0.0.0,",
                 "--enable-prefix-caching, --no-enable-prefix-caching Reuse the KV blocks of "
                 "shared prompt prefixes. (default: on)",
                 "--max-model-len MAX_MODEL_LEN Longest prompt + output, in tokens (default: "
                 "the model's max_position_embeddings)."):
        assert line in serve


def test_bench_throughput_writes_a_json_record(tmp_path):
    out = tmp_path / "tp.json"
    result = pagedllm("--log-level", "WARNING", "bench", "throughput", "--num-prompts", "4",
                      "--input-len", "8:16", "--output-len", "4:8", "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["num_prompts"] == 4 and record["output_tok_s"] > 0
    assert 4 * 4 <= record["output_tokens"] <= 4 * 8


def makefile_command(target: str) -> list[str]:
    """The command line of a one-line Makefile recipe, with $(VENV) as this interpreter's."""
    lines = (REPO / "Makefile").read_text().splitlines()
    recipe = lines[lines.index(next(line for line in lines if line.startswith(f"{target}:"))) + 1]
    assert recipe.startswith("\t"), recipe
    return shlex.split(recipe.strip().replace("$(VENV)", sys.prefix))


def test_make_bench_runs_the_demo_model_within_its_context(tmp_path):
    """The Makefile's bench workload fits the demo model: its lengths are checked against
    the context before any request runs, so eight of its prompts are enough to run."""
    command = makefile_command("bench")
    assert command[:3] == [str(Path(sys.prefix) / "bin" / "pagedllm"), "bench", "throughput"]
    out = tmp_path / "bench.json"
    result = subprocess.run([*command, "--num-prompts", "8", "--output-json", str(out)],
                            capture_output=True,
                            text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["model"] == "pagedllm-demo" and record["output_tokens"] > 0


def test_bench_throughput_default_lengths_are_scaled_to_the_context(tmp_path):
    out = tmp_path / "tp.json"
    result = pagedllm("--log-level", "WARNING", "bench", "throughput", "--num-prompts", "3",
                      "--max-model-len", "64", "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    assert ("Using --input-len 3:32 and --output-len 3:32: the defaults (100:1024 and 100:1024) "
            "scaled down to fit the model's 64-token context.") in result.stdout
    workload = json.loads(out.read_text())["workload_args"]
    assert workload["input_len"][1] + workload["output_len"][1] <= 64


def test_bench_throughput_refuses_lengths_beyond_the_context():
    result = pagedllm("bench", "throughput", "--num-prompts", "2", "--max-model-len", "64",
                      "--input-len", "16:48", "--output-len", "32")
    assert result.returncode == 2
    assert "--input-len 16:48 with --output-len 32 does not fit the model's 64-token context" in (
        result.stderr)


def test_bench_overhead_reports_step_cost(tmp_path):
    out = tmp_path / "overhead.json"
    result = pagedllm("bench", "overhead", "--num-requests", "16", "--steps", "5",
                      "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["num_requests"] == 16 and record["step_total_ms"] > 0


def test_bench_overhead_times_penalty_metadata_both_ways(tmp_path):
    out = tmp_path / "overhead.json"
    result = pagedllm("bench", "overhead", "--num-requests", "8", "--steps", "3", "--penalties",
                      "--vocab-size", "256", "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["vocab_size"] == 256
    assert record["penalty_metadata_kept_ms"] > 0 and record["penalty_metadata_afresh_ms"] > 0
    assert "penalty metadata per step" in result.stdout


def test_generate_constrains_its_output_with_the_structured_output_flags(tmp_path):
    schema = tmp_path / "point.json"
    schema.write_text(json.dumps({"type": "object", "additionalProperties": False,
                                  "required": ["x", "y"],
                                  "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                 "y": {"type": "integer", "minimum": 0, "maximum": 9}}}))
    result = pagedllm("--log-level", "WARNING", "generate", "p = ", "--max-tokens", "30",
                      "--json-schema", str(schema))
    assert result.returncode == 0, result.stderr
    completion = result.stdout.splitlines()[0].removeprefix("p = ")
    assert set(json.loads(completion)) == {"x", "y"} and "[stop," in result.stdout
    result = pagedllm("--log-level", "WARNING", "generate", "answer: ", "--choice", "yes",
                      "--choice", "no", "--temperature", "1", "--sampling-seed", "3")
    assert result.stdout.splitlines()[0] in ("answer: yes", "answer: no"), result.stdout
    result = pagedllm("generate", "x", "--regex", "a+", "--choice", "b")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: Give one output constraint, not --regex and --choice."
