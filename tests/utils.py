"""Test helpers: tiny random Hugging Face checkpoints and hand-built attention metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pagedllm.layers.attention.backend import AttentionMetadata

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "phi3", "gemma2",
            "gemma3", "gpt_neox", "opt", "falcon", "qwen2_moe")

_TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def _hf_classes(family: str):
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "gpt_neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM),
        "opt": (transformers.OPTConfig, transformers.OPTForCausalLM),
        "falcon": (transformers.FalconConfig, transformers.FalconForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    }
    if family not in classes:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}.")
    return classes[family]


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is sharp and every bias and norm matters.

    The library's own init (std 0.02, zero biases, unit norms) would leave attention almost
    uniform and biases invisible, so a wrong mask or a dropped bias could go unnoticed.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            values = 1.0 + 0.3 * (torch.rand(param.shape, generator=gen) * 2 - 1)
        elif param.dim() == 1:
            values = 0.3 * torch.randn(param.shape, generator=gen)
        elif "embed_tokens" in name:
            values = torch.randn(param.shape, generator=gen)
        else:
            # Scaled by the input width (the last dimension, stacked experts included).
            values = torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5 * 1.5
        param.copy_(values)


def make_tiny_checkpoint(
    tmp_path: Path,
    family: str,
    *,
    num_shards: int = 1,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a tiny random checkpoint of ``family`` with transformers' own model class.

    Creates ``tmp_path/<family>-tiny`` (or a numbered sibling) holding ``config.json``,
    ``generation_config.json`` and ``model.safetensors`` — or, with ``num_shards > 1``,
    ``model-0000i-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``.
    ``overrides`` are config fields (``tie_word_embeddings=True``, ``sliding_window=8``,
    ``rope_scaling={...}``, ``head_dim=24`` ...). Same arguments, same weights.
    """
    config_cls, model_cls = _hf_classes(family)
    kwargs = dict(_TINY_DEFAULTS)
    if family in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    if family in ("mistral", "mixtral", "phi3"):
        kwargs["sliding_window"] = None
    if family == "phi3":
        kwargs["pad_token_id"] = 0
    if family in ("gemma2", "gemma3"):
        kwargs.update(head_dim=16, pad_token_id=0, query_pre_attn_scalar=24)
    if family in ("gpt_neox", "falcon"):
        for field in ("num_key_value_heads", "rms_norm_eps"):
            kwargs.pop(field)
    if family == "falcon":
        kwargs.update(ffn_hidden_size=kwargs.pop("intermediate_size"), bos_token_id=1)
    if family == "opt":
        for field in ("num_key_value_heads", "rms_norm_eps"):
            kwargs.pop(field)
        kwargs.update(ffn_dim=kwargs.pop("intermediate_size"), pad_token_id=0, dropout=0.0,
                      tie_word_embeddings=True)
    if family == "mixtral":
        kwargs.update(num_local_experts=4, num_experts_per_tok=2)
    if family in ("qwen3_moe", "qwen2_moe"):
        kwargs.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
    if family == "qwen2_moe":
        kwargs.update(shared_expert_intermediate_size=80)
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _randomize(model, seed)
    model = model.to(dtype)

    out = Path(tmp_path) / f"{family}-tiny"
    suffix = 1
    while out.exists():
        suffix += 1
        out = Path(tmp_path) / f"{family}-tiny-{suffix}"
    model.save_pretrained(out)
    if num_shards > 1:
        _reshard(out, num_shards)
    return out


def _reshard(path: Path, num_shards: int) -> None:
    """Split ``model.safetensors`` into ``num_shards`` files with an index, as large
    checkpoints are published."""
    from safetensors.torch import load_file, save_file

    single = path / "model.safetensors"
    tensors = load_file(str(single))
    names = sorted(tensors)
    if num_shards > len(names):
        raise ValueError(f"num_shards={num_shards} exceeds the {len(names)} tensors.")
    weight_map: dict[str, str] = {}
    for i in range(num_shards):
        shard_name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[i::num_shards]
        save_file({n: tensors[n] for n in part}, str(path / shard_name), metadata={"format": "pt"})
        weight_map.update({n: shard_name for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    single.unlink()


def make_attention_metadata(
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for a flat batch: sequence ``b`` computes its last ``query_lens[b]`` of
    ``seq_lens[b]`` tokens, whose K/V go to ``block_tables[b]`` (one block per
    ``block_size`` positions)."""
    if not len(block_tables) == len(seq_lens) == len(query_lens):
        raise ValueError("block_tables, seq_lens and query_lens need one entry per sequence.")
    slots: list[int] = []
    for table, seq_len, q_len in zip(block_tables, seq_lens, query_lens):
        if not 1 <= q_len <= seq_len or len(table) * block_size < seq_len:
            raise ValueError(f"bad sequence: query_len={q_len}, seq_len={seq_len}, {table}")
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    qsl = [0]
    for q_len in query_lens:
        qsl.append(qsl[-1] + q_len)
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        num_actual_tokens=qsl[-1],
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
    )


def make_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    fill: float = float("nan"),
) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` cache per layer, filled
    with ``fill`` (NaN by default, so a read of an unwritten slot poisons the output)."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.full(shape, fill, dtype=dtype, device=device) for _ in range(num_layers)]


def token_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """The int32 token bitmask (``[rows, ceil(V / 32)]``, bit ``t % 32`` of word ``t // 32``
    for token ``t``) of a bool ``[rows, V]`` tensor of allowed tokens."""
    rows, vocab = allowed.shape
    bits = torch.zeros(rows, (vocab + 31) // 32 * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    words = (bits.view(rows, -1, 32) << torch.arange(32)).sum(-1)  # in [0, 2^32)
    return (words - (words >= 2**31).long() * 2**32).int()
