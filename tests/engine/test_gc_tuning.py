"""The server's processes tune the garbage collector once started, ``LLM.generate`` while it
runs; ``PAGEDLLM_GC_TUNING=0`` leaves it as Python sets it. Run in a child process (the
tuning is process-wide), or in this one where a test restores what it changes."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest

from pagedllm.engine.gc_tuning import GC_ENV, NO_FULL_COLLECTION, YOUNG_THRESHOLD, offline_generate

PROBE = ("import gc, json\n"
         "from pagedllm.engine.gc_tuning import tune_for_serving\n"
         "default, frozen_before = gc.get_threshold(), gc.get_freeze_count()\n"
         "tune_for_serving()\n"
         "frozen = gc.get_freeze_count() - frozen_before\n"
         "print(json.dumps([default, gc.get_threshold(), frozen]))\n")


def probe(env_value: str | None) -> tuple[list, list, int]:
    """The collector's thresholds before and after ``tune_for_serving`` in a fresh
    interpreter, and how many objects it froze (an interpreter's start-up may freeze
    some of its own before)."""
    env = {k: v for k, v in os.environ.items() if k != GC_ENV}
    if env_value is not None:
        env[GC_ENV] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def test_tuning_freezes_the_startup_heap_and_raises_the_young_threshold():
    default, tuned, frozen = probe(None)
    assert tuned == [YOUNG_THRESHOLD, default[1], default[2]]
    assert frozen > 1000  # the interpreter's and pagedllm's objects, at least


def test_the_switch_leaves_the_collector_alone():
    default, tuned, frozen = probe("0")
    assert tuned == default and frozen == 0


def test_the_switch_takes_1_or_0_only():
    with pytest.raises(subprocess.CalledProcessError) as failed:
        probe("off")
    assert "PAGEDLLM_GC_TUNING='off': give 1 (on) or 0 (off)" in failed.value.stderr



OFFLINE_PROBE = """
import gc, json, sys, weakref
from pagedllm import LLM, SamplingParams
setup = sys.argv[1]
llm = LLM(max_model_len=256)
if setup == "disabled":
    gc.disable()
if setup == "frozen":
    gc.freeze()
engine = llm.llm_engine
seen = {"admitting": [], "stepping": []}
def watch(phase, call):
    def watched(*args, **kwargs):
        seen[phase].append([gc.isenabled(), gc.get_freeze_count(), gc.get_threshold()])
        return call(*args, **kwargs)
    return watched
engine.add_request = watch("admitting", engine.add_request)
engine.step = watch("stepping", engine.step)
prompts = [{"prompt_token_ids": [1 + i % 50, 2, 3]} for i in range(100)]
seen["before"] = [gc.isenabled(), gc.get_freeze_count(), gc.get_threshold()]
outputs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
seen["after"] = [gc.isenabled(), gc.get_freeze_count(), gc.get_threshold()]
gc.enable()
dropped = weakref.ref(engine)
del llm, engine, outputs
gc.collect()
seen["freed"] = dropped() is None
print(json.dumps(seen))
"""


def offline_probe(setup: str) -> dict:
    """The collector around one ``LLM.generate`` of 100 requests in a fresh interpreter:
    as each request was admitted, as each step ran, before and after."""
    env = {k: v for k, v in os.environ.items() if k != GC_ENV}
    out = subprocess.run([sys.executable, "-c", OFFLINE_PROBE, setup], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def test_generate_quiets_the_collector_while_it_runs_and_restores_it():
    seen = offline_probe("default")
    enabled, frozen, thresholds = seen["before"]
    assert enabled and frozen == 0
    # No collection while requests are admitted; then collections run at the raised young
    # threshold, none of them a full one, and nothing is frozen.
    assert seen["admitting"] and not any(on for on, _, _ in seen["admitting"])
    assert seen["stepping"] and all(
        on and count == 0 and young == YOUNG_THRESHOLD and middle == thresholds[1]
        and oldest == NO_FULL_COLLECTION
        for on, count, (young, middle, oldest) in seen["stepping"])
    assert seen["after"] == seen["before"]
    assert seen["freed"]  # a dropped LLM is reclaimed


def test_generate_tunes_the_collector_beside_a_frozen_heap_and_keeps_it_frozen():
    # A heap may hold frozen objects before the call (a benchmark host's Python starts so): the
    # collector is tuned all the same, and the frozen heap is left as it was.
    seen = offline_probe("frozen")
    assert seen["before"][1] > 0
    assert seen["stepping"] and all(on and count > 0 and oldest == NO_FULL_COLLECTION
                                    for on, count, (_, _, oldest) in seen["stepping"])
    assert seen["after"][0] and seen["after"][2] == seen["before"][2]
    assert seen["after"][1] > 0


def test_generate_keeps_a_collector_the_caller_disabled():
    seen = offline_probe("disabled")
    assert seen["after"] == seen["before"] and not seen["after"][0]
    assert all(not on and thresholds == seen["before"][2]
               for on, _, thresholds in seen["admitting"] + seen["stepping"])


def test_a_generate_beside_another_leaves_the_collector_to_the_first(monkeypatch):
    # Two LLMs generating in two threads, the first to start ending first: the second call
    # finds the first's tuning and changes nothing, so the thresholds end as they began.
    monkeypatch.delenv(GC_ENV, raising=False)
    before = gc.get_threshold(), gc.isenabled()
    first, second = offline_generate(), offline_generate()
    first.__enter__()()
    tuned = gc.get_threshold()
    assert tuned[2] == NO_FULL_COLLECTION
    second.__enter__()()
    assert gc.get_threshold() == tuned and gc.isenabled()
    first.__exit__(None, None, None)
    second.__exit__(None, None, None)
    assert (gc.get_threshold(), gc.isenabled()) == before
