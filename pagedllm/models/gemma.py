"""Gemma 2 and Gemma 3 (text): the Llama family's attention and MLP in Gemma's block.

What differs from ``llama.py``, all read from config.json:

* four RMSNorms a layer, "sandwich" style, each scaling by ``1 + weight`` in float32::

      h = h + post_attention_layernorm(attn(input_layernorm(h)))
      h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

* embeddings multiplied by ``sqrt(hidden_size)`` (rounded to the activation dtype);
* attention scaled by ``query_pre_attn_scalar ** -0.5``; sliding-window and global layers
  as ``layer_types`` says (or every ``sliding_window_pattern``-th layer global);
* Gemma 2: scores soft-capped at ``attn_logit_softcapping`` (by every attention backend)
  and logits at ``final_logit_softcapping``;
* Gemma 3: per-head q/k norms, and its own rope for sliding layers
  (``rope_parameters["sliding_attention"]``, or ``rope_local_base_freq``) beside the
  global layers' (``["full_attention"]``, which may be scaled);
* a gated MLP with ``hidden_activation`` (GELU, tanh approximation), tied embeddings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from pagedllm.layers.attention.backend import OutputRows, get_forward_context
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import Embedding
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters_from_hf
from pagedllm.models.llama import (
    LlamaArchConfig,
    LlamaAttentionBlock,
    LlamaForCausalLM,
    LlamaMLP,
)

# Which layers are global when config.json gives no layer_types: every Nth.
_DEFAULT_PATTERN = {"gemma2": 2, "gemma3": 6}


@dataclasses.dataclass(frozen=True)
class GemmaArchConfig(LlamaArchConfig):
    final_softcap: float | None = None
    # Rope of the sliding-window layers when it differs from the global layers' (Gemma 3).
    local_rope_parameters: dict[str, Any] | None = None


def gemma_arch_config(hf: dict, family: str) -> GemmaArchConfig:
    """The Llama switches plus Gemma's, from a Gemma 2 / Gemma 3 config.json."""
    num_layers = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") \
        or _DEFAULT_PATTERN[family]
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(num_layers)]
    window = hf.get("sliding_window")
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    rope = hf.get("rope_parameters") or {}
    local_rope = None
    flat = dict(hf)
    if family == "gemma3":
        if rope and all(isinstance(v, dict) for v in rope.values()):
            flat["rope_parameters"] = rope.get("full_attention")
            local = rope.get("sliding_attention")
        else:
            local = {"rope_type": "default",
                     "rope_theta": hf.get("rope_local_base_freq", 10000.0)}
        if local is not None:
            local_rope = rope_parameters_from_hf({"rope_parameters": local})
    flat["hidden_act"] = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    flat["tie_word_embeddings"] = hf.get("tie_word_embeddings", True)
    flat.pop("sliding_window", None)  # windows are per layer, set below
    base = LlamaArchConfig.from_hf(flat, family)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaArchConfig)}
    fields.update(
        sliding_windows=windows,
        qk_norm=family == "gemma3",
        attn_scale=float(hf.get("query_pre_attn_scalar") or base.head_dim) ** -0.5,
        attn_softcap=hf.get("attn_logit_softcapping"),
        norm_offset=1.0,
    )
    return GemmaArchConfig(**fields, final_softcap=hf.get("final_logit_softcapping"),
                           local_rope_parameters=local_rope)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: GemmaArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttentionBlock(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        self.sliding = cfg.sliding_windows[layer_idx] is not None
        for name in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset))

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                outputs: OutputRows | None = None) -> torch.Tensor:
        """The residual stream in, the residual stream out (``[T, hidden]``; with
        ``outputs``, of those rows alone: see ``LlamaDecoderLayer``)."""
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, outputs)
        if outputs is not None:
            hidden = hidden[outputs.indices]
            if not hidden.shape[0]:
                return hidden
        hidden = hidden + self.post_attention_layernorm(self.self_attn.o_proj(attn))
        mlp = self.mlp.down_proj(self.mlp(self.pre_feedforward_layernorm(hidden)))
        return hidden + self.post_feedforward_layernorm(mlp)


class GemmaModel(nn.Module):
    prunes_to_output_rows = True  # see LlamaModel

    def __init__(self, cfg: GemmaArchConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, parallel=True)
        self.embed_scale = cfg.hidden_size ** 0.5
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_parameters,
                                          cfg.max_position_embeddings)
        self.local_rotary_emb = None
        if cfg.local_rope_parameters is not None:
            self.local_rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.local_rope_parameters,
                                                    cfg.max_position_embeddings)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        hidden = embeds * torch.tensor(self.embed_scale, dtype=embeds.dtype)
        rope = self.rotary_emb(positions, hidden.dtype)
        local = rope if self.local_rotary_emb is None else self.local_rotary_emb(
            positions, hidden.dtype)
        outputs = get_forward_context().output_rows
        for layer in self.layers:
            hidden = layer(hidden, *(local if layer.sliding else rope),
                           outputs if layer is self.layers[-1] else None)
        return self.norm(hidden) if hidden.shape[0] else hidden


class Gemma2ForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM``'s interface and weight loading over Gemma's block; logits are
    soft-capped at ``final_logit_softcapping`` when set."""

    family = "gemma2"
    model_class = GemmaModel

    @classmethod
    def arch_config(cls, hf_config: dict) -> GemmaArchConfig:
        return gemma_arch_config(hf_config, cls.family)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    family = "gemma3"


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text decoder of a Gemma 3 vision-language checkpoint (4B, 12B, 27B): config.json's
    ``text_config`` describes it (``ModelConfig`` reads it as the model's config), its
    tensors load from ``language_model.model.*`` or ``model.language_model.*``, and the
    vision tower and projector are not loaded. Prompts are text (token ids) only."""

    checkpoint_renames = (
        (r"^language_model\.model\.", "model."),
        (r"^model\.language_model\.", "model."),
        (r"^language_model\.lm_head\.", "lm_head."),
    )
    checkpoint_ignored = (r"(model\.)?vision_tower\.", r"(model\.)?multi_modal_projector\.")
