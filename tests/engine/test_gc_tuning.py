"""The server's processes tune the garbage collector once started; ``PAGEDLLM_SERVER_GC=0``
leaves it as Python sets it. Run in a child process: the tuning is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedllm.engine.gc_tuning import GC_ENV, YOUNG_THRESHOLD

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
    assert "PAGEDLLM_SERVER_GC='off': give 1 (on) or 0 (off)" in failed.value.stderr
