"""Speculative decoding in the benchmarks: acceptance, step costs, predicted and measured
speedup, each speculative run measured beside the same engine without speculation.

Per run (``speculation_report``)::

    acceptance rate        accepted / proposed tokens
    mean accepted length   tokens a verifying step yields: 1 + accepted / drafts
    tokens per step        tokens a decode step yields, verifying or not
    target step            the plain engine's decode step (its TPOT at batch 1), ms
    draft step             the draft phase's time per draft forward (the catch-up forward
                           and the one-token decodes, drawing included), ms; n-gram: 0
    proposal               the time a decode step spends proposing (K draft forwards, or
                           the n-gram lookup), ms
    verification           the rest of the runner's step: inputs, the target's forward over
                           the last token and the proposals, the rejection sampler, ms
    predicted speedup      tokens per step x target step / (proposal + verification),
                           i.e. L x T_target / (K x T_draft + T_verify)
    measured speedup       plain ms per token / speculative ms per token, same prompts
    efficiency             measured / predicted: what the engine's own per-step work
                           (scheduling, output processing, the catch-up) leaves of the
                           speedup the model costs allow

Step costs are timed by ``StepCosts`` (a few ``perf_counter`` calls per step): on the
CPU during the timed runs themselves; on a GPU, where its timers synchronise around each
phase, over the timed prompts again after the timed runs. Either way the costs see the
same proposals and acceptance as the speedup.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import defaultdict

from pagedllm.core.outputs import SpecDecodingStats
from pagedllm.engine.arg_utils import EngineArgs

_SPECULATIVE_FIELDS = ("speculative_model", "num_speculative_tokens", "speculative_method",
                       "ngram_prompt_lookup_min", "ngram_prompt_lookup_max",
                       "speculative_disable_by_batch_size", "speculative_config")


def is_speculative(engine_args: EngineArgs) -> bool:
    return any(getattr(engine_args, name) is not None for name in _SPECULATIVE_FIELDS)


def without_speculation(engine_args: EngineArgs) -> EngineArgs:
    """The same engine arguments with every speculative one cleared."""
    return dataclasses.replace(engine_args, **dict.fromkeys(_SPECULATIVE_FIELDS))


def with_num_speculative_tokens(engine_args: EngineArgs, k: int) -> EngineArgs:
    """``engine_args`` proposing ``k`` tokens a step (in the flag or the JSON form)."""
    config = engine_args.speculative_config
    if config is None:
        return dataclasses.replace(engine_args, num_speculative_tokens=k)
    config = json.loads(config) if isinstance(config, str) else dict(config)
    config["num_speculative_tokens"] = k
    return dataclasses.replace(engine_args, speculative_config=config, num_speculative_tokens=None)


def acceptance(before: SpecDecodingStats, after: SpecDecodingStats) -> dict:
    """Acceptance between two snapshots of the scheduler's totals."""
    drafts = after.num_drafts - before.num_drafts
    proposed = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {
        "num_drafts": drafts,
        "num_draft_tokens": proposed,
        "num_accepted_tokens": accepted,
        "acceptance_rate": round(accepted / proposed, 4) if proposed else 0.0,
        "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else 0.0,
    }


class StepCosts:
    """Context manager: times the decode steps of one speculative engine (see the module
    docstring). A decode step schedules no new request and computes only last tokens and
    proposals."""

    def __init__(self, llm) -> None:
        # Holds the engine: drop this object with the engine, or its memory stays taken.
        self.core = llm.llm_engine.engine_core
        self.runner = self.core.model_runner
        self.totals: dict[str, float] = defaultdict(float)
        self._restore: list[tuple[object, str]] = []
        self._decode = False
        self._sync = self.runner.device.type == "cuda"
        self._drafts = self.runner.drafter is not None

    def __enter__(self) -> "StepCosts":
        self._wrap(self.core.scheduler, "schedule", self._on_schedule)
        self._wrap(self.runner, "execute_model_async", self._timed("runner"))
        if self.runner.drafter is not None:
            self._wrap(self.runner.drafter, "propose", self._timed("proposal"))
            self._wrap(self.runner, "_draft_forward", self._counted("draft_forwards"))
        if self.core.ngram is not None:
            self._wrap(self.core, "_propose_ngrams", self._timed("proposal"))
        return self

    def __exit__(self, *exc) -> None:
        for obj, name in reversed(self._restore):
            delattr(obj, name)  # back to the class attribute
        self._restore.clear()

    def _wrap(self, obj: object, name: str, make) -> None:
        setattr(obj, name, make(getattr(obj, name)))
        self._restore.append((obj, name))

    def _on_schedule(self, original):
        def schedule():
            so = original()
            proposed = sum(len(s) for s in so.spec_token_ids.values())
            self._decode = (not so.is_empty and not so.scheduled_new_reqs and
                            so.total_num_scheduled_tokens == len(so.num_scheduled_tokens) + proposed)
            if self._decode:
                self.totals["decode_steps"] += 1
            return so
        return schedule

    def _timed(self, phase: str):
        def wrap(original):
            def timed(*args, **kwargs):
                start = self._now()
                result = original(*args, **kwargs)
                if phase == "runner":
                    output = result.get()
                    if self._decode:
                        self.totals["tokens"] += sum(len(t) for t in output.sampled_token_ids)
                if self._decode:
                    self.totals[phase] += self._now() - start
                return result
            return timed
        return wrap

    def _counted(self, name: str):
        def wrap(original):
            def counted(*args, **kwargs):
                if self._decode:
                    self.totals[name] += 1
                return original(*args, **kwargs)
            return counted
        return wrap

    def _now(self) -> float:
        if self._sync:
            import torch

            torch.cuda.synchronize(self.runner.device)
        return time.perf_counter()

    def summary(self) -> dict:
        """Per decode step, ms: proposal and verification; per draft forward: draft step;
        and the tokens a decode step yields."""
        t = self.totals
        steps = max(t["decode_steps"], 1)
        proposal = t["proposal"]
        # The ngram lookup runs after the runner's step; the draft phase inside it.
        verification = t["runner"] - (proposal if self._drafts else 0.0)
        forwards = t["draft_forwards"]
        return {
            "decode_steps": int(t["decode_steps"]),
            "tokens_per_step": round(t["tokens"] / steps, 3),
            "proposal_ms": round(1e3 * proposal / steps, 3),
            "draft_step_ms": round(1e3 * proposal / forwards, 3) if forwards else 0.0,
            "draft_forwards_per_step": round(forwards / steps, 3),
            "verification_ms": round(1e3 * verification / steps, 3),
        }


def speculation_report(k: int, costs: dict, accepted: dict, target_step_ms: float,
                       plain_ms_per_token: float, speculative_ms_per_token: float) -> dict:
    """The record's ``speculative`` entry (see the module docstring)."""
    predicted = (costs["tokens_per_step"] * target_step_ms
                 / max(costs["proposal_ms"] + costs["verification_ms"], 1e-9))
    # Reported to three decimals; the efficiency is the ratio of the reported figures.
    predicted = round(predicted, 3)
    measured = round(plain_ms_per_token / speculative_ms_per_token, 3)
    return {
        "num_speculative_tokens": k,
        **accepted,
        **costs,
        "target_step_ms": round(target_step_ms, 3),
        "plain_ms_per_token": round(plain_ms_per_token, 3),
        "ms_per_token": round(speculative_ms_per_token, 3),
        "predicted_speedup": predicted,
        "measured_speedup": measured,
        "efficiency": round(measured / predicted, 3) if predicted else 0.0,
    }


def format_table(reports: list[dict]) -> str:
    """One line per K."""
    head = (f"{'K':>3} {'accept':>7} {'mean len':>8} {'tok/step':>8} {'target ms':>9} "
            f"{'draft ms':>8} {'verify ms':>9} {'predicted':>9} {'measured':>8} {'effic.':>6}")
    lines = [head]
    for r in reports:
        lines.append(
            f"{r['num_speculative_tokens']:>3} {r['acceptance_rate']:>7.3f} "
            f"{r['mean_accepted_length']:>8.2f} {r['tokens_per_step']:>8.2f} "
            f"{r['target_step_ms']:>9.3f} {r['draft_step_ms']:>8.3f} {r['verification_ms']:>9.3f} "
            f"{r['predicted_speedup']:>8.2f}x {r['measured_speedup']:>7.2f}x {r['efficiency']:>6.2f}")
    return "\n".join(lines)
