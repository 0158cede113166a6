"""``bench latency`` and ``bench throughput`` with speculative decoding: the speculative
engine beside the plain one, acceptance, step costs and the speedups they report."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedllm.benchmarks import latency, throughput


def _args(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_cli_args(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def text_file(target_dir, tmp_path_factory):
    """A repetitive text (the tiny tokenizer's vocabulary): n-gram lookup finds proposals."""
    path = tmp_path_factory.mktemp("prompts") / "lines.txt"
    path.write_text("".join(f"value_{i % 7} = compute(value_{i % 5})\n" for i in range(200)))
    return path


@pytest.fixture
def engines_alive(monkeypatch) -> list[list[bool]]:
    """At each engine built, which engines built before are still alive (on a GPU an engine
    left alive keeps its memory, and the next one does not fit)."""
    import weakref

    import pagedllm

    built, alive = [], []

    class Tracked(pagedllm.LLM):
        def __init__(self, *args, **kwargs) -> None:
            alive.append([ref() is not None for ref in built])
            super().__init__(*args, **kwargs)
            built.append(weakref.ref(self.llm_engine.engine_core))

    monkeypatch.setattr(pagedllm, "LLM", Tracked)
    return alive


def engine_flags(target_dir) -> list[str]:
    return ["--model", str(target_dir), "--max-model-len", "96", "--num-kv-blocks", "64",
            "--block-size", "8", "--max-num-seqs", "4"]


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_latency_reports_acceptance_step_costs_and_speedups_per_k(
    target_dir, draft_dir, text_file, tmp_path, proposer, engines_alive
):
    out = tmp_path / "l1.json"
    spec, ks = ((["--speculative-method", "ngram"], [1, 3]) if proposer == "ngram"
                else (["--speculative-model", str(draft_dir)], [3]))
    latency.run(_args(latency, engine_flags(target_dir) + spec + [
        "--workload", "L1", "--speculative-k-values", ",".join(map(str, ks)),
        "--input-len", "24", "--output-len", "12", "--num-iters", "2",
        "--num-iters-warmup", "0", "--prompt-files", str(text_file), "--output-json", str(out)]))
    records = json.loads(out.read_text())
    assert [r["speculative"]["num_speculative_tokens"] for r in records] == ks
    # The plain engine serves every K; each speculative one is gone before the next.
    assert engines_alive == [[]] + [[True] + [False] * i for i in range(len(ks))]
    for record in records:
        s = record["speculative"]
        assert record["prompt_files"] == [str(text_file)]
        assert s["num_drafts"] > 0
        assert s["acceptance_rate"] == pytest.approx(
            s["num_accepted_tokens"] / s["num_draft_tokens"], abs=1e-4)
        assert s["mean_accepted_length"] == pytest.approx(
            1 + s["num_accepted_tokens"] / s["num_drafts"], abs=1e-3)
        assert 1 <= s["tokens_per_step"] <= s["num_speculative_tokens"] + 1
        assert s["predicted_speedup"] == pytest.approx(
            s["tokens_per_step"] * s["target_step_ms"] / (s["proposal_ms"] + s["verification_ms"]),
            rel=2e-3)
        assert s["measured_speedup"] == pytest.approx(
            s["plain_ms_per_token"] / s["ms_per_token"], rel=2e-3)
        assert s["efficiency"] == pytest.approx(s["measured_speedup"] / s["predicted_speedup"],
                                                abs=2e-3)
        if proposer == "draft":
            # One catch-up forward plus K - 1 one-token decodes a step (fewer near the end).
            assert 0 < s["draft_forwards_per_step"] <= s["num_speculative_tokens"]
            assert s["draft_step_ms"] > 0
        else:
            assert s["draft_step_ms"] == 0 and s["draft_forwards_per_step"] == 0


def test_latency_refuses_k_values_without_speculation(target_dir):
    with pytest.raises(ValueError, match="needs speculative decoding"):
        latency.run(_args(latency, engine_flags(target_dir) + ["--speculative-k-values", "2"]))


def test_throughput_runs_the_workload_with_and_without_speculation(target_dir, tmp_path,
                                                                   engines_alive):
    out = tmp_path / "w1.json"
    throughput.run(_args(throughput, engine_flags(target_dir) + [
        "--speculative-method", "ngram", "--num-speculative-tokens", "3", "--num-prompts", "4",
        "--input-len", "8:16", "--output-len", "12:20", "--temperature", "0",
        "--output-json", str(out)]))
    plain, spec = json.loads(out.read_text())
    assert engines_alive == [[], [False]]  # the speculative engine is gone first
    assert (plain["backend"], spec["backend"]) == ("pagedllm", "pagedllm+spec")
    assert plain["output_tokens"] == spec["output_tokens"]
    s = spec["speculative"]
    assert s["measured_speedup"] == pytest.approx(
        spec["output_tok_s"] / plain["output_tok_s"], rel=2e-3)
    assert s["num_drafts"] > 0 and s["decode_steps"] > 0 and s["verification_ms"] > 0
