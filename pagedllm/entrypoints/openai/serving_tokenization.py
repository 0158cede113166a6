"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's extension endpoints).

``/tokenize`` takes a ``prompt`` (special tokens added by default, as completions do) or
chat ``messages`` (rendered with the chat template; no special tokens added, as chat
completions do) and returns the ids, their count and ``max_model_len``.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest, DetokenizeResponse, OpenAIError, TokenizeRequest, TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat


class OpenAIServingTokenization:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.models = chat.models
        self.max_model_len = chat.max_model_len

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.models.resolve(request.model)
        tokenizer = self.chat.require_tokenizer("/tokenize", None)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("Give exactly one of prompt or messages.", param="prompt")
        if request.messages is not None:
            text = self.chat.render(request.messages, request.add_generation_prompt)
            add_special = bool(request.add_special_tokens)
        else:
            text = request.prompt
            add_special = request.add_special_tokens is not False
        tokens = tokenizer.encode(text, add_special_tokens=add_special)
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.models.resolve(request.model)
        tokenizer = self.chat.require_tokenizer("/detokenize", None)
        vocab = self.chat.engine.model_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"Token id {bad[0]} is out of the vocabulary [0, {vocab}).",
                              param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))
