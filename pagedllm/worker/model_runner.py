"""Runs one step on the device: flat inputs -> model -> logits -> sampled tokens.

The step's inputs come from the ``InputBatch`` (host arrays, see input_batch.py); this
module moves them to the device, sets the attention metadata, runs the model, and samples.
Seeded requests keep their ``torch.Generator`` across preemption, so a recomputed request
draws exactly what it would have drawn.

On CUDA a pure-decode step, or a step of one request's prompt of up to 512 tokens, replays
a captured CUDA graph (``cuda_graphs.py``); other prefill and mixed steps run eagerly,
their inputs copied through persistent pinned buffers (``device_inputs.py``). Either way
the step's only host sync is reading the sampled ids.

``execute_model_async`` launches a step and returns before its ids are read
(``async_output.py``), so the engine can schedule and launch the next step meanwhile. The
next step's decodes then take their input ids from this step's sampled ids on the device
(pending tokens, see ``input_batch.py``). Sampling that depends on a request's earlier
outputs (penalties, ``min_tokens``) takes the host's tokens plus the pending ones on the
device, so no step waits for the previous one's ids.

Speculative decoding: a step that verifies proposals or has the draft model propose is
resolved before ``execute_model_async`` returns (the engine runs such steps
synchronously). A request verifying proposals gets its ``k + 1`` rows sampled by the
rejection sampler (``verification.py``); the others sample as usual; then the draft model,
if any, catches up and proposes (``draft_model.py``). A step without speculation (above
``disable_by_batch_size``) is launched as any other, and the draft model runs over the
same inputs after the target (``DraftModel.follow``), so it may stay in flight. The
verification rows of a constrained request are masked first, each by its grammar's state
after the proposals before it (``StepGrammars.verify_bitmask``). On CUDA a
verification step replays the target's verify graphs when every request computes 1 to
``k + 1`` tokens (``k = num_speculative_tokens``): requests verifying fewer proposals,
decoding without any, or computing a prompt chunk of at most ``k + 1`` tokens ride along,
padded to ``k + 1`` rows; batches above the largest verify size, and steps with a longer
prompt chunk, run eagerly (or replay a prompt graph when the step is one request's). The
draft's catch-up forward replays its own verify graphs of 2 rows a request (the sampled
token, and the last proposal when all were accepted) once its requests' prompts are in,
and its one-token decodes its decode graphs.

Constrained rows (structured outputs), check-then-mask: such a row is sampled without its
token mask, and when the step's ids are read the engine's grammars check the sampled
tokens (``grammar.check``). With ``CHECK_CANDIDATES``, a row whose token is refused takes
the next token of its draw's ranking that the grammar allows (``Sampler.candidates``,
ranked while the host checks the ids, read back only when some row is refused); only the
rows that allow none of those get a bitmask, and are drawn again under it with the noise
of their first draw. Either way the token is the one masking first would have given
(``Sampler.redraw``): the race over the allowed tokens is won by the best-ranked allowed
one (docs/benchmarks.md, "a refused draw's next candidates"). The check runs before any
later step's forward pass reads the ids: with asynchronous scheduling the next
launch reads the step's ids first (the one device-to-host copy it makes anyway, earlier),
and a step with refused rows copies their new ids too and tells the grammars
(``grammar.redrawn``).
Once the next forward pass is launched, ``grammar.forward_launched()``: the checked rows'
grammars then take their tokens and fill their next masks, while the device computes.
Where the engine fills every constrained row's next mask while the device computes and
keeps a step in flight (``StepGrammars.defers_masks``: a GPU, asynchronous scheduling, no
speculation), nothing is checked: a step's constrained rows are sampled under those masks,
the sampling launched at the start of the next step's launch, just before its forward pass
(``_defer_sample``), so no read of ids stands between two forward passes; once that
forward pass is launched the step's ids are read and its grammars take them
(``grammar.sampled``), which starts the next masks.
Rows whose sampling reads the masked distribution before the draw (logprobs; top-k, top-p,
min-p) are masked first instead: after the forward pass is launched, the runner asks the
engine for their bitmask (``grammar``, filled on the host while the device computes) and
the sampler masks their logits before anything else.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from typing import Callable

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import LogprobsEntry, ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import (
    get_pp,
    min_over_ranks,
    recv_sampled_ids,
    send_sampled_ids,
)
from pagedllm.layers.attention.backend import AttentionMetadata, OutputRows, set_forward_context
from pagedllm.layers.attention.kv_quant import kv_cache_torch_dtype
from pagedllm.layers.attention.selector import attention_backend_name
from pagedllm.layers.sampler import (
    Draw,
    LogprobsTensors,
    RowCounts,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    TokenCounts,
    compute_prompt_logprobs,
)
from pagedllm.models.loader import load_model, resolve_dtype
from pagedllm.sampling_params import SamplingParams
from pagedllm.switches import integer
from pagedllm.worker.async_output import AsyncStepOutput, SampledIdsReadback, host_copy
from pagedllm.worker.cuda_graphs import (
    VERIFY,
    CudaGraphRunner,
    capture_sizes,
    mixed_capture_sizes,
    mixed_graphs_enabled,
    prompt_capture_sizes,
    verify_capture_sizes,
)
from pagedllm.worker.device_inputs import DeviceInputBuffers
from pagedllm.worker.draft_model import MAX_CATCH_UP_TOKENS, DraftModel
from pagedllm.worker.input_batch import CachedRequestState, InputBatch, StepInputs
from pagedllm.worker.kv_allocator import (
    allocate_host_kv_caches,
    allocate_kv_caches,
    bytes_per_block,
    determine_num_blocks,
    host_blocks,
    host_memory_available,
    swap_space_problem,
)
from pagedllm.worker.verification import verify_proposals
from pagedllm.worker.warmup import warm_up_kernels, warm_up_layouts

logger = logging.getLogger(__name__)

# Candidates of its draw a checked row whose sampled token the grammar refuses may take
# before it is drawn again under its mask (``PAGEDLLM_CHECK_CANDIDATES``; 0 or 1, the
# default: none). Off until a GPU run shows the gain (docs/benchmarks.md, "a refused
# draw's next candidates").
CHECK_CANDIDATES = integer("PAGEDLLM_CHECK_CANDIDATES", 0, 0, 64)


class RankedCandidates:
    """The ranked candidates (``Sampler.candidates``) of a step's rows sampled without their
    mask, for its check (``StepGrammars.check``): ``start()`` queues the ranking and its copy
    to the host (once the step's ids are on their way, so it runs while the host checks
    them); calling the object reads them, starting them first if need be."""

    __slots__ = ("_draw", "_rows", "_device", "_read")

    def __init__(self, draw: Draw, rows: list[int], device: torch.device) -> None:
        self._draw, self._rows, self._device = draw, rows, device
        self._read: Callable[[], list[list[int]]] | None = None

    def start(self) -> None:
        if self._read is not None:
            return
        index = torch.tensor(self._rows, dtype=torch.long).to(self._device, non_blocking=True)
        self._read = host_copy(Sampler.candidates(self._draw, index, CHECK_CANDIDATES))
        self._draw = None

    def __call__(self) -> list[list[int]]:
        self.start()
        return self._read()


class HostBitmasks:
    """Host arrays for a step's bitmask rows (int32 ``[rows, width]``), ``rows`` up to
    ``max_rows``. On CUDA they are pinned (the copy to the device is a DMA, not a staging
    copy) and two take turns: a step's copy is done before the step after next fills its
    array, since the runner has read the step's sampled ids by then (and a check's copy
    is waited for with the ids it redraws). Elsewhere each call gives a fresh array."""

    def __init__(self, device: torch.device, max_rows: int) -> None:
        self._device = device
        self._max_rows = max_rows
        self._buffers: list[torch.Tensor] | None = None
        self._next = 0

    def __call__(self, num_rows: int, width: int) -> np.ndarray:
        if self._device.type != "cuda":
            return np.empty((num_rows, width), dtype=np.int32)
        if self._buffers is None or self._buffers[0].shape[1] != width:
            self._buffers = [torch.empty((self._max_rows, width), dtype=torch.int32,
                                         pin_memory=True) for _ in range(2)]
        self._next ^= 1
        return self._buffers[self._next][:num_rows].numpy()


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.model_config, self.device)
        # The KV cache's element type: the model's, or float8_e4m3fn (--kv-cache-dtype fp8).
        self.kv_cache_dtype = kv_cache_torch_dtype(config.cache_config.cache_dtype, self.dtype)
        self.block_size = config.cache_config.block_size
        self.vocab_size = config.model_config.vocab_size
        torch.manual_seed(config.model_config.seed)
        self.model = load_model(config.model_config, self.device, self.dtype)
        spec = config.speculative_config
        self.speculative = spec is not None
        # The draft model of speculative decoding; its KV cache shares the target's blocks.
        self.drafter: DraftModel | None = None
        if spec is not None and spec.method == "draft_model":
            self.drafter = DraftModel(config, self.device, self.dtype)
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        # Host blocks that preempted requests' KV is swapped out to (--swap-space).
        self.num_host_blocks = 0
        self.host_kv_caches: list[torch.Tensor] = []
        self.input_batch = InputBatch(
            config.scheduler_config.max_num_seqs, config.model_config.max_model_len, self.block_size
        )
        # Outlive preemption: dropped only when the request finishes.
        self.generators: dict[str, torch.Generator] = {}
        self.device_inputs: DeviceInputBuffers | None = None
        if self.device.type == "cuda":
            sched = config.scheduler_config
            # The draft's catch-up forward adds each sampling request's new token.
            max_tokens = sched.max_num_batched_tokens + (
                sched.max_num_seqs if self.drafter is not None else 0)
            self.device_inputs = DeviceInputBuffers(
                max_tokens, sched.max_num_seqs,
                -(-config.model_config.max_model_len // self.block_size), self.device,
            )
        self.graph_runner: CudaGraphRunner | None = None
        # Launched steps whose ids have not been read, oldest first (at most two).
        self._unresolved: deque[AsyncStepOutput] = deque()
        # The last launched step's sampled ids on the device: the pending tokens' source.
        self._last_sampled: torch.Tensor | None = None
        # On an earlier pipeline stage, the wait for the receive those ids arrive by: they
        # are read only after it (gloo fills the buffer from another thread, NCCL on its
        # own stream). None on the last stage.
        self._last_sampled_arrival: Callable[[], object] | None = None
        self._readback: SampledIdsReadback | None = None
        # Token counts of the penalised requests, by batch row (made on first need).
        self.token_counts: TokenCounts | None = None
        # Pinned host buffers of the constrained rows' bitmasks (CUDA; made on first need).
        self._bitmasks = HostBitmasks(self.device, config.scheduler_config.max_num_seqs)
        # The masks filled ahead of a step (``StepGrammars.sampled``) apart: ``masks_ahead``
        # may hand them to the sampler as they are, the fill writing where the copy reads.
        self._ahead_bitmasks = HostBitmasks(self.device, config.scheduler_config.max_num_seqs)
        # The last launched step, while its rows sampled without a mask await their check.
        self._unchecked: AsyncStepOutput | None = None
        # Told once the next forward pass is launched, after a check redrew rows.
        self._after_launch: Callable[[], None] | None = None
        # The last step's masked sampling, launched before the next forward pass (see
        # ``_defer_sample``), and that step's output, whose ids its grammars take once
        # the next forward pass is launched.
        self._deferred: Callable[[], None] | None = None
        self._untaken: AsyncStepOutput | None = None
        # The last sampled step's candidates, to rank once its ids are on their way.
        self._step_candidates: RankedCandidates | None = None
        # The last check's redrawn ids on their way to the host (see ``_take_redrawn_ids``).
        self._redrawn: Callable[[], None] | None = None
        self._redrawn_readback: SampledIdsReadback | None = None
        if self.device.type == "cuda":
            self._readback = SampledIdsReadback(config.scheduler_config.max_num_seqs)
            self._redrawn_readback = SampledIdsReadback(config.scheduler_config.max_num_seqs)

    @property
    def verify_width(self) -> int:
        """Rows a request computes in a verification step: ``k + 1`` (0: no speculation)."""
        spec = self.config.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens + 1

    @property
    def cuda_graphs_enabled(self) -> bool:
        """Decode, single-prompt and verification steps replay CUDA graphs: on CUDA with
        the (graph-safe) Triton attention backend, unless ``enforce_eager`` or pipeline
        parallelism (whose stages hand hidden states over outside the graphs: eager
        steps)."""
        return (
            self.device.type == "cuda"
            and not self.config.model_config.enforce_eager
            and attention_backend_name(self.device) == "triton"
            and get_pp().num_stages == 1
        )

    # -- KV cache -----------------------------------------------------------------------
    def initialize_kv_cache(self) -> int:
        """Size and allocate the KV cache, compile the Triton kernels' variants
        (``warmup.py``), then capture the CUDA graphs (which need the cache's addresses);
        returns the number of blocks.

        The graphs' memory pool is reserved in the sizing, so the cache, the activations
        of the largest eager step and the graphs together stay within
        ``gpu_memory_utilization``. With speculative decoding the target's verify graphs
        (``k + 1`` rows a request) and the draft's (its catch-up forward,
        ``MAX_CATCH_UP_TOKENS`` rows a request) are captured beside the others.
        """
        use_graphs = self.cuda_graphs_enabled
        sched = self.config.scheduler_config
        model_config = self.config.model_config
        reserved = 0
        if use_graphs:
            reserved = sum(self._graph_memory_estimate(model, width)
                           for model, width in self._graphed_models())
        num_blocks = determine_num_blocks(
            self.config, self.kv_cache_dtype, self.device, self._profile_run, reserved_bytes=reserved
        )
        # Tensor-parallel ranks hold the same block ids: the smallest rank's count for all.
        num_blocks = min_over_ranks(num_blocks, self.device)
        self.kv_caches = allocate_kv_caches(self.config, num_blocks, self.kv_cache_dtype, self.device)
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks, self.kv_caches[0].dtype)
        swap_space_gb = self.config.cache_config.swap_space_gb
        if swap_space_gb:
            problem = swap_space_problem(swap_space_gb, host_memory_available())
            if problem is not None:
                raise ValueError(problem)
            self.num_host_blocks = host_blocks(
                swap_space_gb, bytes_per_block(self.config, self.kv_cache_dtype))
            if self.num_host_blocks < 1:
                raise ValueError(f"--swap-space {swap_space_gb} GiB holds no KV block: give "
                                 "more, or 0.")
            self.host_kv_caches = allocate_host_kv_caches(
                self._swapped_caches(), self.num_host_blocks, pin=self.device.type == "cuda")
            logger.info("Swap space: %d blocks of KV (%d tokens) in %g GiB of host memory",
                        self.num_host_blocks, self.num_host_blocks * self.block_size,
                        swap_space_gb)
        models = [(self.model, self.kv_caches)]
        if self.drafter is not None:
            models.append((self.drafter.model, self.drafter.kv_caches))
        if (self.device.type == "cuda" and attention_backend_name(self.device) == "triton"
                and get_pp().num_stages == 1):
            for model, kv_caches in models:
                warm_up_kernels(
                    model, self.sampler, kv_caches,
                    warm_up_layouts(sched.max_num_seqs, sched.max_num_batched_tokens,
                                    model_config.max_model_len),
                    block_size=self.block_size, vocab_size=self.vocab_size, device=self.device,
                )
        if use_graphs:
            graph_runners = self.make_graph_runners()
            for runner in graph_runners:
                runner.capture()
            if self.speculative:
                verify_sizes = self.graph_runner.sizes[VERIFY]
                logger.info(
                    "Speculative decoding with CUDA graphs: verification steps of up to %d "
                    "requests of 1..%d tokens replay the verify graphs; larger ones, and "
                    "steps with longer prompt chunks, run eagerly%s.",
                    max(verify_sizes, default=0), self.verify_width,
                    "; the draft model's catch-up and decodes replay its own graphs"
                    if self.drafter else "")
            pool_bytes = sum(runner.pool_bytes for runner in graph_runners)
            if pool_bytes > reserved:
                logger.warning(
                    "CUDA graphs took %.0f MiB, more than the %.0f MiB reserved for them: "
                    "lower --gpu-memory-utilization if memory runs short.",
                    pool_bytes / 2**20, reserved / 2**20,
                )
        return num_blocks

    def _graphed_models(self) -> list[tuple[torch.nn.Module, int]]:
        """The models whose forwards replay CUDA graphs, each with the rows a request
        computes in its verify graphs: the target's ``k + 1`` (0: no speculation), the
        draft's catch-up ``MAX_CATCH_UP_TOKENS``."""
        graphed = [(self.model, self.verify_width)]
        if self.drafter is not None:
            graphed.append((self.drafter.model, MAX_CATCH_UP_TOKENS))
        return graphed

    def make_graph_runners(self, use_graphs: bool = True) -> list[CudaGraphRunner]:
        """Make the graph runners of the target and the draft over their KV caches (not
        captured yet) and route their steps through them; ``use_graphs=False`` runs the
        same padded forwards eagerly (tests without a GPU)."""
        sched = self.config.scheduler_config
        caches = [self.kv_caches] + ([self.drafter.kv_caches] if self.drafter is not None else [])
        head_dims = [self.config.model_config.head_dim] + (
            [self.drafter.model_config.head_dim] if self.drafter is not None else [])
        runners = [CudaGraphRunner(
            model, kv_caches,
            max_num_seqs=sched.max_num_seqs,
            max_model_len=self.config.model_config.max_model_len,
            block_size=self.block_size,
            device=self.device,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            verify_width=width,
            use_graphs=use_graphs,
            mixed_graphs=mixed_graphs_enabled(),
            short_decode_len=self._short_decode_len(head_dim),
        ) for (model, width), kv_caches, head_dim in zip(self._graphed_models(), caches, head_dims)]
        self.graph_runner = runners[0]
        if self.drafter is not None:
            self.drafter.graph_runner = runners[1]
        return runners

    @torch.inference_mode()
    def _short_decode_len(self, head_dim: int) -> int | None:
        """The context bound under which decode graphs are captured a second time (the
        attention takes another tile there: ``triton_decode.short_decode_context``)."""
        if self.device.type != "cuda":
            return None
        from pagedllm.layers.attention.triton_decode import short_decode_context

        return short_decode_context(head_dim, self.device, self.kv_cache_dtype.itemsize == 1)

    def _graph_memory_estimate(self, model: torch.nn.Module, verify_width: int) -> int:
        """Bytes to keep free for the graphs' pool of ``model``, whose verify graphs hold
        ``verify_width`` rows a request: the activations of one eager forward of the
        largest graph's tokens, with a 50% + 64 MiB margin for the split-K scratch and the
        decode and prompt graphs' outputs, plus the verify graphs' outputs (each keeps its
        ``[B * verify_width, hidden]`` rows)."""
        sched = self.config.scheduler_config
        verify_rows = [b * verify_width for b in verify_capture_sizes(
            sched.max_num_seqs, verify_width, sched.max_num_batched_tokens)]
        max_model_len = self.config.model_config.max_model_len
        mixed = (mixed_capture_sizes(min(sched.max_num_batched_tokens, max_model_len))
                 if mixed_graphs_enabled() else [])
        num_tokens = max([capture_sizes(sched.max_num_seqs)[-1], *prompt_capture_sizes(
            sched.max_num_batched_tokens, max_model_len), *verify_rows, *mixed])
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        with set_forward_context(None, []):
            hidden = model(input_ids, positions)
        row_bytes = hidden.shape[-1] * hidden.element_size()
        del hidden
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - base
        return int(activations * 1.5) + (64 << 20) + sum(verify_rows) * row_bytes

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """The largest step the scheduler can send, run once so its activations are counted,
        then its rows sampled with penalties, top-k and top-p (the sampler's largest working
        set). The penalties' token-count table is made here and kept, so the cache is sized
        with it in place and the first penalised request allocates nothing."""
        sched = self.config.scheduler_config
        num_tokens = min(sched.max_num_batched_tokens, self.config.model_config.max_model_len)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        with set_forward_context(None, []):
            hidden = self.model(input_ids, positions)
        if self.drafter is not None:
            self.drafter.profile_run(num_tokens)
        self.token_counts = TokenCounts(sched.max_num_seqs, self.vocab_size, self.device)
        if not get_pp().is_last:
            return  # the last pipeline stage samples
        logits = self.model.compute_logits(hidden[-sched.max_num_seqs:])
        rows = logits.shape[0]
        params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1,
                                 frequency_penalty=0.1, presence_penalty=0.1)] * rows
        self.sampler(logits, SamplingMetadata.build(
            params=params, prompt_token_ids=[[0]] * rows, output_token_ids=[[0]] * rows,
            generators=[None] * rows, vocab_size=self.vocab_size, device=self.device,
            counts=RowCounts(self.token_counts, list(range(rows)), [object() for _ in range(rows)]),
        ))

    # -- one step ---------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return its output (launch, then wait for the sampled ids)."""
        return self.execute_model_async(scheduler_output).get()

    def _swapped_caches(self) -> list[torch.Tensor]:
        """The caches a swapped block's KV lives in: every layer's, the draft model's too
        (its KV shares the target's block ids)."""
        return self.kv_caches + (self.drafter.kv_caches if self.drafter is not None else [])

    def _swap_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """The step's swap copies, out then in, queued before its forward pass: in order on
        the device, so a block swapped out holds what the steps before wrote, and one this
        step reuses is read before it is written. On a GPU nothing here waits for the
        device: the block ids and the blocks move from and to page-locked memory."""
        non_blocking = self.device.type == "cuda"
        layers = [layer.view(torch.uint8) for layer in self._swapped_caches()]

        def device_ids(block_ids: list[int]) -> torch.Tensor:
            # From page-locked memory: a copy from pageable memory would wait for the
            # steps still running on the device.
            ids = torch.tensor(block_ids, dtype=torch.int64, pin_memory=non_blocking)
            return ids.to(self.device, non_blocking=non_blocking)

        for start, block_ids in scheduler_output.blocks_to_swap_out:
            ids = device_ids(block_ids)
            end = start + len(block_ids)
            for layer, host in zip(layers, self.host_kv_caches):
                host[start:end].copy_(layer.index_select(1, ids).transpose(0, 1).contiguous(),
                                      non_blocking=non_blocking)
        for start, block_ids in scheduler_output.blocks_to_swap_in:
            ids = device_ids(block_ids)
            end = start + len(block_ids)
            for layer, host in zip(layers, self.host_kv_caches):
                blocks = host[start:end].to(self.device, non_blocking=non_blocking)
                layer.index_copy_(1, ids, blocks.transpose(0, 1))

    @torch.inference_mode()
    def execute_model_async(
        self,
        scheduler_output: SchedulerOutput,
        grammar: Callable[[list[str], Callable], np.ndarray] | None = None,
    ) -> AsyncStepOutput:
        """Launch one step; its output is read when ``get()`` is called on the result.

        Steps must be launched in the scheduler's order, and the output of a step must be
        taken before the scheduler plans the step after next: at most one launched step
        may be unresolved when a step is launched (an older one is resolved here).

        ``grammar(request_ids, allocate)``: the allowed next tokens of the step's
        constrained sampling rows, written into ``allocate(rows, words)`` (an int32 host
        array the runner provides, pinned on CUDA; see ``pagedllm.structured``) and
        returned; asked once the forward pass is launched, it may resolve the step
        launched before. When it also has ``check(request_ids, token_ids, allocate)``
        (``StepGrammars``), rows that allow it are checked after sampling instead
        (check-then-mask, see the module's docstring).
        """
        if scheduler_output.blocks_to_swap_out or scheduler_output.blocks_to_swap_in:
            self._swap_blocks(scheduler_output)
        self._update_states(scheduler_output)
        while len(self._unresolved) > 1:
            self._unresolved[0].get()
        if scheduler_output.is_empty:
            return AsyncStepOutput.ready(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        inputs = self.input_batch.prepare(scheduler_output.num_scheduled_tokens,
                                          scheduler_output.spec_token_ids)
        if self._unchecked is not None:  # its ids feed this forward pass: check them first
            self._unchecked.settle()
        if self._deferred is not None:  # its ids feed this forward pass: sample them first
            self._deferred()
        speculative = bool(scheduler_output.spec_token_ids or scheduler_output.num_lookahead_tokens)
        # Every row samples in a decode step: no other row to leave out, nothing to ask.
        samples_only = not speculative and (
            len(inputs.sample_req_indices) == inputs.num_tokens
            or not self._wants_prompt_logprobs(inputs))
        hidden_states, logits_indices = self._run_model(inputs, samples_only=samples_only)
        self._take_redrawn_ids()
        if self._after_launch is not None:
            after_launch, self._after_launch = self._after_launch, None
            after_launch()
        if self._untaken is not None:  # the grammars take its ids, filling the next masks
            untaken, self._untaken = self._untaken, None
            untaken.settle()
        if not get_pp().is_last:
            return self._take_sampled_ids(inputs)

        prompt_logprobs = self._prompt_logprobs(inputs, hidden_states)
        if speculative:
            return AsyncStepOutput.ready(self._speculative_step(
                scheduler_output, inputs, hidden_states, prompt_logprobs, grammar))
        pending = self._last_sampled  # the previous step's ids: this step's pending tokens
        states = [inputs.states[i] for i in inputs.sample_req_indices]
        if not states:
            self._draft_follows(inputs, pending)
            return AsyncStepOutput.ready(ModelRunnerOutput(
                req_ids=inputs.req_ids, sampled_token_ids=[[] for _ in inputs.req_ids],
                prompt_logprobs=prompt_logprobs,
            ))
        rows = hidden_states if logits_indices is None else hidden_states[logits_indices]
        logits = self.model.compute_logits(rows)
        deferred_rows = self._rows_sampled_under_masks_ahead(states, grammar)
        if deferred_rows:
            return self._defer_sample(inputs, states, deferred_rows, logits, grammar,
                                      prompt_logprobs)
        out, check = self._sample(logits, states, grammar)
        sampled = out.sampled_token_ids
        self.input_batch.mark_pending(states)
        self._last_sampled, self._last_sampled_arrival = sampled, None

        def check_ids(token_ids: list[int]) -> list[int]:
            while self._unresolved[0] is not result:
                self._unresolved[0].get()  # the grammars take earlier steps' tokens first
            if self._unchecked is result:
                self._unchecked = None
            return check(token_ids)

        def finish(token_ids: list[int] | None) -> ModelRunnerOutput:
            while self._unresolved[0] is not result:
                self._unresolved[0].get()  # resolve in launch order
            self._unresolved.popleft()
            self._take_redrawn_ids()
            if get_pp().num_stages > 1:  # the earlier stages' inputs need the ids
                send_sampled_ids(torch.tensor(token_ids, dtype=torch.int64, device=self.device))
            return self._step_output(inputs, states, token_ids, out.logprobs, prompt_logprobs)

        read = self._readback.start(sampled) if self._readback is not None else sampled.tolist
        if self._step_candidates is not None:  # ranked while the host checks the ids
            self._step_candidates.start()
            self._step_candidates = None
        self._draft_follows(inputs, pending)
        result = AsyncStepOutput(read, finish, None if check is None else check_ids)
        self._unresolved.append(result)
        if check is not None:
            self._unchecked = result
        return result

    def _rows_sampled_under_masks_ahead(self, states: list[CachedRequestState],
                                        grammar) -> list[int]:
        """The step's constrained rows when they are sampled under masks filled ahead, the
        sampling launched just before the next forward pass (``_defer_sample``): where the
        engine's grammars fill every row's next mask while the device computes and keep a
        step in flight (``StepGrammars.defers_masks``, see ``masks_ahead_wanted``); else
        none."""
        if not self.input_batch.num_constrained or not getattr(grammar, "defers_masks", False):
            return []
        return [j for j, s in enumerate(states) if s.sampling_params.structured_outputs is not None]

    def _defer_sample(
        self,
        inputs: StepInputs,
        states: list[CachedRequestState],
        rows: list[int],
        logits: torch.Tensor,
        grammar,  # StepGrammars
        prompt_logprobs: dict[str, list[LogprobsEntry | None]],
    ) -> AsyncStepOutput:
        """Sample the step with its constrained ``rows`` masked first, the masks those the
        grammars fill while the device computes this step (``StepGrammars.masks_ahead``),
        so no check waits between this step's ids and the next launch: the sampling is
        launched at the start of the next step's launch (or when the step's output is
        read, if that comes first), and the next forward pass reads the ids on the
        device. Once that forward pass is launched, the step's ids are read and its
        grammars take them (``StepGrammars.sampled``), which starts the next masks."""
        request_ids = [states[j].request_id for j in rows]
        index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        metadata = self._sampling_metadata(states, grammar, [])
        self.input_batch.mark_pending(states)
        sampled: list = []  # [SamplerOutput, read the ids], once launched

        @torch.inference_mode()  # also when reading the output launches it
        def launch() -> None:
            if sampled:
                return
            bitmask = grammar.masks_ahead(request_ids, self._bitmasks)
            metadata.grammar_rows = index
            metadata.grammar_bitmask = torch.from_numpy(bitmask).to(self.device,
                                                                    non_blocking=True)
            out = self.sampler(logits, metadata)
            metadata.record_sampled(out.sampled_token_ids)
            if self._deferred is launch:
                self._deferred = None
                self._last_sampled, self._last_sampled_arrival = out.sampled_token_ids, None
            ids = out.sampled_token_ids
            read_ids = ids.tolist if self._readback is None else self._readback.start(ids)
            sampled.extend((out, read_ids))

        def read() -> list[int]:
            launch()
            return sampled[1]()

        def take(token_ids: list[int]) -> list[int]:
            grammar.sampled(request_ids, [token_ids[j] for j in rows], self._ahead_bitmasks)
            return token_ids

        def finish(token_ids: list[int] | None) -> ModelRunnerOutput:
            while self._unresolved[0] is not result:
                self._unresolved[0].get()  # resolve in launch order
            self._unresolved.popleft()
            if self._untaken is result:
                self._untaken = None
            return self._step_output(inputs, states, token_ids, sampled[0].logprobs,
                                     prompt_logprobs)

        self._deferred = launch
        result = AsyncStepOutput(read, finish, take)
        self._unresolved.append(result)
        self._untaken = result
        return result

    def _take_sampled_ids(self, inputs: StepInputs) -> AsyncStepOutput:
        """A step on an earlier pipeline stage: its sampled ids come from the last stage
        once it has read them (``finish`` there); the step's output describes them as the
        last stage's does, without logprobs (only the last stage's output is reported)."""
        states = [inputs.states[i] for i in inputs.sample_req_indices]
        if not states:
            return AsyncStepOutput.ready(ModelRunnerOutput(
                req_ids=inputs.req_ids, sampled_token_ids=[[] for _ in inputs.req_ids]))
        ids, wait = recv_sampled_ids(len(states), self.device)
        self.input_batch.mark_pending(states)
        self._last_sampled, self._last_sampled_arrival = ids, wait

        def read() -> list[int]:
            wait()
            return ids.tolist()

        def finish(token_ids: list[int] | None) -> ModelRunnerOutput:
            while self._unresolved[0] is not result:
                self._unresolved[0].get()  # resolve in launch order
            self._unresolved.popleft()
            return self._step_output(inputs, states, token_ids, None, {})

        result = AsyncStepOutput(read, finish)
        self._unresolved.append(result)
        return result

    def _sample(
        self,
        logits: torch.Tensor,
        states: list[CachedRequestState],
        grammar: Callable[[list[str], Callable], np.ndarray] | None,
    ) -> tuple[SamplerOutput, Callable[[list[int]], list[int]] | None]:
        """One token per state's row of ``logits``, and ``check(token_ids)`` when rows were
        sampled without their grammar mask: it takes the step's sampled ids once read on
        the host and returns them final (``_check_sampled``); it must run once, before any
        later step's forward pass or sampling."""
        masked, checked = self._constrained_rows(states, grammar)
        metadata = self._sampling_metadata(states, grammar, masked)
        metadata.keep_draw = bool(checked)
        out = self.sampler(logits, metadata)
        if not checked:
            metadata.record_sampled(out.sampled_token_ids)
            return out, None
        candidates = None
        if CHECK_CANDIDATES > 1:
            candidates = RankedCandidates(out.draw, checked, self.device)
            self._step_candidates = candidates
        return out, functools.partial(self._check_sampled, states, checked, out, metadata,
                                      grammar, candidates)

    @torch.inference_mode()
    def _check_sampled(
        self,
        states: list[CachedRequestState],
        rows: list[int],
        out: SamplerOutput,
        metadata: SamplingMetadata,
        grammar,  # StepGrammars, or a tensor-parallel rank's proxy of it
        candidates: RankedCandidates | None,
        token_ids: list[int],
    ) -> list[int]:
        """Check-then-mask: ``token_ids`` (the step's sampled ids, on the host), whose
        tokens that the grammars of ``rows`` (sampled without their mask) refuse are
        replaced by the next of their draw's candidates the grammar allows (the first
        ``CHECK_CANDIDATES`` of its ranking, ``Sampler.candidates``), or where it allows
        none, drawn again under their mask (``Sampler.redraw``): the same token either way.
        The ids on the device are corrected in place (later steps read them as pending
        tokens) and counted for the penalties. A candidate taken is in ``token_ids`` at
        once; the redrawn ids reach ``token_ids`` and the grammar (``redrawn``) in
        ``_take_redrawn_ids``, once the next forward pass is launched (or when the step's
        output is made, if that comes first); then the grammar hears ``forward_launched``
        (see ``StepGrammars``)."""
        if self._step_candidates is candidates:  # not started early: read on need only
            self._step_candidates = None
        refused, bitmask, substituted = grammar.check(
            [states[j].request_id for j in rows], [token_ids[j] for j in rows],
            self._bitmasks, candidates)
        sampled = out.sampled_token_ids
        if substituted:
            taken = [rows[i] for i, _ in substituted]
            tokens = [token for _, token in substituted]
            for j, token in zip(taken, tokens):
                token_ids[j] = token
            sampled.index_copy_(
                0, torch.tensor(taken, dtype=torch.long).to(self.device, non_blocking=True),
                torch.tensor(tokens, dtype=torch.long).to(self.device, non_blocking=True))
        if refused:
            redrawn = [rows[i] for i in refused]
            index = torch.tensor(redrawn, dtype=torch.long).to(self.device, non_blocking=True)
            tokens = self.sampler.redraw(
                out.draw, index, torch.from_numpy(bitmask).to(self.device, non_blocking=True))
            sampled.index_copy_(0, index, tokens)
            readback = self._redrawn_readback
            read = tokens.tolist if readback is None else readback.start(tokens)

            def take() -> None:
                redrawn_ids = read()  # the step's one extra copy
                for j, token in zip(redrawn, redrawn_ids):
                    token_ids[j] = token
                if hasattr(grammar, "redrawn"):
                    grammar.redrawn(redrawn_ids)

            self._redrawn = take
        if hasattr(grammar, "forward_launched"):
            self._after_launch = grammar.forward_launched
        metadata.record_sampled(sampled)
        out.draw = None  # the step's logits and noise, no longer needed
        return token_ids

    def _take_redrawn_ids(self) -> None:
        """Bring the last check's redrawn ids to the host: into the checked step's ids,
        and to its grammar. Their draw is queued ahead of the next forward pass, whose
        launch need not wait for this read."""
        if self._redrawn is not None:
            take, self._redrawn = self._redrawn, None
            take()

    def _sampling_metadata(
        self,
        states: list[CachedRequestState],
        grammar: Callable[[list[str], Callable], np.ndarray] | None,
        masked: list[int],
    ) -> SamplingMetadata:
        """The metadata of one sampled row per state (its last computed token's); the
        ``masked`` rows get their grammar's bitmask."""
        return SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            prompt_token_ids=[s.prompt_token_ids for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            generators=[self.generators.get(s.request_id) for s in states],
            vocab_size=self.vocab_size,
            device=self.device,
            pending_token_ids=self._pending_for_sampling(states),
            counts=self._token_counts_for(states),
            grammar=self._grammar_rows(states, masked, grammar),
        )

    def _speculative_step(
        self,
        so: SchedulerOutput,
        inputs: StepInputs,
        hidden_states: torch.Tensor,
        prompt_logprobs: dict[str, list[LogprobsEntry | None]],
        grammar: Callable[[list[str], Callable], np.ndarray] | None,
    ) -> ModelRunnerOutput:
        """Sample a step of a speculative engine and read its tokens: verifying requests
        through the rejection sampler, the others as usual; append them; then let the
        draft model catch up and propose."""
        spec = so.spec_token_ids
        sampled: list[list[int]] = [[] for _ in inputs.req_ids]
        logprobs: dict[str, list[LogprobsEntry]] = {}
        verifying = [i for i in inputs.sample_req_indices if inputs.req_ids[i] in spec]
        plain = [i for i in inputs.sample_req_indices if inputs.req_ids[i] not in spec]
        if plain:
            states = [inputs.states[i] for i in plain]
            rows = torch.from_numpy(inputs.query_start_loc[np.asarray(plain) + 1] - 1)
            logits = self.model.compute_logits(hidden_states[rows.to(self.device)])
            out, check = self._sample(logits, states, grammar)
            token_ids = out.sampled_token_ids.tolist()
            if check is not None:
                token_ids = check(token_ids)
                self._take_redrawn_ids()
            for j, (i, token) in enumerate(zip(plain, token_ids)):
                sampled[i] = [token]
                k = inputs.states[i].sampling_params.logprobs
                if k is not None and out.logprobs is not None:
                    logprobs[inputs.req_ids[i]] = [out.logprobs.to_entries(j, k)]
        if verifying:
            runs, verified_logprobs = verify_proposals(
                self.model.compute_logits, hidden_states, inputs, verifying, spec,
                self.generators, self._draft_probs, self.vocab_size,
                functools.partial(self._verify_bitmask, grammar))
            for i, run in zip(verifying, runs):
                sampled[i] = run
            logprobs.update(verified_logprobs)
            if self.token_counts is not None:  # their rows missed the proposals' tokens
                for i in verifying:
                    self.token_counts.owners[inputs.states[i].row] = None
        batch = self.input_batch
        for state, tokens in zip(inputs.states, sampled):
            for token in tokens:
                batch.append_token(state, token)
        proposals: dict[str, list[int]] = {}
        if self.drafter is not None:
            proposals = self.drafter.propose(
                batch, inputs,
                num_scheduled=[so.num_scheduled_tokens[r] for r in inputs.req_ids],
                num_verified=[len(spec.get(r, ())) for r in inputs.req_ids],
                new_tokens=sampled,
                num_lookahead=so.num_lookahead_tokens,
                generators=self.generators,
                forward=self._draft_forward,
            )
        return ModelRunnerOutput(
            req_ids=inputs.req_ids, sampled_token_ids=sampled, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, spec_token_ids=proposals,
        )

    def _draft_follows(self, inputs: StepInputs, pending: torch.Tensor | None) -> None:
        """A step that neither verifies nor proposes: the draft model, if any, computes the
        step's tokens as the target did (``DraftModel.follow``), its pending tokens read
        from ``pending`` (the previous step's sampled ids)."""
        if self.drafter is not None:
            self.drafter.follow(inputs, functools.partial(self._draft_forward, inputs, pending))

    def _draft_probs(self, request_id: str) -> torch.Tensor | None:
        """The distributions the request's proposals were drawn from (None: n-gram lookup
        or greedy drafting, point masses)."""
        return None if self.drafter is None else self.drafter.probs(request_id)

    def _draft_forward(self, inputs: StepInputs, pending: torch.Tensor | None) -> torch.Tensor:
        """The draft model's hidden states over ``inputs`` (see ``DraftModel.propose``)."""
        return self._run_model(inputs, self.drafter, pending)[0]

    def _constrained_rows(
        self,
        states: list[CachedRequestState],
        grammar: Callable[[list[str], Callable], np.ndarray] | None,
    ) -> tuple[list[int], list[int]]:
        """The constrained sampling rows: (masked before sampling, checked after). A row is
        checked when the engine can check tokens and nothing before its draw reads the
        masked distribution (logprobs are of it; top-k, top-p and min-p select from it)."""
        if not self.input_batch.num_constrained:
            return [], []
        can_check = hasattr(grammar, "check")
        masked: list[int] = []
        checked: list[int] = []
        for j, state in enumerate(states):
            p = state.sampling_params
            if p.structured_outputs is not None:
                fast = can_check and p.logprobs is None and not p.filters_tokens
                (checked if fast else masked).append(j)
        return masked, checked

    def _grammar_rows(
        self,
        states: list[CachedRequestState],
        rows: list[int],
        grammar: Callable[[list[str], Callable], np.ndarray] | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(sampling rows, their bitmask) on the device for the constrained ``rows`` to mask
        before sampling, if any."""
        if not rows:
            return None
        if grammar is None:
            raise ValueError("A step with constrained rows needs grammar.")
        bitmask = grammar([states[j].request_id for j in rows], self._bitmasks)
        # Asynchronous copies: a blocking one would wait for this step's forward pass.
        return (torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True),
                torch.from_numpy(bitmask).to(self.device, non_blocking=True))

    def _verify_bitmask(self, grammar, request_ids: list[str],
                        proposals: list[list[int]]) -> torch.Tensor:
        """The verification rows' bitmask of constrained requests checking ``proposals``
        (see ``StepGrammars.verify_bitmask``), on the device."""
        if not hasattr(grammar, "verify_bitmask"):
            raise ValueError("A speculative step with constrained requests needs "
                             "grammar.verify_bitmask.")
        bitmask = grammar.verify_bitmask(request_ids, proposals, self._verify_bitmask_buffer)
        return torch.from_numpy(bitmask).to(self.device, non_blocking=True)

    @staticmethod
    def _verify_bitmask_buffer(num_rows: int, width: int) -> np.ndarray:
        """A host array for a verification bitmask (up to ``(k + 1) x max_num_seqs`` rows:
        a fresh one; speculative steps read their ids before the next step's)."""
        return np.empty((num_rows, width), dtype=np.int32)

    def _token_counts_for(self, states: list[CachedRequestState]) -> RowCounts | None:
        """The sampling rows in the penalties' token-count table (one row per batch row,
        owned by the request's state: a request added again is counted afresh), when any
        row has a penalty; the table is made on first need. Rows of requests without
        penalties may fall behind in steps without any; their counts are never used."""
        if not any(s.sampling_params.has_penalties for s in states):
            return None
        if self.token_counts is None:
            self.token_counts = TokenCounts(
                self.config.scheduler_config.max_num_seqs, self.vocab_size, self.device)
        return RowCounts(self.token_counts, [s.row for s in states], states)

    def _pending_for_sampling(
        self, states: list[CachedRequestState]
    ) -> tuple[list[int], torch.Tensor] | None:
        """The pending tokens of sampling rows whose sampling reads earlier outputs
        (``SamplingParams.reads_output``): their rows and ids on the device, for the sampler."""
        batch = self.input_batch
        rows, sources = [], []
        for j, state in enumerate(states):
            if state.sampling_params.reads_output and batch.num_pending[state.row]:
                rows.append(j)
                sources.append(int(batch.pending_sample_row[state.row]))
        if not rows:
            return None
        index = torch.tensor(sources, dtype=torch.long).to(self.device, non_blocking=True)
        return rows, self._last_sampled[index]

    def _step_output(
        self,
        inputs: StepInputs,
        states: list[CachedRequestState],
        token_ids: list[int],
        logprobs_tensors: LogprobsTensors | None,
        prompt_logprobs: dict[str, list[LogprobsEntry | None]],
    ) -> ModelRunnerOutput:
        """Append the step's sampled ids to the batch and describe them per request."""
        batch = self.input_batch
        sampled: list[list[int]] = [[] for _ in inputs.req_ids]
        logprobs: dict[str, list[LogprobsEntry]] = {}
        for j, (i, state, token) in enumerate(zip(inputs.sample_req_indices, states, token_ids)):
            if batch.is_live(state):
                batch.append_pending_token(state, token)
            sampled[i] = [token]
            k = state.sampling_params.logprobs
            if k is not None and logprobs_tensors is not None:
                logprobs[state.request_id] = [logprobs_tensors.to_entries(j, k)]
        return ModelRunnerOutput(
            req_ids=inputs.req_ids, sampled_token_ids=sampled,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.generators.pop(req_id, None)
            if self.drafter is not None:
                self.drafter.forget(req_id)
        self.input_batch.update(so)
        for new in so.scheduled_new_reqs:
            seed = new.sampling_params.seed
            if seed is not None and new.request_id not in self.generators:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(seed)
                self.generators[new.request_id] = generator

    def _run_model(
        self,
        inputs: StepInputs,
        drafter: DraftModel | None = None,
        pending: torch.Tensor | None = None,
        samples_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward pass: hidden states ``[T, hidden]`` of the step's tokens, and the
        device indices of the rows whose logits are sampled (None when every row is, in
        order: a decode step in which every request samples).

        ``drafter``: run the draft model (its weights, KV cache and graphs) instead of the
        target; ``pending``: the device ids the step's pending tokens are read from
        (default: the last launched step's sampled ids). ``samples_only``: the caller
        reads the sampled rows alone, so a model that can (``prunes_to_output_rows``)
        computes only those in its last layer outside CUDA graphs; the hidden states are
        then those rows', in order (and the indices None)."""
        model, kv_caches, graph_runner = self.model, self.kv_caches, self.graph_runner
        if drafter is not None:
            model, kv_caches, graph_runner = drafter.model, drafter.kv_caches, drafter.graph_runner

        def fill(input_ids: torch.Tensor, step: StepInputs) -> None:
            self._fill_pending_tokens(input_ids, step, pending)

        every_row_samples = len(inputs.sample_req_indices) == inputs.num_tokens
        if graph_runner is not None and graph_runner.can_run(inputs):
            hidden_states = graph_runner.run(inputs, fill)
            if every_row_samples:
                return hidden_states, None
            return hidden_states, torch.from_numpy(inputs.logits_indices).to(self.device)
        if self.device_inputs is not None:
            staged = self.device_inputs.stage(inputs)
            metadata = self._attention_metadata(
                inputs, staged.slot_mapping, staged.query_start_loc, staged.seq_lens,
                staged.block_tables,
            )
            input_ids, positions, logits_indices = (
                staged.input_ids, staged.positions, staged.logits_indices)
        else:
            to = self._to_device
            metadata = self._attention_metadata(
                inputs, to(inputs.slot_mapping), to(inputs.query_start_loc.astype(np.int32)),
                to(inputs.seq_lens.astype(np.int32)), to(inputs.block_tables),
            )
            input_ids, positions = to(inputs.input_ids), to(inputs.positions)
            logits_indices = None if every_row_samples else to(inputs.logits_indices)
        fill(input_ids, inputs)
        outputs = None
        if (samples_only and not every_row_samples and get_pp().is_last
                and getattr(model, "prunes_to_output_rows", False)):
            outputs = OutputRows.last_tokens(metadata, inputs.sample_req_indices, logits_indices)
        with set_forward_context(metadata, kv_caches, outputs):
            hidden_states = model(input_ids, positions)
        if outputs is not None or every_row_samples:
            return hidden_states, None
        return hidden_states, logits_indices

    def _fill_pending_tokens(
        self, input_ids: torch.Tensor, inputs: StepInputs, source: torch.Tensor | None = None
    ) -> None:
        """Write the ids of the step's pending tokens into ``input_ids`` (the step's flat
        input ids on the device) from ``source`` (default: the last launched step's
        sampled ids), read at ``pending_sample_rows``."""
        if not len(inputs.pending_token_indices):
            return
        if source is None:
            source = self._last_sampled
            if self._last_sampled_arrival is not None:
                self._last_sampled_arrival()  # the last stage's ids are in the buffer
        if self.device_inputs is not None:
            indices = self.device_inputs.stage_pending(
                inputs.pending_token_indices, inputs.pending_sample_rows)
        else:
            indices = self._to_device(
                np.stack([inputs.pending_token_indices, inputs.pending_sample_rows]))
        input_ids[indices[0]] = source[indices[1]]

    def _attention_metadata(
        self,
        inputs: StepInputs,
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=inputs.num_tokens,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            max_query_len=inputs.max_query_len,
            max_seq_len=int(inputs.seq_lens.max()),
            block_size=self.block_size,
            query_start_loc_cpu=inputs.query_start_loc.tolist(),
            seq_lens_cpu=inputs.seq_lens.tolist(),
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array on a device with no staging buffers (the CPU: no copy at all)."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    @staticmethod
    def _asks_prompt_logprobs(state: CachedRequestState) -> bool:
        """Whether the request asks logprobs of prompt tokens the step computes."""
        return (state.sampling_params.prompt_logprobs is not None
                and state.num_computed_tokens < state.num_prompt_tokens)

    def _wants_prompt_logprobs(self, inputs: StepInputs) -> bool:
        return any(map(self._asks_prompt_logprobs, inputs.states))

    def _prompt_logprobs(
        self, inputs: StepInputs, hidden_states: torch.Tensor
    ) -> dict[str, list[LogprobsEntry | None]]:
        """Logprobs of the prompt tokens this step computed (logits at p score token p+1)."""
        result: dict[str, list[LogprobsEntry | None]] = {}
        for i, state in enumerate(inputs.states):
            if not self._asks_prompt_logprobs(state):
                continue
            k = state.sampling_params.prompt_logprobs
            start = state.num_computed_tokens
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
