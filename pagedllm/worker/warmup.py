"""Compile, before the first request, every kernel variant a step can need.

Triton compiles a kernel the first time it meets a new combination of its compile-time
switches: decode attention split into partitions or not, its sequences started longest
first or not, prompts beside decodes or alone, greedy or random sampling. On a server's
host each compilation takes about a second, so without a warm-up the first steps of each
kind stall while the engine serves them. The CUDA graphs compile what they capture
(decode batches, single prompts); ``warm_up_kernels`` runs eagerly, once, a small step of
each other kind the scheduler can send (``warm_up_layouts``) and samples from its logits,
then readies long prompts' library attention (``dense_prefill.warm_up``).

The warm-up steps cache nothing (every slot is -1) and attend to block 0 of the cache,
whatever it holds; their outputs are thrown away.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from pagedllm.layers.attention.backend import AttentionMetadata, set_forward_context
from pagedllm.layers.attention.layer import Attention
from pagedllm.layers.sampler import Sampler, SamplingMetadata
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# One step's sequences as (cached context tokens, new tokens): a decode computes 1.
Layout = tuple[tuple[int, int], ...]

PROMPT_LENGTHS = (2, 3, 5, 9, 17, 33)  # one per doubling: every prefill query tile is met
MIXED_PROMPT = 5  # the prompt beside the decode batches, and the two prompts' length
SHORT_CONTEXT = 16  # decodes too short to split
LONG_CONTEXT = 2048  # decodes long enough to split when few


def warm_up_layouts(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> list[Layout]:
    """The warm-up steps, each clipped to the engine's limits (``max_num_seqs``, the step's
    token budget, ``max_model_len``):

    * a prompt of each of ``PROMPT_LENGTHS`` tokens, alone and beside a decode: the prefill
      kernel sizes its query tile by the longest prompt (one size per doubling) and
      specialises for steps with decodes;
    * two prompts;
    * decode batches of one sequence and of ``LONGEST_FIRST_MIN_SEQS`` (the fewest started
      longest first), at a short and a long context, alone and beside a prompt: decode
      attention splits a batch by its size and its longest context only, so these reach
      every combination a real step can (a larger batch splits no more than the smallest
      ordered one).
    """
    # Imported here: importing the kernels' module defines them, which must wait until a
    # Triton kernel is needed (the CPU interpreter is chosen before that).
    from pagedllm.layers.attention.triton_decode import LONGEST_FIRST_MIN_SEQS

    short = min(SHORT_CONTEXT, max_model_len - 1)
    long = min(LONG_CONTEXT, max_model_len - 1)
    layouts: list[Layout] = []
    for length in PROMPT_LENGTHS:
        if length <= min(max_num_batched_tokens, max_model_len):
            layouts.append(((0, length),))
            if max_num_seqs >= 2 and length < max_num_batched_tokens:
                layouts.append(((0, length), (short, 1)))
    prompt = (0, min(MIXED_PROMPT, max_num_batched_tokens, max_model_len))
    if max_num_seqs >= 2 and 2 * prompt[1] <= max_num_batched_tokens:
        layouts.append((prompt, prompt))
    for count in (1, LONGEST_FIRST_MIN_SEQS):
        for context in (short, long):
            decodes = ((context, 1),) * min(count, max_num_seqs, max_num_batched_tokens)
            layouts.append(decodes)
            room = min(max_num_seqs - 1, max_num_batched_tokens - prompt[1])
            if room >= 1:
                layouts.append((prompt,) + decodes[:room])
    return list(dict.fromkeys(layouts))


def _metadata(layout: Layout, block_size: int, device: torch.device) -> AttentionMetadata:
    """The layout's batch with every slot -1 (nothing cached) and every block table entry
    0 (its context reads block 0). Block-table rows are padded to a multiple of 16 blocks,
    as ``DeviceInputBuffers`` pads a real step's: Triton specialises on that stride."""
    query_lens = [q for _, q in layout]
    seq_lens = [c + q for c, q in layout]
    query_start_loc = [0]
    for q in query_lens:
        query_start_loc.append(query_start_loc[-1] + q)
    num_tokens = query_start_loc[-1]
    width = -(-max(seq_lens) // (16 * block_size)) * 16
    return AttentionMetadata(
        num_actual_tokens=num_tokens,
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(len(layout), width, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )


@torch.inference_mode()
def warm_up_kernels(
    model: nn.Module,
    sampler: Sampler,
    kv_caches: list[torch.Tensor],
    layouts: list[Layout],
    *,
    block_size: int,
    vocab_size: int,
    device: torch.device,
) -> None:
    """Run each layout's forward eagerly, then sample its sequences' last rows, greedy and
    random rows alternating (a single row once each way), from the logits as they are and
    widened to float32."""
    start = time.perf_counter()
    greedy, random = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    for layout in layouts:
        metadata = _metadata(layout, block_size, device)
        positions = torch.cat([torch.arange(c, c + q) for c, q in layout]).to(device)
        input_ids = torch.zeros_like(positions)
        with set_forward_context(metadata, kv_caches):
            hidden = model(input_ids, positions)
        last_rows = metadata.query_start_loc[1:].long() - 1
        logits = model.compute_logits(hidden[last_rows])
        rows = len(layout)
        choices = [[greedy], [random]] if rows == 1 else [
            [greedy if i % 2 else random for i in range(rows)]]
        # Penalties, min_tokens and the top-k/top-p/min-p filters hand the sampling kernels
        # float32 logits: a variant of its own when the model's dtype is another.
        widened = (logits,) if logits.dtype == torch.float32 else (logits, logits.float())
        for values in widened:
            for params in choices:
                sampler(values, SamplingMetadata.build(
                    params=params, prompt_token_ids=[[0]] * rows,
                    output_token_ids=[[] for _ in params], generators=[None] * rows,
                    vocab_size=vocab_size, device=device,
                ))
    # Long prompts' library attention (dense_prefill), which no warm-up step reaches;
    # imported here for the reason warm_up_layouts gives.
    from pagedllm.layers.attention import dense_prefill

    attention = next((m for m in model.modules() if isinstance(m, Attention)), None)
    if layouts and attention is not None and kv_caches:
        dense_prefill.warm_up(hidden.dtype, kv_caches[0], attention.num_heads)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("Compiled the kernels of %d warm-up step shapes in %.1f s.", len(layouts),
                time.perf_counter() - start)
