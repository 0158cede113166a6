"""Runs one step on the device: flat inputs -> model -> logits -> sampled tokens.

The step's inputs come from the ``InputBatch`` (host arrays, see input_batch.py); this
module moves them to the device, sets the attention metadata, runs the model, and samples.
Seeded requests keep their ``torch.Generator`` across preemption, so a recomputed request
draws exactly what it would have drawn.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import LogprobsEntry, ModelRunnerOutput, SchedulerOutput
from pagedllm.layers.attention.backend import AttentionMetadata, set_forward_context
from pagedllm.layers.sampler import Sampler, SamplingMetadata, compute_prompt_logprobs
from pagedllm.models.loader import load_model, resolve_dtype
from pagedllm.worker.input_batch import InputBatch, StepInputs
from pagedllm.worker.kv_allocator import allocate_kv_caches, determine_num_blocks


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.model_config, self.device)
        self.block_size = config.cache_config.block_size
        self.vocab_size = config.model_config.vocab_size
        torch.manual_seed(config.model_config.seed)
        self.model = load_model(config.model_config, self.device, self.dtype)
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.input_batch = InputBatch(
            config.scheduler_config.max_num_seqs, config.model_config.max_model_len, self.block_size
        )
        # Outlive preemption: dropped only when the request finishes.
        self.generators: dict[str, torch.Generator] = {}

    # -- KV cache -----------------------------------------------------------------------
    def initialize_kv_cache(self) -> int:
        """Size and allocate the KV cache; returns the number of blocks."""
        num_blocks = determine_num_blocks(self.config, self.dtype, self.device, self._profile_run)
        self.kv_caches = allocate_kv_caches(self.config, num_blocks, self.dtype, self.device)
        return num_blocks

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """The largest step the scheduler can send, run once so its activations are counted."""
        sched = self.config.scheduler_config
        num_tokens = min(sched.max_num_batched_tokens, self.config.model_config.max_model_len)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        with set_forward_context(None, []):
            hidden = self.model(input_ids, positions)
        self.model.compute_logits(hidden[-sched.max_num_seqs:])

    # -- one step ---------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inputs = self.input_batch.prepare(scheduler_output.num_scheduled_tokens)
        with set_forward_context(self._attention_metadata(inputs), self.kv_caches):
            hidden_states = self.model(self._to_device(inputs.input_ids),
                                       self._to_device(inputs.positions))

        prompt_logprobs = self._prompt_logprobs(inputs, hidden_states)
        sampled: list[list[int]] = [[] for _ in inputs.req_ids]
        logprobs: dict[str, list[LogprobsEntry]] = {}
        if inputs.sample_req_indices:
            states = [inputs.states[i] for i in inputs.sample_req_indices]
            logits = self.model.compute_logits(hidden_states[self._to_device(inputs.logits_indices)])
            metadata = SamplingMetadata.build(
                params=[s.sampling_params for s in states],
                prompt_token_ids=[s.prompt_token_ids for s in states],
                output_token_ids=[s.output_token_ids for s in states],
                generators=[self.generators.get(s.request_id) for s in states],
                vocab_size=self.vocab_size,
                device=self.device,
            )
            out = self.sampler(logits, metadata)
            token_ids = out.sampled_token_ids.tolist()
            for j, (i, state, token) in enumerate(zip(inputs.sample_req_indices, states, token_ids)):
                self.input_batch.append_token(state, token)
                sampled[i] = [token]
                k = state.sampling_params.logprobs
                if k is not None and out.logprobs is not None:
                    logprobs[state.request_id] = [out.logprobs.to_entries(j, k)]
        return ModelRunnerOutput(
            req_ids=inputs.req_ids, sampled_token_ids=sampled,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.generators.pop(req_id, None)
        self.input_batch.update(so)
        for new in so.scheduled_new_reqs:
            seed = new.sampling_params.seed
            if seed is not None and new.request_id not in self.generators:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(seed)
                self.generators[new.request_id] = generator

    def _attention_metadata(self, inputs: StepInputs) -> AttentionMetadata:
        to = self._to_device
        return AttentionMetadata(
            num_actual_tokens=inputs.num_tokens,
            slot_mapping=to(inputs.slot_mapping),
            query_start_loc=to(inputs.query_start_loc.astype(np.int32)),
            seq_lens=to(inputs.seq_lens.astype(np.int32)),
            block_tables=to(inputs.block_tables),
            max_query_len=inputs.max_query_len,
            max_seq_len=int(inputs.seq_lens.max()),
            block_size=self.block_size,
            query_start_loc_cpu=inputs.query_start_loc.tolist(),
            seq_lens_cpu=inputs.seq_lens.tolist(),
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _prompt_logprobs(
        self, inputs: StepInputs, hidden_states: torch.Tensor
    ) -> dict[str, list[LogprobsEntry | None]]:
        """Logprobs of the prompt tokens this step computed (logits at p score token p+1)."""
        result: dict[str, list[LogprobsEntry | None]] = {}
        for i, state in enumerate(inputs.states):
            k = state.sampling_params.prompt_logprobs
            start = state.num_computed_tokens
            if k is None or start >= state.num_prompt_tokens:
                continue
            flat = int(inputs.query_start_loc[i])
            end = start + int(inputs.query_start_loc[i + 1]) - flat
            entries: list[LogprobsEntry | None] = [None] if start == 0 else []
            # Positions p in [start, end) whose next token p + 1 is still a prompt token.
            last = min(end, state.num_prompt_tokens - 1)
            if last > start:
                logits = self.model.compute_logits(hidden_states[flat:flat + last - start])
                targets = torch.tensor(state.prompt_token_ids[start + 1:last + 1],
                                       dtype=torch.long, device=self.device)
                entries.extend(compute_prompt_logprobs(logits, targets, k))
            result[state.request_id] = entries
        return result
