"""pagedllm: a high-throughput LLM inference and serving engine.

    from pagedllm import LLM, SamplingParams
    llm = LLM()  # the bundled demo model
    print(llm.generate(["def fib(n):"], SamplingParams(max_tokens=32))[0].outputs[0].text)

Heavy imports (torch) happen on first use of ``LLM``, so the torch-free core stays light.
"""

from __future__ import annotations

import os

# OpenMP threads that spin while waiting make CPU inference up to 10x slower as soon as
# another process (the API server, a tokenizer, a test client) wants a core. Sleeping
# waits cost a few microseconds per parallel region instead. Takes effect only if torch
# is imported after pagedllm; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
