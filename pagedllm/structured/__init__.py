"""Structured outputs: constraints on a request's output (JSON schema, regex, choice,
grammar), compiled by a grammar backend and applied as token masks before sampling.

``params`` is pure Python (the core sees it through ``SamplingParams``); ``backend`` is the
interface the engine calls, ``llguidance_backend`` its implementation, and ``manager`` the
engine core's side (compiling off the step loop, per-request grammars, step bitmasks).
"""

from pagedllm.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
