"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))`` and ``.chat(...)``."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from pagedllm.engine import gc_tuning
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.chat_messages import messages_for_template
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.processor import PromptType
from pagedllm.engine.tokenizer import Tokenizer
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

Message = dict
Conversation = list[Message]


class LLM:
    """An engine for batch generation. ``model=None`` loads the bundled demo model.

    Keyword arguments are the engine arguments (see ``pagedllm.engine.arg_utils.EngineArgs``):
    dtype, max_model_len, block_size, max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, enable_chunked_prefill, num_kv_blocks, gpu_memory_utilization,
    kv_cache_memory_gb, seed, load_format, hf_overrides, tokenizer, revision, device,
    skip_tokenizer_init, enforce_eager.

    A model with no tokenizer (the built-in benchmark configs, or ``skip_tokenizer_init=True``)
    takes prompts as ``{"prompt_token_ids": [...]}`` and returns token ids with empty text.
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine(args.create_engine_config())

    def get_tokenizer(self) -> Tokenizer | None:
        """The tokenizer, or None when the engine runs in token-id mode."""
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of ``prompts``.

        A prompt is a string or ``{"prompt_token_ids": [...]}``. ``sampling_params`` is one
        for all prompts or a list with one per prompt.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(
                    f"priority has {len(priority)} entries but there are {len(prompts)} prompts."
                )
            policy = self.llm_engine.config.scheduler_config.policy
            if policy != "priority" and any(priority):
                raise ValueError(
                    "priority is given but the scheduling policy is "
                    f"{policy!r}: create the LLM with scheduling_policy='priority'."
                )
        engine = self.llm_engine
        request_ids = []
        with gc_tuning.offline_generate() as admitted:
            try:
                for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                    request_id = engine.next_request_id()
                    engine.add_request(request_id, prompt, params,
                                       priority=0 if priority is None else priority[i])
                    request_ids.append(request_id)
            except Exception:
                engine.abort_request(request_ids)
                raise
            admitted()
            return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        **template_kwargs,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, using the chat template.

        Messages follow the OpenAI chat format, read as the server reads them
        (``pagedllm.engine.chat_messages``: ``content: None`` beside tool calls, arguments as
        JSON strings, reasoning under ``reasoning_content``). ``tools`` (JSON-schema function
        definitions) reach the template as its ``tools``;
        ``continue_final_message`` leaves the last message open for the model to continue
        (with ``add_generation_prompt=False``). ``chat_template_kwargs`` and any further
        keyword arguments become template variables (``enable_thinking=False``...).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError(
                "chat() renders a chat template and tokenizes it, but this engine runs without a "
                "tokenizer (skip_tokenizer_init): load a model with a tokenizer, or pass "
                "--tokenizer, or call generate() with prompt_token_ids."
            )
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError("chat_template_kwargs must be a dict of template variables.")
        variables = {**(chat_template_kwargs or {}), **template_kwargs}
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                messages_for_template(conversation), add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, tools=tools,
                continue_final_message=continue_final_message, **variables,
            )
            # The template already holds any BOS token; do not add special tokens twice.
            prompts.append({"prompt": text,
                            "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # -- helpers ------------------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given no SamplingParams: the defaults of
        ``SamplingParams`` with the model's generation_config.json fields set over them
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as
        max_tokens; see ``generation_config``)."""
        return SamplingParams(**self.llm_engine.config.model_config.sampling_defaults)

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise ValueError(
                f"Got {len(params)} sampling params for {num_prompts} prompts: pass one, or one per prompt."
            )
        return params

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm,
                   dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in results])
            raise
        finally:
            bar.close()
        return [results[r] for r in request_ids]
