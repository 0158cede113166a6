"""Sizing and allocating the paged KV cache.

Number of blocks, in order of precedence:
1. ``num_kv_blocks`` when given;
2. on CUDA: ``gpu_memory_utilization * total_memory - peak memory of a profile run``
   (weights + the activations of the largest step) ``- reserved_bytes`` (the CUDA graphs'
   memory pool, captured after the cache exists), divided by the bytes of one block;
3. on the CPU: ``kv_cache_memory_gb`` GiB divided by the bytes of one block.
Either memory-based sizing stops at what ``max_num_seqs`` requests of ``max_model_len``
tokens can ever use: the cache is zeroed up front, so a surplus would only cost start-up
time (and, on a GPU, memory other processes could use).

One block holds ``block_size`` tokens of K and V for every layer (of this rank's KV heads
with tensor parallelism; every rank holds the same block ids)::

    bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes

``dtype_bytes`` is the cache's element size: the model dtype's (``--kv-cache-dtype auto``)
or 1 (``fp8``), so an FP8 cache holds twice the tokens of a bf16 one in the same bytes.

The arithmetic (``block_bytes``, ``gpu_kv_bytes``, ``cpu_kv_bytes``, ``blocks_for_bytes``,
``blocks_per_request``, ``max_concurrency``, ``weight_bytes``) takes plain numbers and needs
no torch, so ``pagedllm doctor`` and ``pagedllm plan`` size a cache exactly as the engine
does without loading a model.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from pagedllm.config import EngineConfig
from pagedllm.models.moe_config import MOE_FAMILIES, moe_fields

if TYPE_CHECKING:
    import torch

_GIB = 1 << 30
# Bytes of one element of each dtype the engine runs in.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
FP8_BYTES = 1
# ``weight_bytes``' integer-weight storage names and their bits per weight.
INT_WEIGHT_BITS = {"int4": 4, "int8": 8, "nf4": 4}


def kv_element_size(cache_dtype: str, model_dtype: str) -> int:
    """Bytes of one cached K or V element: 1 for ``--kv-cache-dtype fp8``, else those of
    ``model_dtype`` (a name of ``DTYPE_BYTES``)."""
    return FP8_BYTES if cache_dtype == "fp8" else DTYPE_BYTES[model_dtype]


def block_bytes(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                element_size: int) -> int:
    """Bytes of one KV block: K and V of ``block_size`` tokens in every layer."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def bytes_per_block(config: EngineConfig, dtype: torch.dtype) -> int:
    """Bytes of one block of ``dtype`` elements: the model's K/V, plus the draft model's
    with speculative decoding (each block holds both; see ``worker/draft_model.py``)."""
    spec = config.speculative_config
    models = [config.model_config]
    if spec is not None and spec.draft_model_config is not None:
        models.append(spec.draft_model_config)
    tp = config.parallel_config.tensor_parallel_size
    stages = config.parallel_config.pipeline_parallel_size
    return sum(block_bytes(num_layers=-(-m.num_layers // stages),  # the largest stage's
                           block_size=config.cache_config.block_size,
                           num_kv_heads=m.kv_heads_per_rank(tp), head_dim=m.head_dim,
                           element_size=dtype.itemsize) for m in models)


def gpu_kv_bytes(total_bytes: int, gpu_memory_utilization: float, used_bytes: int,
                 reserved_bytes: int = 0) -> int:
    """Bytes left for the cache on a GPU: the utilization's share of its memory less what the
    weights and activations use (``used_bytes``) and ``reserved_bytes``; may be negative."""
    return int(total_bytes * gpu_memory_utilization) - used_bytes - reserved_bytes


def cpu_kv_bytes(kv_cache_memory_gb: float) -> int:
    """Bytes of the cache on the CPU (``kv_cache_memory_gb`` is in GiB)."""
    return int(kv_cache_memory_gb * _GIB)


def blocks_per_request(num_tokens: int, block_size: int) -> int:
    """Blocks one request of ``num_tokens`` tokens holds."""
    return math.ceil(num_tokens / block_size)


def blocks_for_bytes(available_bytes: int, per_block: int, usable_blocks: int) -> int:
    """Whole blocks in ``available_bytes`` (none if negative), at most ``usable_blocks``."""
    return min(max(available_bytes // per_block, 0), usable_blocks)


def max_concurrency(num_blocks: int, num_tokens: int, block_size: int) -> int:
    """Requests of ``num_tokens`` tokens that ``num_blocks`` blocks hold at once."""
    return num_blocks // blocks_per_request(num_tokens, block_size)


# model_type values whose weights weight_bytes counts by the Llama formula.
FORMULA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", *MOE_FAMILIES)


def weight_bytes(hf_config: dict, element_size: int, quantization: str | None = None,
                 group_size: int = -1) -> int:
    """Bytes of a Llama-family model's weights, from its config.json.

    Every parameter takes ``element_size`` bytes, except the decoder layers' projections
    with ``quantization="fp8"`` (one byte per weight plus a float32 scale per output
    channel) or ``"int4"`` / ``"int8"`` (integer weights as pagedllm stores them: packed in
    int32 words, plus per output channel and group of ``group_size`` inputs (-1: one group)
    a scale of ``element_size`` bytes and a one-byte zero point) or ``"nf4"`` (bitsandbytes'
    4-bit codes, packed the same way, a float32 scale a group and no zero point); experts
    are quantized either way, routers never. The embedding, the LM head and the norms keep
    ``element_size``.

    Families of another shape (Gemma, GPT-NeoX, Falcon, OPT) are counted exactly from
    their model built on the meta device, every parameter at ``element_size`` (those
    quantized are then over-counted, never under).
    """
    if hf_config.get("model_type", "llama") not in FORMULA_FAMILIES:
        return _meta_parameter_count(hf_config) * element_size
    hidden = hf_config["hidden_size"]
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hidden // heads
    inter = hf_config["intermediate_size"]
    vocab = hf_config["vocab_size"]
    layers = hf_config["num_hidden_layers"]
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv_out = q_size + 2 * kv_size
    projections = hidden * qkv_out + q_size * hidden + 3 * hidden * inter
    out_channels = qkv_out + hidden + 2 * inter + hidden
    family = hf_config.get("model_type", "llama")
    biases = 0
    if family in ("qwen2", "qwen2_moe"):
        biases = qkv_out
    elif hf_config.get("attention_bias"):
        biases = qkv_out + hidden
    if hf_config.get("mlp_bias") and family == "llama":
        biases += 2 * inter + hidden
    norms = 2 * hidden + (2 * head_dim if family in ("qwen3", "qwen3_moe") else 0)
    embeddings = vocab * hidden * (1 if hf_config.get("tie_word_embeddings") else 2) + hidden
    sparse_layers, experts, expert_inter, shared_inter = _moe_shape(hf_config)
    if sparse_layers and quantization is None:
        # A sparse layer's MLP is its experts' gate, up and down plus the router, and a
        # shared expert with its one-output gate.
        sparse_extra = (experts * (3 * hidden * expert_inter + hidden) - 3 * hidden * inter
                        + (3 * hidden * shared_inter + hidden if shared_inter else 0))
        return (layers * (projections + biases + norms) + sparse_layers * sparse_extra
                + embeddings) * element_size
    if quantization == "fp8":
        per_layer = projections * FP8_BYTES + out_channels * 4 + (biases + norms) * element_size
        total = layers * per_layer + embeddings * element_size
        if sparse_layers:
            # A sparse layer's MLP: the experts' FP8 gate, up and down (a float32 scale
            # per output channel), a quantized shared expert, and the unquantized routers.
            shared = (3 * hidden * shared_inter, 2 * shared_inter + hidden, hidden) \
                if shared_inter else (0, 0, 0)
            weights = experts * 3 * hidden * expert_inter + shared[0] - 3 * hidden * inter
            channels = experts * (2 * expert_inter + hidden) + shared[1] - (2 * inter + hidden)
            routers = experts * hidden + shared[2]
            total += sparse_layers * (weights * FP8_BYTES + channels * 4
                                      + routers * element_size)
        return total
    if quantization in INT_WEIGHT_BITS:
        bits = INT_WEIGHT_BITS[quantization]
        # A group's scale and zero point; bitsandbytes' codes: a float32 scale, no zero point.
        group_bytes = 4 if quantization == "nf4" else element_size + 1

        def mlp_bytes(width: int) -> int:  # one gated MLP's packed gate, up and down
            return sum(_int_projection_bytes(n, k, bits, group_size, group_bytes)
                       for n, k in ((2 * width, hidden), (hidden, width)))

        attention = sum(_int_projection_bytes(n, k, bits, group_size, group_bytes)
                        for n, k in ((qkv_out, hidden), (hidden, q_size)))
        total = (layers * (attention + mlp_bytes(inter) + (biases + norms) * element_size)
                 + embeddings * element_size)
        if sparse_layers:
            # A sparse layer's MLP: each expert's packed gate, up and down, a packed
            # shared expert, and the unquantized routers.
            sparse = experts * mlp_bytes(expert_inter) - mlp_bytes(inter)
            if shared_inter:
                sparse += mlp_bytes(shared_inter) + hidden * element_size
            total += sparse_layers * (sparse + experts * hidden * element_size)
        return total
    return (layers * (projections + biases + norms) + embeddings) * element_size


def _meta_parameter_count(hf_config: dict) -> int:
    """Parameters of the registry's model for ``hf_config``, built with no memory."""
    import torch

    from pagedllm.models.registry import get_model_class

    with torch.device("meta"):
        model = get_model_class(hf_config.get("architectures") or [])(hf_config)
    return sum(p.numel() for p in model.parameters())


def _moe_shape(hf_config: dict) -> tuple[int, int, int, int]:
    """(sparse layers, experts, each expert's intermediate size, the shared expert's);
    zeros for dense models."""
    family = hf_config.get("model_type")
    if family not in MOE_FAMILIES:
        return 0, 0, 0, 0
    moe = moe_fields(hf_config, family, hf_config["num_hidden_layers"])
    return (sum(moe["moe_layers"]), moe["num_experts"], moe["moe_intermediate_size"],
            moe["shared_expert_intermediate_size"])


def _int_projection_bytes(out_features: int, in_features: int, bits: int, group_size: int,
                          group_bytes: int) -> int:
    """One integer-weight projection as ``pagedllm.quantization.int_weights`` stores it
    (``group_bytes``: a group's scale and zero point)."""
    words = math.ceil(in_features * bits / 32)
    groups = 1 if group_size == -1 else math.ceil(in_features / group_size)
    return out_features * (4 * words + groups * group_bytes)


def determine_num_blocks(
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    profile_run: Callable[[], None],
    reserved_bytes: int = 0,
) -> int:
    """Blocks for the KV cache of element type ``dtype``; raises if one ``max_model_len``
    request would not fit.

    ``reserved_bytes`` (CUDA only) is memory that must stay free beside the cache.
    """
    import torch

    cache = config.cache_config
    per_block = bytes_per_block(config, dtype)
    max_model_len = config.model_config.max_model_len
    needed = blocks_per_request(max_model_len, cache.block_size)
    usable = config.scheduler_config.max_num_seqs * needed
    if cache.num_kv_blocks is not None:
        num_blocks = cache.num_kv_blocks
        source = f"num_kv_blocks={num_blocks}"
    elif device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        profile_run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        _, total = torch.cuda.mem_get_info(device)
        available = gpu_kv_bytes(total, cache.gpu_memory_utilization, peak, reserved_bytes)
        num_blocks = blocks_for_bytes(available, per_block, usable)
        source = (
            f"gpu_memory_utilization={cache.gpu_memory_utilization} "
            f"({available / _GIB:.2f} GiB left after weights, activations"
            f"{' and CUDA graphs' if reserved_bytes else ''})"
        )
    else:
        num_blocks = blocks_for_bytes(cpu_kv_bytes(cache.kv_cache_memory_gb), per_block, usable)
        source = f"kv_cache_memory_gb={cache.kv_cache_memory_gb}"

    if num_blocks < needed:
        raise ValueError(
            f"The KV cache holds {num_blocks * cache.block_size} tokens ({num_blocks} blocks, "
            f"from {source}) but one request of max_model_len={max_model_len} needs "
            f"{needed * cache.block_size}: lower --max-model-len, or give the cache more memory "
            "(--gpu-memory-utilization on GPU, --kv-cache-memory-gb on CPU, or --num-kv-blocks)."
        )
    return num_blocks


def host_blocks(swap_space_gb: float, per_block: int) -> int:
    """Blocks of ``per_block`` bytes that ``swap_space_gb`` GiB of host memory hold."""
    return int(swap_space_gb * _GIB) // per_block


def host_memory_available() -> int | None:
    """Bytes of host memory the kernel reports available (``MemAvailable`` of
    /proc/meminfo), or None where it does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def swap_space_problem(swap_space_gb: float, available: int | None, ranks: int = 1) -> str | None:
    """Why ``swap_space_gb`` GiB on each of ``ranks`` processes does not fit the
    ``available`` bytes of host memory (None: it fits, or the host does not say):
    page-locking it would fail at start-up, or take memory the host's processes need."""
    wanted = swap_space_gb * _GIB * ranks
    if available is None or wanted <= available:
        return None
    per_rank = f" x {ranks} ranks = {wanted / _GIB:.1f} GiB" if ranks > 1 else " GiB"
    return (f"--swap-space {swap_space_gb:g}{per_rank} is more than the "
            f"{available / _GIB:.1f} GiB of host memory available: lower it.")


def allocate_host_kv_caches(kv_caches: list[torch.Tensor], num_blocks: int,
                            pin: bool) -> list[torch.Tensor]:
    """Host memory for ``num_blocks`` swapped-out blocks of every layer: one
    ``[num_blocks, 2, block_size, num_kv_heads, head_dim * element_size]`` uint8 tensor a
    layer, a block's key and value bytes side by side (``kv_caches``' layout, the block
    first), so that a request's run of host blocks is one contiguous copy a layer.

    ``pin``: page-locked for copies that do not wait for the device, registered with CUDA
    at their exact size (torch's pinned allocator rounds a request up to a power of two:
    40 GiB of swap space would lock 64)."""
    import torch

    caches = [torch.empty((num_blocks, *layer.shape[:1], *layer.shape[2:-1],
                           layer.shape[-1] * layer.element_size()), dtype=torch.uint8)
              for layer in kv_caches]
    if pin:
        register = torch.cuda.cudart().cudaHostRegister
        for cache in caches:
            torch.cuda.check_error(register(cache.data_ptr(), cache.numel(), 0))
    return caches


def allocate_kv_caches(
    config: EngineConfig, num_blocks: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor of ``dtype`` per
    layer, zeroed (its key and value halves as ``kv_quant.paged_kv_views`` lays them out);
    ``num_kv_heads`` are this tensor-parallel rank's, and the layers of other pipeline
    stages get an empty tensor."""
    import torch

    from pagedllm.distributed.parallel_state import get_pp

    m = config.model_config
    kv_heads = m.kv_heads_per_rank(config.parallel_config.tensor_parallel_size)
    shape = (2, num_blocks, config.cache_config.block_size, kv_heads, m.head_dim)
    start, end = get_pp().layer_range(m.num_layers)
    return [torch.zeros(shape if start <= i < end else (0,), dtype=dtype, device=device)
            for i in range(m.num_layers)]
