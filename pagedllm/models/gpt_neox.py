"""GPT-NeoX (Pythia, GPT-NeoX-20B) and Falcon: LayerNorms with bias, one fused q/k/v
projection, rotary on the first ``partial_rotary_factor`` of each head (Falcon: all of
it), a plain GELU MLP, and attention and MLP in parallel or in sequence::

    parallel, own MLP norm:     h = h + attn(ln_1(h)) + mlp(ln_2(h))   (NeoX; Falcon 40B+)
    parallel, shared norm:      h = h + attn(ln_1(h)) + mlp(ln_1(h))   (Falcon 7B)
    sequential:                 a = h + attn(ln_1(h));  h = a + mlp(ln_2(a))

``query_key_value``'s output rows, as the checkpoints store them (``D = head_dim``)::

    per_head     (NeoX, Falcon without multi_query)  [q0 k0 v0 | q1 k1 v1 | ...]
    multi_query  (Falcon 7B)                         [q0 q1 ... q(H-1) | k | v]
    grouped      (Falcon new_decoder_architecture)   per KV head g: [its H/KV queries | k_g | v_g]

Falcon's checkpoint names (``transformer.h.N.self_attention``, ``ln_attn`` / ``ln_mlp``,
``word_embeddings``, ``ln_f``) and NeoX's (``gpt_neox.*``, ``embed_out``) load into the
one module tree below (``model.layers.N.attention``, ``input_layernorm`` /
``post_attention_layernorm``, ``embed_in``, ``final_layer_norm``, ``lm_head``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.activation import activation
from pagedllm.layers.attention.backend import OutputRows, get_forward_context
from pagedllm.layers.attention.layer import Attention
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.linear import Embedding, Linear
from pagedllm.layers.rotary import (
    RotaryEmbedding,
    rope_parameters_from_hf,
    rotary_dims,
    rotate_leading,
)
from pagedllm.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class GPTNeoXArchConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # leading dims of each head that rotate (even)
    rope_parameters: dict
    max_position_embeddings: int | None
    layer_norm_eps: float
    hidden_act: str
    bias: bool  # attention projections
    mlp_bias: bool
    parallel_residual: bool
    tie_word_embeddings: bool
    qkv_layout: str = "per_head"  # or "multi_query", "grouped" (see the module docstring)
    shared_norm: bool = False  # parallel blocks: the MLP reads ln_1's output

    @classmethod
    def from_falcon(cls, hf: dict) -> GPTNeoXArchConfig:
        """Falcon's config.json in the same fields; ALiBi is refused."""
        if hf.get("alibi"):
            raise ValueError("alibi=true is not supported for Falcon (rotary Falcon "
                             "checkpoints only).")
        heads = hf["num_attention_heads"]
        new_arch = bool(hf.get("new_decoder_architecture", False))
        parallel = bool(hf.get("parallel_attn", True))
        if new_arch and not parallel:
            raise ValueError("new_decoder_architecture=true with parallel_attn=false is not "
                             "supported for Falcon.")
        if new_arch:
            layout, kv_heads = "grouped", hf.get("num_kv_heads") or heads
        elif hf.get("multi_query", True):
            layout, kv_heads = "multi_query", 1
        else:
            layout, kv_heads = "per_head", heads
        num_norms = hf.get("num_ln_in_parallel_attn") or (2 if new_arch else 1)
        neox = dict(hf, intermediate_size=hf.get("ffn_hidden_size") or 4 * hf["hidden_size"],
                    hidden_act=hf.get("activation", "gelu"),
                    layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                    attention_bias=bool(hf.get("bias", False)), use_parallel_residual=parallel,
                    tie_word_embeddings=hf.get("tie_word_embeddings", True))
        return dataclasses.replace(
            cls.from_hf(neox), num_kv_heads=kv_heads, mlp_bias=bool(hf.get("bias", False)),
            qkv_layout=layout, shared_norm=parallel and num_norms == 1)

    @classmethod
    def from_hf(cls, hf: dict) -> GPTNeoXArchConfig:
        heads = hf["num_attention_heads"]
        head_dim = hf["hidden_size"] // heads
        rope = dict(hf.get("rope_parameters") or {})
        rope.setdefault("partial_rotary_factor", hf.get("rotary_pct", 1.0))
        rope.setdefault("rope_theta", hf.get("rotary_emb_base", hf.get("rope_theta", 10000.0)))
        rope = rope_parameters_from_hf(
            {"rope_parameters": rope, "max_position_embeddings": hf.get("max_position_embeddings")},
            allow_partial=True)
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
            rotary_dim=rotary_dims(head_dim, rope), rope_parameters=rope,
            max_position_embeddings=hf.get("max_position_embeddings"),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-5),
            hidden_act=hf.get("hidden_act", "gelu"),
            bias=bool(hf.get("attention_bias", True)),
            mlp_bias=True,
            parallel_residual=bool(hf.get("use_parallel_residual", True)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )


class GPTNeoXAttention(nn.Module):
    def __init__(self, cfg: GPTNeoXArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.cfg = cfg
        qkv_size = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.query_key_value = Linear(cfg.hidden_size, qkv_size, cfg.bias)
        self.dense = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.bias)
        self.attn = Attention(cfg.num_heads, cfg.head_dim, cfg.num_kv_heads,
                              scale=cfg.head_dim ** -0.5, layer_idx=layer_idx)

    def split_qkv(self, qkv: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, qkv_size]`` in the checkpoint's layout -> q ``[T, H, D]``, k and v
        ``[T, KV, D]``, query head ``h`` grouped with KV head ``h // (H / KV)``."""
        cfg, tokens, d = self.cfg, qkv.shape[0], self.cfg.head_dim
        if cfg.qkv_layout == "per_head":
            return qkv.view(tokens, cfg.num_heads, 3 * d).split(d, dim=-1)
        if cfg.qkv_layout == "multi_query":
            heads = qkv.view(tokens, cfg.num_heads + 2, d)
            return heads[:, :-2], heads[:, -2:-1], heads[:, -1:]
        groups = qkv.view(tokens, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads + 2, d)
        return groups[:, :, :-2].flatten(1, 2), groups[:, :, -2], groups[:, :, -1]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                outputs: OutputRows | None = None) -> torch.Tensor:
        """The attention output before ``dense`` (of the ``outputs`` rows alone, if given)."""
        cfg, tokens = self.cfg, x.shape[0]
        q, k, v = self.split_qkv(self.query_key_value(x))
        rotary = (cos, sin)
        if cfg.rotary_dim != cfg.head_dim:
            q, k = (rotate_leading(t, cfg.rotary_dim, cos, sin) for t in (q, k))
            rotary = None
        return self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1),
                         rotary=rotary, outputs=outputs)


class GPTNeoXMLP(nn.Module):
    def __init__(self, cfg: GPTNeoXArchConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = Linear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.dense_4h_to_h = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, cfg: GPTNeoXArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.parallel = cfg.parallel_residual
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.post_attention_layernorm = (None if cfg.shared_norm
                                         else LayerNorm(cfg.hidden_size, cfg.layer_norm_eps))
        self.attention = GPTNeoXAttention(cfg, layer_idx)
        self.mlp = GPTNeoXMLP(cfg)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                outputs: OutputRows | None = None) -> torch.Tensor:
        """The residual stream in and out; with ``outputs``, out for those rows alone
        (see ``LlamaDecoderLayer``)."""
        normed = self.input_layernorm(hidden)
        attn = self.attention(normed, cos, sin, outputs)
        if outputs is not None:
            hidden, normed = hidden[outputs.indices], normed[outputs.indices]
            if not hidden.shape[0]:
                return hidden
        attn = self.attention.dense(attn)
        if self.parallel:
            if self.post_attention_layernorm is not None:
                normed = self.post_attention_layernorm(hidden)
            return self.mlp(normed) + attn + hidden
        hidden = attn + hidden
        return self.mlp(self.post_attention_layernorm(hidden)) + hidden


class GPTNeoXModel(nn.Module):
    prunes_to_output_rows = True  # see LlamaModel

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
        outputs = get_forward_context().output_rows
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, outputs if layer is self.layers[-1] else None)
        return self.final_layer_norm(hidden)


class GPTNeoXForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM``'s interface and weight loading over the GPT-NeoX decoder."""

    family = "gpt_neox"
    model_class = GPTNeoXModel
    tensor_parallel = False
    checkpoint_renames = ((r"^gpt_neox\.", "model."), (r"^embed_out\.", "lm_head."))

    @classmethod
    def arch_config(cls, hf_config: dict) -> GPTNeoXArchConfig:
        return GPTNeoXArchConfig.from_hf(hf_config)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_in.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden_states, weight)

    def projections(self):
        raise ValueError(f"{type(self).__name__} cannot be quantized by pagedllm yet; serve "
                         "an unquantized checkpoint without --quantization.")


class FalconForCausalLM(GPTNeoXForCausalLM):
    family = "falcon"
    checkpoint_renames = (
        (r"^transformer\.word_embeddings\.", "model.embed_in."),
        (r"^transformer\.ln_f\.", "model.final_layer_norm."),
        (r"^transformer\.h\.", "model.layers."),
        (r"\.self_attention\.", ".attention."),
        (r"\.ln_attn\.", ".input_layernorm."),
        (r"\.ln_mlp\.", ".post_attention_layernorm."),
    )

    @classmethod
    def arch_config(cls, hf_config: dict) -> GPTNeoXArchConfig:
        return GPTNeoXArchConfig.from_falcon(hf_config)
