"""Request and response shapes of the OpenAI API (pydantic), plus the error shape.

Requests accept the OpenAI fields and vLLM's extra fields (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, the structured-output fields ``guided_json`` ...
``structured_outputs``), which the OpenAI SDK passes through ``extra_body``. Fields that
would change the output and are not implemented (vLLM's ``logits_processors``, beam
search, ...) are refused with a 400 that names
them when set to anything but their "off" value; fields no server needs to act on
(``user``, ``metadata``, ``store``...) are accepted and have no effect. Other unknown
fields are ignored (new SDK versions add fields) and logged.

``return_token_ids`` (vLLM's) adds the prompt's and each choice's token ids to the
response; a server in token-id mode (no tokenizer) always adds them, since its text is
empty.

Errors have OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidatorFunctionWrapHandler,
    field_validator,
)


class OpenAIError(Exception):
    """An error to answer with an HTTP status and the OpenAI error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, err_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        """``headers``: extra response headers (``Retry-After`` on a 503)."""
        super().__init__(message)
        self.headers = headers
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.err_type = err_type or _ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.err_type, self.param, self.code)


_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                404: "invalid_request_error", 413: "invalid_request_error",
                500: "server_error", 503: "server_error", 504: "server_error"}


# What a client learns of an unexpected failure; the traceback goes to the server's log only.
INTERNAL_ERROR_MESSAGE = "The server had an internal error while processing the request."


def error_body(message: str, err_type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


# Fields no server needs to act on: accepted silently.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "request_id",
                            "safety_identifier", "prompt_cache_key"})
# Fields of the OpenAI API or of vLLM that change the output and are not implemented here.
REFUSED_FIELDS = {
    "logits_processors": "logits_processors (custom logits processors)",
    "use_beam_search": "beam search (use_beam_search)",
    "length_penalty": "length_penalty (beam search)",
    "vllm_xargs": "vllm_xargs",
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        """Extra fields that are neither known to be safe to ignore nor refused."""
        return sorted(set(self.model_extra or {}) - IGNORED_FIELDS - set(REFUSED_FIELDS))

    def refused_fields(self) -> list[str]:
        """Extra fields that would change the output and are not implemented, when set."""
        extra = self.model_extra or {}
        return [name for name in REFUSED_FIELDS if extra.get(name) not in (None, False, [], {})]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False

    def usage_in_chunks(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0
    return_token_ids: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: the prompt tokens' logprobs and the top N at each position.
    prompt_logprobs: int | None = None
    # vLLM's: keep only the prompt's last N tokens (-1: the model's context length).
    truncate_prompt_tokens: int | None = None
    # Structured outputs: OpenAI's response_format, or vLLM's fields (one constraint at most).
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None


# A prompt of token ids, checked strictly (every item an int): the common case of a long
# prompt, checked in an eighth of the time the full union takes.
_TOKEN_IDS = TypeAdapter(list[int])


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _token_ids_first(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """A list of ints is token ids as it stands; anything else takes the union's own
        rules (so its results and messages are unchanged)."""
        if type(value) is list and value and type(value[0]) is int:
            try:
                return _TOKEN_IDS.validate_python(value, strict=True)
            except ValidationError:
                pass
        return handler(value)


class ChatMessage(BaseModel):
    """One message; extra keys (``name``, ``tool_calls``...) reach the chat template as given."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # OpenAI fields that change the output and are not implemented: refused when set.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None
    # Template controls (vLLM's names).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False


class ResponsesRequest(SamplingFields):
    """``POST /v1/responses`` (serving_responses.py): OpenAI's Responses fields, and the
    sampling fields chat completions take (vLLM's extras through ``extra_body``)."""

    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Responses features this server does not implement: refused when set.
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# -- responses ----------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


def _omitted_when_none() -> Any:
    return Field(default=None, exclude_if=lambda value: value is None)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = _omitted_when_none()
    token_ids: list[int] | None = _omitted_when_none()
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = _omitted_when_none()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    # With --reasoning-parser: the model's reasoning, apart from its answer.
    reasoning_content: str | None = _omitted_when_none()


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _omitted_when_none()


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = _omitted_when_none()
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = _omitted_when_none()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
