"""OPT: learned absolute positions, LayerNorms with bias, a plain ReLU MLP.

The token embedding has ``word_embed_proj_dim`` features, projected in and out of
``hidden_size`` when they differ (OPT-350m); position ``p`` reads row ``p + 2`` of the
learned position table (the checkpoints' offset), so a sequence holds at most
``max_position_embeddings`` tokens. ``do_layer_norm_before`` puts each LayerNorm before
its block (pre-norm, with a final LayerNorm) or after the residual add (post-norm, 350m).
q/k/v load into one fused projection, as in the Llama family. Checkpoints that name the
decoder ``decoder.*`` (without ``model.``) load too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.activation import activation
from pagedllm.layers.attention.backend import OutputRows, get_forward_context
from pagedllm.layers.attention.layer import Attention
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.linear import Embedding, FusedLinear, Linear
from pagedllm.models.llama import LlamaForCausalLM

POSITION_OFFSET = 2


@dataclass(frozen=True)
class OPTArchConfig:
    vocab_size: int
    hidden_size: int
    embed_dim: int  # word_embed_proj_dim
    ffn_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # = num_heads
    head_dim: int
    max_position_embeddings: int
    activation: str
    bias: bool
    norm_before: bool
    final_norm: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, hf: dict) -> OPTArchConfig:
        if not hf.get("layer_norm_elementwise_affine", True):
            raise ValueError("layer_norm_elementwise_affine=false is not supported for OPT.")
        heads = hf["num_attention_heads"]
        norm_before = bool(hf.get("do_layer_norm_before", True))
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            embed_dim=hf.get("word_embed_proj_dim") or hf["hidden_size"],
            ffn_dim=hf["ffn_dim"], num_layers=hf["num_hidden_layers"], num_heads=heads,
            num_kv_heads=heads, head_dim=hf["hidden_size"] // heads,
            max_position_embeddings=hf["max_position_embeddings"],
            activation=hf.get("activation_function", "relu"),
            bias=bool(hf.get("enable_bias", True)), norm_before=norm_before,
            final_norm=norm_before and not hf.get("_remove_final_layer_norm", False),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        )


class OPTAttention(nn.Module):
    def __init__(self, cfg: OPTArchConfig, layer_idx: int) -> None:
        super().__init__()
        size = cfg.hidden_size
        self.qkv_proj = FusedLinear(size, {"q": size, "k": size, "v": size}, cfg.bias)
        self.out_proj = Linear(size, size, cfg.bias)
        self.attn = Attention(cfg.num_heads, cfg.head_dim, cfg.num_heads,
                              scale=cfg.head_dim ** -0.5, layer_idx=layer_idx)

    def forward(self, x: torch.Tensor, outputs: OutputRows | None = None) -> torch.Tensor:
        """Attention through ``out_proj`` (of the ``outputs`` rows alone, if given; none
        when there are none)."""
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        out = self.attn(q, k, v, outputs=outputs)
        return self.out_proj(out) if out.shape[0] else out


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: OPTArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.norm_before = cfg.norm_before
        self.self_attn = OPTAttention(cfg, layer_idx)
        self.self_attn_layer_norm = LayerNorm(cfg.hidden_size)
        self.fc1 = Linear(cfg.hidden_size, cfg.ffn_dim, cfg.bias)
        self.fc2 = Linear(cfg.ffn_dim, cfg.hidden_size, cfg.bias)
        self.final_layer_norm = LayerNorm(cfg.hidden_size)
        self.act = activation(cfg.activation)

    def forward(self, hidden: torch.Tensor, outputs: OutputRows | None = None) -> torch.Tensor:
        """The residual stream in and out; with ``outputs``, out for those rows alone
        (see ``LlamaDecoderLayer``)."""
        attn = self.self_attn(self.self_attn_layer_norm(hidden) if self.norm_before else hidden,
                              outputs)
        if outputs is not None:
            hidden = hidden[outputs.indices]
            if not hidden.shape[0]:
                return hidden
        hidden = hidden + attn if self.norm_before else self.self_attn_layer_norm(hidden + attn)
        if self.norm_before:
            return hidden + self._mlp(self.final_layer_norm(hidden))
        return self.final_layer_norm(hidden + self._mlp(hidden))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class OPTDecoder(nn.Module):
    def __init__(self, cfg: OPTArchConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.embed_dim)
        self.embed_positions = Embedding(cfg.max_position_embeddings + POSITION_OFFSET,
                                         cfg.hidden_size)
        projected = cfg.embed_dim != cfg.hidden_size
        self.project_in = Linear(cfg.embed_dim, cfg.hidden_size) if projected else None
        self.project_out = Linear(cfg.hidden_size, cfg.embed_dim) if projected else None
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_layer_norm = LayerNorm(cfg.hidden_size) if cfg.final_norm else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        outputs = get_forward_context().output_rows
        for layer in self.layers:
            hidden = layer(hidden, outputs if layer is self.layers[-1] else None)
        if not hidden.shape[0]:
            return hidden
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


class OPTModel(nn.Module):
    prunes_to_output_rows = True  # see LlamaModel

    def __init__(self, cfg: OPTArchConfig) -> None:
        super().__init__()
        self.decoder = OPTDecoder(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.decoder(input_ids, positions)


class OPTForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM``'s interface and weight loading over the OPT decoder; the LM
    head is tied to the token embedding unless config.json says otherwise."""

    family = "opt"
    model_class = OPTModel
    tensor_parallel = False
    checkpoint_renames = ((r"^decoder\.", "model.decoder."),)

    def __init__(self, hf_config: dict) -> None:
        super().__init__(hf_config)
        if self.lm_head is not None:  # the head reads the token embedding's width
            self.lm_head = Linear(self.config.embed_dim, self.config.vocab_size, bias=False)

    @classmethod
    def arch_config(cls, hf_config: dict) -> OPTArchConfig:
        return OPTArchConfig.from_hf(hf_config)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = (self.model.decoder.embed_tokens.weight if self.lm_head is None
                  else self.lm_head.weight)
        return torch.nn.functional.linear(hidden_states, weight)

    def projections(self):
        raise ValueError(f"{type(self).__name__} cannot be quantized by pagedllm yet; serve "
                         "an unquantized checkpoint without --quantization.")
