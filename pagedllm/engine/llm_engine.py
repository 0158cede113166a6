"""The synchronous engine behind the offline ``LLM`` API: inputs -> core steps -> outputs.

``add_request`` tokenizes and validates (errors surface here, at submission); ``step``
runs one core step and returns the ``RequestOutput``s that are ready. With
``skip_tokenizer_init`` no tokenizer is loaded: prompts are token ids, outputs carry ids
and empty text.
"""

from __future__ import annotations

import itertools

from pagedllm.config import EngineConfig
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import InputProcessor, PromptType
from pagedllm.engine.tokenizer import Tokenizer
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_config = config.model_config
        self.tokenizer: Tokenizer | None = (
            None if model_config.skip_tokenizer_init
            else Tokenizer.from_pretrained(model_config.tokenizer_path)
        )
        self.input_processor = InputProcessor(config.model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(config)
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        output_kind: str = "final",
        arrival_time: float | None = None,
    ) -> None:
        processed, requests = self.input_processor.process(
            request_id, prompt, params, arrival_time=arrival_time, priority=priority)
        self.output_processor.add_request(
            request_id, processed.prompt, processed.prompt_token_ids, params,
            output_kind=output_kind, arrival_time=requests[0].arrival_time,
        )
        for request in requests:
            self.engine_core.add_request(request)

    def abort_request(self, request_ids: list[str]) -> None:
        core_ids = [c for r in request_ids for c in self.output_processor.abort_request(r)]
        self.engine_core.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        outputs, to_abort = self.output_processor.process_outputs(core_outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        return outputs
