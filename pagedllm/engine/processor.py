"""Front-end input processing: prompt -> validated token ids -> engine-core ``Request``s.

A prompt is a string (tokenized here) or ``{"prompt_token_ids": [...]}`` (optionally with
``"prompt"`` text). Everything a user can get wrong is checked here, at submission, so the
step loop never meets a request it cannot finish.

``n > 1`` fans out into ``n`` core requests that share the prompt (the prefix cache makes
the shared part one prefill). Child ``i`` of request ``R`` is ``"R"`` for ``n == 1`` and
``"i_R"`` otherwise; seeded children use ``seed + i`` so their samples differ.

Without a tokenizer (``skip_tokenizer_init``) prompts must be token ids, stop strings are
refused (they are matched in text), and EOS ids come from the checkpoint's
generation_config.json / config.json.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import ModelConfig
from pagedllm.core.request import Request
from pagedllm.engine.tokenizer import Tokenizer
from pagedllm.sampling_params import SamplingParams

PromptType = str | dict


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


_NO_TOKENIZER = (
    "the engine runs without a tokenizer (skip_tokenizer_init, automatic for a model "
    "directory with no tokenizer files)"
)


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Tokenizer | None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = model_config.max_model_len
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = (
            model_config.eos_token_ids if tokenizer is None else tokenizer.eos_token_ids
        )

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"A text prompt needs a tokenizer, but {_NO_TOKENIZER}: pass the prompt as "
                    "{'prompt_token_ids': [...]}, or give a tokenizer with --tokenizer."
                )
            return ProcessedPrompt(prompt, self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError("prompt_token_ids must be a list of integers.")
                return ProcessedPrompt(prompt.get("prompt"), list(ids))
            if "prompt" in prompt:
                return self.process_prompt(prompt["prompt"])
        raise ValueError(
            "A prompt must be a string or a dict with 'prompt_token_ids' (or 'prompt'); "
            f"got {type(prompt).__name__}."
        )

    def validate(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("The prompt is empty: give at least one token.")
        # One pass for both checks: a prompt is thousands of ids, and this runs per request.
        vocab_size = self.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
        if bad:
            if not isinstance(bad[0], int):
                raise ValueError("prompt_token_ids must be a list of integers.")
            raise ValueError(
                f"Token id {bad[0]} is out of the vocabulary [0, {self.vocab_size})."
            )
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"The prompt is {len(prompt_token_ids)} tokens long, but the maximum model length "
                f"is {self.max_model_len} and at least one token must be generated: shorten the "
                "prompt or raise max_model_len."
            )

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """The token sequences of ``bad_words`` (vLLM's rule): each word as it would start
        the text, and after a space when that tokenizes to other tokens of the same count."""
        if self.tokenizer is None:
            raise ValueError(f"bad_words must be tokenized to be banned, but {_NO_TOKENIZER}: "
                             "use logit_bias or allowed_token_ids instead, or give a tokenizer.")
        sequences: list[list[int]] = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(bare)
            if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        outside = sorted(t for ids in sequences for t in ids if t >= self.vocab_size)
        if outside:
            raise ValueError(f"bad_words must tokenize within the vocabulary [0, "
                             f"{self.vocab_size}), got token {outside[0]}.")
        return [ids for ids in sequences if ids]

    def validate_structured_outputs(self, params: SamplingParams) -> None:
        """ValueError (the grammar compiler's message) for a constraint that cannot compile."""
        if self.tokenizer is None:
            raise ValueError(
                f"structured_outputs constrain the output's text, but {_NO_TOKENIZER}: give a "
                "tokenizer with --tokenizer."
            )
        from pagedllm.structured.llguidance_backend import LLGuidanceBackend

        LLGuidanceBackend.validate(params.structured_outputs)

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> tuple[ProcessedPrompt, list[Request]]:
        """Tokenize and validate one prompt; returns it with its core requests."""
        processed = self.process_prompt(prompt)
        requests = self.make_requests(request_id, processed.prompt_token_ids, params,
                                      arrival_time=arrival_time, priority=priority)
        return processed, requests

    def make_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> list[Request]:
        self.validate(prompt_token_ids)
        if self.tokenizer is None and params.stop:
            raise ValueError(
                f"Stop strings {params.stop} are matched in the decoded text, but "
                f"{_NO_TOKENIZER}: use stop_token_ids instead, or give a tokenizer."
            )
        if params.structured_outputs is not None:
            self.validate_structured_outputs(params)
        for name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(params, name)
            outside = sorted(t for t in ids or () if t >= self.vocab_size)
            if outside:
                raise ValueError(f"{name} must name token ids of the vocabulary "
                                 f"[0, {self.vocab_size}), got {outside[0]}.")
        params = params.clone(eos_token_ids=self.eos_token_ids)
        if params.bad_words:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        requests = []
        for index in range(params.n):
            child = params if params.n == 1 else params.clone(n=1)
            if params.n > 1 and params.seed is not None:
                child.seed = params.seed + index
            requests.append(Request(
                child_request_id(request_id, index, params.n), prompt_token_ids, child,
                max_model_len=self.max_model_len, arrival_time=arrival_time, priority=priority,
            ))
        return requests
