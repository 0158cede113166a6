"""GPT-NeoX (Pythia, GPT-NeoX-20B): LayerNorms with bias, one fused q/k/v projection laid
out per head, rotary on the first ``partial_rotary_factor`` of each head, a plain GELU
MLP, and attention and MLP in parallel or in sequence::

    parallel (use_parallel_residual):  h = h + attn(ln_1(h)) + mlp(ln_2(h))
    sequential:                        a = h + attn(ln_1(h));  h = a + mlp(ln_2(a))

``query_key_value``'s output rows are ``[head 0: q k v | head 1: q k v | ...]``, each
``head_dim`` wide, as the checkpoint stores them. Checkpoint names ``gpt_neox.*`` and
``embed_out`` load as ``model.*`` and ``lm_head``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.activation import activation
from pagedllm.layers.attention.layer import Attention
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.linear import Embedding, Linear
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters_from_hf
from pagedllm.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class GPTNeoXArchConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # = num_heads
    head_dim: int
    rotary_dim: int  # leading dims of each head that rotate (even)
    rope_parameters: dict
    max_position_embeddings: int | None
    layer_norm_eps: float
    hidden_act: str
    bias: bool
    parallel_residual: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, hf: dict) -> GPTNeoXArchConfig:
        heads = hf["num_attention_heads"]
        head_dim = hf["hidden_size"] // heads
        rope = dict(hf.get("rope_parameters") or {})
        partial = rope.pop("partial_rotary_factor", hf.get("rotary_pct", 1.0))
        rope.setdefault("rope_theta", hf.get("rotary_emb_base", hf.get("rope_theta", 10000.0)))
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2 or rotary_dim == 0:
            raise ValueError(f"partial_rotary_factor={partial} gives {rotary_dim} rotary "
                             f"dimensions of {head_dim}; pagedllm needs an even number > 0.")
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=heads, head_dim=head_dim, rotary_dim=rotary_dim,
            rope_parameters=rope_parameters_from_hf(
                {"rope_parameters": rope, "max_position_embeddings":
                 hf.get("max_position_embeddings")}),
            max_position_embeddings=hf.get("max_position_embeddings"),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-5),
            hidden_act=hf.get("hidden_act", "gelu"),
            bias=bool(hf.get("attention_bias", True)),
            parallel_residual=bool(hf.get("use_parallel_residual", True)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )


def rotate_leading(x: torch.Tensor, rotary_dim: int, cos: torch.Tensor, sin: torch.Tensor
                   ) -> torch.Tensor:
    """``x [T, heads, D]`` with its first ``rotary_dim`` dims rotated (rotate-half within
    them), the rest passed through."""
    rotated = RotaryEmbedding.apply(x[..., :rotary_dim].contiguous(), cos, sin)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


class GPTNeoXAttention(nn.Module):
    def __init__(self, cfg: GPTNeoXArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.query_key_value = Linear(cfg.hidden_size, 3 * cfg.hidden_size, cfg.bias)
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size, cfg.bias)
        self.attn = Attention(cfg.num_heads, cfg.head_dim, cfg.num_heads,
                              scale=cfg.head_dim ** -0.5, layer_idx=layer_idx)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        qkv = self.query_key_value(x).view(x.shape[0], cfg.num_heads, 3 * cfg.head_dim)
        q, k, v = qkv.split(cfg.head_dim, dim=-1)
        if cfg.rotary_dim == cfg.head_dim:
            out = self.attn(q.reshape(x.shape[0], -1), k.reshape(x.shape[0], -1),
                            v.reshape(x.shape[0], -1), rotary=(cos, sin))
        else:
            q, k = (rotate_leading(t, cfg.rotary_dim, cos, sin) for t in (q, k))
            out = self.attn(q.reshape(x.shape[0], -1), k.reshape(x.shape[0], -1),
                            v.reshape(x.shape[0], -1))
        return self.dense(out)


class GPTNeoXMLP(nn.Module):
    def __init__(self, cfg: GPTNeoXArchConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.dense_4h_to_h = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, cfg: GPTNeoXArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.parallel = cfg.parallel_residual
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.attention = GPTNeoXAttention(cfg, layer_idx)
        self.mlp = GPTNeoXMLP(cfg)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> torch.Tensor:
        attn = self.attention(self.input_layernorm(hidden), cos, sin)
        if self.parallel:
            return self.mlp(self.post_attention_layernorm(hidden)) + attn + hidden
        hidden = attn + hidden
        return self.mlp(self.post_attention_layernorm(hidden)) + hidden


class GPTNeoXModel(nn.Module):
    def __init__(self, cfg: GPTNeoXArchConfig) -> None:
        super().__init__()
        self.embed_in = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg.rotary_dim, cfg.rope_parameters,
                                          cfg.max_position_embeddings)
        self.layers = nn.ModuleList(GPTNeoXLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_layer_norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_in(input_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.final_layer_norm(hidden)


class GPTNeoXForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM``'s interface and weight loading over the GPT-NeoX decoder."""

    family = "gpt_neox"
    model_class = GPTNeoXModel
    checkpoint_prefixes = (("gpt_neox.", "model."), ("embed_out.", "lm_head."))

    @classmethod
    def arch_config(cls, hf_config: dict) -> GPTNeoXArchConfig:
        return GPTNeoXArchConfig.from_hf(hf_config)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_in.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden_states, weight)

    def projections(self):
        raise ValueError(f"{type(self).__name__} cannot be quantized by pagedllm yet; serve "
                         "an unquantized checkpoint without --quantization.")
