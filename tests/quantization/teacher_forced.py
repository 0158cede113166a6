"""The engine's greedy choices against HF's, teacher-forced on HF's tokens: for products
that round their inputs (INT8 W8A8, bitsandbytes' LLM.int8), where float noise under a
rounding boundary can move one input code and flip a near tie of a free-running
continuation."""

from __future__ import annotations

import torch

from pagedllm import LLM, SamplingParams


def full_pass_logprobs(model, prompt: list[int], want: list[int]) -> torch.Tensor:
    """HF's logprobs (``[len(want), vocab]``) of each step of the continuation ``want``,
    from one forward pass over prompt and continuation."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_engine_picks(llm: LLM, prompt: list[int], want: list[int],
                        hf_logprobs: torch.Tensor, tie: float) -> None:
    """Each of HF's greedy tokens ``want`` is the engine's most likely one after the same
    prefix (one prompt step: its prompt logprobs), or within ``tie`` nats of it, with a
    logprob within ``tie`` of HF's (``hf_logprobs``, HF's steps); and all but one at most
    are the engine's most likely outright."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    output = llm.generate([{"prompt_token_ids": prompt + want}], params, use_tqdm=False)[0]
    exact = 0
    for step, (token, ranked) in enumerate(zip(want, output.prompt_logprobs[len(prompt):])):
        best = min(ranked.values(), key=lambda logprob: logprob.rank)
        exact += best.rank == ranked[token].rank
        assert best.logprob - ranked[token].logprob <= tie, (want, token, ranked)
        assert abs(ranked[token].logprob - hf_logprobs[step, token].item()) <= tie
    assert exact >= len(want) - 1
