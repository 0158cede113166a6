"""``scripts/schedule_sim.py``: the engine's scheduler on a fixed-length shape under a
step-time model, and the admission policies it weighs against it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import schedule_sim  # noqa: E402


def test_requests_that_outgrow_the_cache_are_recomputed_unless_their_growth_is_reserved():
    shape = dict(prompt_len=32, output_len=64, num_requests=12, kv_tokens=640,
                 max_num_seqs=8, max_num_batched_tokens=256)
    engine = schedule_sim.simulate(**shape)
    full = schedule_sim.simulate(**shape, policy="full")
    reserve = schedule_sim.simulate(**shape, policy="reserve")
    # Greedy admission fills the cache with prompts, then preempts as they grow.
    assert engine["preemptions"] > 0 and engine["prompt_tokens_computed"] > 12 * 32
    # Reserving every request's whole output never preempts: each prompt computed once.
    assert (full["preemptions"], full["prompt_tokens_computed"]) == (0, 12 * 32)
    assert reserve["preemptions"] <= engine["preemptions"]
    # The greedy engine's first tokens come sooner: it admits more requests at once.
    assert engine["ttft_median_s"] < full["ttft_median_s"]


def test_the_command_prints_a_row_per_shape_and_policy_and_refuses_a_bad_shape():
    done = subprocess.run([sys.executable, str(SCRIPTS / "schedule_sim.py"), "--shapes",
                           "16/8x4,8/8x2", "--policy", "engine,full", "--kv-tokens", "512"],
                          capture_output=True, text=True, check=True, timeout=120)
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("16/8x4", "engine"), ("16/8x4", "full"),
                                            ("8/8x2", "engine"), ("8/8x2", "full")]
    refused = subprocess.run([sys.executable, str(SCRIPTS / "schedule_sim.py"), "--shapes",
                              "16x4"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "IN/OUTxREQUESTS" in refused.stderr


def test_swap_moves_the_preempted_tokens_instead_of_computing_them_again():
    """The ``swap`` policy preempts as the engine does, but the tokens a preemption drops
    come back as copies: the prompt tokens computed are the prompts alone, and the copies
    cost their bytes each way at the copy rate."""
    shape = dict(prompt_len=32, output_len=64, num_requests=12, kv_tokens=640,
                 max_num_seqs=8, max_num_batched_tokens=256)
    engine = schedule_sim.simulate(**shape)
    swap = schedule_sim.simulate(**shape, policy="swap", kv_bytes_per_token=1_000_000,
                                 swap_gb_s=1.0)
    assert swap["preemptions"] == engine["preemptions"] > 0
    # Each resumed request computes at most the one token it had sampled last.
    assert 12 * 32 <= swap["prompt_tokens_computed"] <= 12 * 32 + swap["preemptions"]
    moved = engine["prompt_tokens_computed"] - swap["prompt_tokens_computed"]
    assert moved > 0
    # 1 ms a token each way: out when preempted (every computed token), back when resumed.
    assert swap["swap_s"] >= round(2 * moved * 1e-3, 1) - 0.05
