"""Per-request sampling parameters (OpenAI and vLLM knobs), validated once at construction.

Pure Python: the core imports this module, so it must never import torch.

Semantics (vLLM's, which OpenAI clients expect):
- ``temperature == 0`` means greedy decoding; top_p/top_k/min_p are then irrelevant.
- ``top_k <= 0`` (or -1) means no top-k filtering; ``top_p == 1`` and ``min_p == 0`` disable theirs.
- ``repetition_penalty`` (1 = off) divides positive / multiplies negative logits of every
  token seen in the prompt or the output; ``presence_penalty`` and ``frequency_penalty``
  (0 = off) subtract from the logits of tokens seen in the output.
- ``stop`` strings end generation when they appear in the decoded text; the text is cut
  before the stop string unless ``include_stop_str_in_output``.
- ``detokenize=False``: outputs carry token ids and empty text, and logprobs no decoded
  tokens; nothing is decoded for the request (stop strings, which live in text, are refused).
- ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled before this many output tokens.
- ``logit_bias`` maps token ids to values added to their logits before the penalties and
  the draw (OpenAI's: -100 all but bans a token, 100 all but forces it; logprobs stay
  those of the raw logits).
- ``allowed_token_ids`` (vLLM's): only these tokens can be sampled (logprobs stay raw).
- ``bad_words`` (vLLM's): words the output must not contain; each is tokenized as it would
  start the text and after a space, and a sequence's last token is banned whenever the
  output so far ends with the rest of it.
- ``logprobs = k`` returns, per output token, the sampled token's logprob plus the top k;
  ``prompt_logprobs = k`` does the same for every prompt token (the first is None).
- ``seed`` makes a request's samples independent of whatever else is in the batch.
- ``structured_outputs`` constrains the output to a JSON schema, a regex, a choice or a
  grammar (``StructuredOutputsParams``, or a dict of its fields); the request then ends
  with "stop" once the output is complete.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedllm.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Filled in by the engine from the tokenizer/generation config; not user knobs.
    eos_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if not self.logit_bias:
            self.logit_bias = None
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, list):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        elif self.bad_words is not None:
            self.bad_words = list(self.bad_words) or None
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if self.temperature < 0.0:
            raise bad("temperature", self.temperature, "non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int):
            raise bad("top_k", self.top_k, "an integer (0 or -1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "greater than 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0 or value > 20):
                raise bad(name, value, "an integer in [0, 20] or None")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an integer or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if self.stop and not self.detokenize:
            raise ValueError(
                f"Stop strings {self.stop} are matched in the decoded text, but detokenize=False: "
                "use stop_token_ids instead, or leave detokenize on."
            )
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise bad("structured_outputs", self.structured_outputs,
                      "a StructuredOutputsParams, a dict of its fields, or None")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", self.logit_bias, "a dict of token ids to biases")
            for token, bias in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise bad("logit_bias", self.logit_bias,
                              f"keyed by non-negative integer token ids (not {token!r})")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                        or not math.isfinite(bias):
                    raise bad("logit_bias", self.logit_bias,
                              f"a dict of finite numbers (token {token}: {bias!r})")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(isinstance(t, bool) or not isinstance(t, int)
                                                  or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", self.allowed_token_ids,
                      "a non-empty list of non-negative token ids, or None")
        if self.bad_words is not None and any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise bad("bad_words", self.bad_words, "a list of non-blank strings")

    @property
    def has_penalties(self) -> bool:
        """Whether any of the repetition, presence or frequency penalties is on."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def bans_after_output(self) -> bool:
        """Whether a bad word of several tokens bans its last by what the output ends with."""
        return any(len(ids) > 1 for ids in self.bad_words_token_ids)

    @property
    def reads_output(self) -> bool:
        """Whether sampling a token reads the output so far: penalties, ``min_tokens``, bad
        words of several tokens."""
        return self.has_penalties or self.min_tokens > 0 or self.bans_after_output

    @property
    def filters_tokens(self) -> bool:
        """Whether top-k, top-p or min-p removes tokens before a random draw."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """Token ids that end generation (EOS unless ignored, plus stop_token_ids)."""
        return self.stop_token_ids_with(self.eos_token_ids)

    def stop_token_ids_with(self, eos_token_ids) -> frozenset[int]:
        """Token ids that end generation if ``eos_token_ids`` were the model's EOS tokens."""
        ids = frozenset(self.stop_token_ids)
        return ids if self.ignore_eos else ids | frozenset(eos_token_ids)

    def clone(self, **changes) -> "SamplingParams":
        """A copy with ``changes`` applied; its lists and dicts are its own. Validation is not
        run again (the fields were valid, and the changes are the engine's)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        new.stop = list(new.stop)
        new.stop_token_ids = list(new.stop_token_ids)
        if new.logit_bias is not None:
            new.logit_bias = dict(new.logit_bias)
        if new.allowed_token_ids is not None:
            new.allowed_token_ids = list(new.allowed_token_ids)
        return new
