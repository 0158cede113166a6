"""The Llama family: Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, Mixtral, Qwen2-MoE and
Qwen3-MoE in one decoder definition.

They share one block (pre-norm RMSNorm, rotary attention with grouped KV heads, gated
MLP or a mixture of gated-MLP experts) and differ in switches read from the checkpoint's
``config.json``:

==========  ========================  =============================================
family      projection biases         extras
==========  ========================  =============================================
llama       ``attention_bias`` (all   ``mlp_bias``; rope scaling linear/llama3/yarn
            four), ``mlp_bias``
mistral     none                      ``sliding_window`` on every layer when set
qwen2       q, k, v always; o never   sliding window on layers >= ``max_window_layers``
                                      when ``use_sliding_window`` (or ``layer_types``)
qwen3       ``attention_bias``        per-head RMSNorm on q and k before rope; explicit
                                      ``head_dim`` (may differ from hidden / heads)
phi3        none                      q/k/v and gate/up stored fused; ``sliding_window``
                                      on every layer; rope may be LongRoPE ("su") and
                                      partial (``partial_rotary_factor``)
mixtral     none                      as mistral; every MLP is ``num_local_experts``
                                      experts, top ``num_experts_per_tok`` renormalised
qwen2_moe   ``qkv_bias``              as qwen2; sparse layers as qwen3_moe, plus a shared
                                      expert gated by ``sigmoid(shared_expert_gate)``
qwen3_moe   ``attention_bias``        as qwen3 (window on every layer when
                                      ``use_sliding_window``); layer i is sparse unless
                                      in ``mlp_only_layers`` or ``(i + 1) %
                                      decoder_sparse_step``; ``norm_topk_prob``
==========  ========================  =============================================

Parameter names mirror the checkpoints' (``model.layers.N.self_attn...``) except that
q/k/v are fused into ``qkv_proj`` and gate/up into ``gate_up_proj``; ``load_weights``
routes each checkpoint tensor into its rows. Expert weights are stacked per layer
(``mlp.experts.w13``, ``mlp.experts.w2``, see ``layers.fused_moe``); Mixtral's
``block_sparse_moe`` is read as ``mlp``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import sharding
from pagedllm.distributed.parallel_state import (
    get_pp,
    get_tp,
    recv_from_previous_stage,
    send_to_next_stage,
)
from pagedllm.layers.activation import GatedActivation
from pagedllm.layers.attention.backend import OutputRows, get_forward_context
from pagedllm.layers.attention.layer import Attention
from pagedllm.layers.fused_moe import FusedMoE, MoEBlock
from pagedllm.layers.layernorm import RMSNorm, linear_and_norm, qk_norms
from pagedllm.layers.linear import (
    Embedding,
    FusedLinear,
    Linear,
    gather_logits,
    linear,
    small_batch_product,
)
from pagedllm.layers.rotary import (
    RotaryEmbedding,
    rope_parameters_from_hf,
    rotary_dims,
    rotate_leading,
)
from pagedllm.models.moe_config import moe_fields
from pagedllm.quantization.fp8 import Fp8Sums

# (fused module, checkpoint module, shard) — a checkpoint name containing ".{checkpoint
# module}." is loaded into that shard of the fused module.
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)
# Checkpoint tensors that are derived state, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached",
                     # causal-mask buffers older GPT-NeoX checkpoints carry
                     ".attention.bias", ".attention.masked_bias")
# Per-layer KV-cache scales of FP8 checkpoints (llm-compressor, the plain fp8 method).
# Per-layer KV-cache scales: llm-compressor's names, and ModelOpt's (on k_proj and v_proj).
_KV_SCALE_SUFFIXES = (".self_attn.k_scale", ".self_attn.v_scale", ".self_attn.k_proj.k_scale",
                      ".self_attn.v_proj.v_scale")


@dataclass(frozen=True)
class LlamaArchConfig:
    """The architecture switches of one checkpoint, read once from its HF config dict."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int | None
    rope_parameters: dict[str, Any]
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # one per layer, in tokens
    # Mixture of experts (num_experts 0: every layer dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()  # one per layer: sparse or dense
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)
    rotary_dim: int = 0  # leading dims of each head that rotate; 0: all (head_dim)
    # Gemma's switches (see models/gemma.py); the defaults are Llama's.
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    norm_offset: float = 0.0  # RMSNorm scales by norm_offset + weight

    @classmethod
    def from_hf(cls, hf: dict, family: str) -> LlamaArchConfig:
        num_heads = hf["num_attention_heads"]
        num_layers = hf["num_hidden_layers"]
        attention_bias = bool(hf.get("attention_bias", False))
        moe = moe_fields(hf, family, num_layers)
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope = rope_parameters_from_hf(hf, allow_partial=family == "phi3")
        if family == "qwen2":
            qkv_bias, o_bias = True, False
        elif family == "qwen2_moe":
            qkv_bias, o_bias = bool(hf.get("qkv_bias", True)), False
        else:
            qkv_bias = o_bias = attention_bias
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            hidden_act=hf.get("hidden_act", "silu"),
            max_position_embeddings=hf.get("max_position_embeddings"),
            rope_parameters=rope,
            rotary_dim=rotary_dims(head_dim, rope),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)) if family == "llama" else False,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            sliding_windows=_sliding_windows(hf, family, num_layers),
            **moe,
        )


def _sliding_windows(hf: dict, family: str, num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    if family in ("mistral", "mixtral", "phi3"):
        return (window,) * num_layers
    if family == "qwen3_moe":
        return ((window if hf.get("use_sliding_window", False) else None),) * num_layers
    if family in ("qwen2", "qwen3", "qwen2_moe") and hf.get("use_sliding_window", False) \
            and window:
        first_sliding = hf.get("max_window_layers", num_layers)
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if i >= first_sliding else "full_attention"
            for i in range(num_layers)
        ]
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (None,) * num_layers


class LlamaAttentionBlock(nn.Module):
    """Projections, optional q/k norm and rope around the paged ``Attention`` layer.

    With tensor parallelism each rank holds its query heads and the KV heads they read
    (``sharding.shard_range`` in whole heads): qkv is column-parallel, o_proj
    row-parallel."""

    def __init__(self, cfg: LlamaArchConfig, layer_idx: int) -> None:
        super().__init__()
        tp_size = get_tp().size
        self.num_heads = cfg.num_heads // tp_size
        self.num_kv_heads = max(1, cfg.num_kv_heads // tp_size)
        self.head_dim = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = FusedLinear(
            cfg.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, cfg.qkv_bias,
            parallel="column", units=dict.fromkeys("qkv", cfg.head_dim),
        )
        self.o_proj = Linear(q_size, cfg.hidden_size, cfg.o_bias, parallel="row",
                             unit=cfg.head_dim)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
        self.qk_norm = cfg.qk_norm
        self.attn = Attention(
            self.num_heads, cfg.head_dim, self.num_kv_heads,
            scale=cfg.attn_scale or cfg.head_dim**-0.5,
            layer_idx=layer_idx,
            sliding_window=cfg.sliding_windows[layer_idx],
            logits_soft_cap=cfg.attn_softcap,
        )

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                outputs: OutputRows | None = None) -> torch.Tensor:
        """The attention output before ``o_proj`` (the decoder layer applies ``o_proj``
        together with the norm after it); with ``outputs``, of those rows alone."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden, sums=not self.qk_norm and self.rotary_dim == self.head_dim
                            and self.attn.takes_sums(outputs))
        sums_scales = None
        if isinstance(qkv, Fp8Sums):  # the attention scales them as it reads them
            qkv, sums_scales = qkv.sums, qkv.scales
        v = qkv[:, self.q_size + self.kv_size :]
        if self.qk_norm:
            q, k = qk_norms(qkv[:, : self.q_size + self.kv_size], self.q_norm, self.k_norm,
                            self.num_heads)
        else:
            q = qkv[:, : self.q_size]
            k = qkv[:, self.q_size : self.q_size + self.kv_size]
        if self.rotary_dim != self.head_dim:  # partial rotary (Phi-4-mini)
            q, k = (rotate_leading(t.view(num_tokens, -1, self.head_dim), self.rotary_dim,
                                   cos, sin).flatten(1) for t in (q, k))
            return self.attn(q, k, v, outputs=outputs)
        # The attention layer applies the rope (on CUDA in the kernel that caches k and v).
        return self.attn(q, k, v, rotary=(cos, sin), outputs=outputs, sums_scales=sums_scales)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, size: int | None = None) -> None:
        super().__init__()
        size = size or cfg.intermediate_size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate": size, "up": size}, cfg.mlp_bias,
                                        parallel="column")
        self.down_proj = Linear(size, cfg.hidden_size, cfg.mlp_bias, parallel="row")
        self.act = GatedActivation(cfg.hidden_act)
        self.act.feeds(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The activation before ``down_proj`` (the decoder layer applies ``down_proj``
        together with the norm after it)."""
        if self.act.is_silu:
            # A decode step of a few sequences: the activation rides on the gate/up product.
            fused = small_batch_product(self.gate_up_proj, x, self.gate_up_proj.bias,
                                        silu_gated=True)
            if fused is not None:
                return fused
        return self.act(self.gate_up_proj(x, sums=self.act.takes_sums))


class SharedExpertMoE(MoEBlock):
    """Qwen2-MoE's sparse block: the routed experts plus one dense gated MLP every token
    takes, scaled by ``sigmoid(shared_expert_gate(x))`` (one value per token)."""

    def add_shared_expert(self, cfg: LlamaArchConfig) -> None:
        self.shared_expert = LlamaMLP(cfg, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert.down_proj(self.shared_expert(x))
        gate = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))
        return super().forward(x) + gate * shared


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream travels beside the hidden states so each norm
    also performs the preceding residual add. The layer ends with the norm that follows
    it (the next layer's input norm, or the model's final one), so each projection that
    feeds the residual stream is applied together with its norm (``linear_and_norm``)."""

    def __init__(self, cfg: LlamaArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttentionBlock(cfg, layer_idx)
        self.sparse = bool(cfg.moe_layers) and cfg.moe_layers[layer_idx]
        if self.sparse:
            block = SharedExpertMoE if cfg.shared_expert_intermediate_size else MoEBlock
            self.mlp = block(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                             cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.hidden_act)
            if cfg.shared_expert_intermediate_size:
                self.mlp.add_shared_expert(cfg)
        else:
            self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm.feeds(self.self_attn.qkv_proj)
        if not self.sparse:
            self.post_attention_layernorm.feeds(self.mlp.gate_up_proj)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        next_norm: RMSNorm,
        outputs: OutputRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden``: this layer's input, already through ``input_layernorm``; returns
        ``next_norm`` of the layer's output plus the residual, and that sum. With
        ``outputs`` every row is cached but only those rows go on past the attention, and
        the results are theirs alone (everything after the attention is row by row)."""
        attn = self.self_attn(hidden, cos, sin, outputs)
        if outputs is not None:
            residual = residual[outputs.indices]
            if not residual.shape[0]:
                return residual, residual
        hidden, residual = linear_and_norm(
            attn, self.self_attn.o_proj, self.post_attention_layernorm, residual
        )
        if self.sparse:
            return next_norm(self.mlp(hidden), residual)
        return linear_and_norm(self.mlp(hidden), self.mlp.down_proj, next_norm, residual)


class LayerOfAnotherStage(nn.Module):
    """A decoder layer another pipeline stage holds. The first layer after this stage's
    keeps its ``input_layernorm``: this stage's last layer ends with it."""

    def __init__(self, cfg: LlamaArchConfig, keep_input_norm: bool) -> None:
        super().__init__()
        if keep_input_norm:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    """The decoder. With pipeline parallelism this stage holds layers ``start .. end``
    (``PipelineStage.layer_range``): the first stage embeds the tokens, every later one
    receives the previous stage's normalised hidden states and residual stream, every
    stage but the last sends its own on, and the last ends with the final norm.

    A step's ``OutputRows`` (forward context) reach the last layer: the model then returns
    the hidden states of those rows alone, in their order."""

    prunes_to_output_rows = True

    def __init__(self, cfg: LlamaArchConfig) -> None:
        super().__init__()
        pp = get_pp()
        self.start, self.end = pp.layer_range(cfg.num_layers)
        self.first, self.last = pp.is_first, pp.is_last
        self.hidden_size = cfg.hidden_size
        # The last stage's tied LM head reads the embedding too.
        self.embed_tokens = (Embedding(cfg.vocab_size, cfg.hidden_size, parallel=True)
                             if pp.is_first or (pp.is_last and cfg.tie_word_embeddings)
                             else None)
        self.rotary_emb = RotaryEmbedding(
            cfg.rotary_dim or cfg.head_dim, cfg.rope_parameters, cfg.max_position_embeddings
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i) if self.start <= i < self.end
            else LayerOfAnotherStage(cfg, keep_input_norm=i == self.end)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if pp.is_last else None
        # This stage's layers and the norm each ends with (plain tuples: the modules are
        # registered above).
        self._local = tuple(self.layers[self.start:self.end])
        self._norms_after = tuple(self.layers[i + 1].input_layernorm if i + 1 < cfg.num_layers
                                  else self.norm for i in range(self.start, self.end))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.first:
            residual = self.embed_tokens(input_ids)
            hidden = self.layers[0].input_layernorm(residual)
        else:
            norm = self._local[0].input_layernorm.weight
            hidden, residual = recv_from_previous_stage(
                2, (positions.shape[0], self.hidden_size), norm.dtype, positions.device)
        cos, sin = self.rotary_emb(positions, residual.dtype)
        outputs = get_forward_context().output_rows if self.last else None
        for layer, next_norm in zip(self._local, self._norms_after):
            final = layer is self._local[-1]
            hidden, residual = layer(hidden, residual, cos, sin, next_norm,
                                     outputs if final else None)
        if not self.last:
            send_to_next_stage(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """``model(input_ids [T], positions [T]) -> hidden_states [T, hidden]`` over a flat batch.

    Positions are absolute token indices within each token's own sequence; which tokens
    belong together, and the KV cache, come from the forward context. ``compute_logits``
    maps selected hidden rows to float32 logits over the vocabulary.

    Tensor parallelism (``tensor_parallel`` families): attention heads, MLP columns and the
    vocabulary are split over the ranks (see the layers), the hidden states are whole on
    every rank after each block's sum, and so are the logits.
    """

    family = "llama"
    model_class: type[nn.Module] = LlamaModel
    # (pattern, replacement), applied in order to each checkpoint name: families whose
    # checkpoints name the decoder or the head otherwise (``^gpt_neox\.`` -> ``model.``)
    # load through this class's names.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # Patterns of checkpoint names this class does not load (a vision tower beside the text
    # decoder), matched at the start of the name as stored.
    checkpoint_ignored: tuple[str, ...] = ()
    # Whether the family's layers split over tensor-parallel ranks (its own layers do).
    tensor_parallel = True
    # How the family's checkpoints name a sparse block and its experts' gate, up and down
    # projections (what a quantization config's targets and ignore lists match).
    expert_checkpoint_names: tuple[str, tuple[str, str, str]] = (
        "mlp", ("gate_proj", "up_proj", "down_proj"))

    def __init__(self, hf_config: dict) -> None:
        super().__init__()
        self.config = self.arch_config(hf_config)
        tp_size, pp = get_tp().size, get_pp()
        if tp_size > 1 and not self.tensor_parallel:
            raise ValueError(f"{type(self).__name__}'s layers cannot be split over "
                             f"{tp_size} tensor-parallel ranks yet: drop "
                             "--tensor-parallel-size.")
        if pp.num_stages > 1 and (self.config.num_experts or self.model_class is not LlamaModel):
            raise ValueError(f"{type(self).__name__} cannot be split into pipeline stages yet: "
                             "drop --pipeline-parallel-size.")
        self.model = self.model_class(self.config)
        self.lm_head = (
            None
            if self.config.tie_word_embeddings or not pp.is_last
            else Linear(self.config.hidden_size, self.config.vocab_size, bias=False,
                        parallel="vocab")
        )

    @classmethod
    def arch_config(cls, hf_config: dict) -> LlamaArchConfig:
        return LlamaArchConfig.from_hf(hf_config, cls.family)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    @property
    def prunes_to_output_rows(self) -> bool:
        """Whether the forward pass returns only the step's ``OutputRows`` when its
        context carries them (the decoder's last layer computes no other row)."""
        return getattr(self.model, "prunes_to_output_rows", False)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` in the activation dtype (the sampler widens them
        to float32 where its arithmetic needs it; its argmax kernels read them as they are)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return gather_logits(linear(hidden_states, weight), self.config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into this model's parameters.

        q/k/v and gate/up projections land in their rows of the fused layers; rotary
        buffers are skipped; with tied embeddings a checkpoint ``lm_head.weight`` is
        ignored; a quantized projection converts its format's tensors (``Linear.load``).
        Raises ValueError naming the offending tensors on a name this model has no place
        for, a shape mismatch, or parameters the checkpoint never filled.
        """
        params = dict(self.named_parameters())
        expected: set[tuple[str, str | None]] = set()
        for module_name, module in self.named_modules():
            if isinstance(module, Linear):
                shards = list(module.shard_sizes) if isinstance(module, FusedLinear) else [None]
                expected.update((f"{module_name}.{name}", shard) for shard in shards
                                for name in module.checkpoint_parameters())
            elif isinstance(module, FusedMoE):
                expected.update((f"{module_name}.{name}", part)
                                for name, part in module.load_parts())
            else:
                expected.update((f"{module_name}.{name}" if module_name else name, None)
                                for name, _ in module.named_parameters(recurse=False))
        loaded: set[tuple[str, str | None]] = set()
        unexpected: list[str] = []

        for name, tensor in weights:
            if any(re.match(pattern, name) for pattern in self.checkpoint_ignored):
                continue
            for pattern, replacement in self.checkpoint_renames:
                name = re.sub(pattern, replacement, name, count=1)
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            if name.endswith(_KV_SCALE_SUFFIXES):
                self._load_kv_scale(name, sharding.read(tensor))
                continue
            name = name.replace(".block_sparse_moe.", ".mlp.")
            if ".mlp.experts." in name:
                loaded.update(self._load_expert(name, sharding.read(tensor)))
                continue
            target, shard = _fused_target(name)
            module_name, _, param_name = target.rpartition(".")
            module = self._linear(module_name)
            if module is None:
                tensor = sharding.read(tensor)
            if not (target in params or (module is not None and module.reads(param_name))):
                if not self._held_by_another_stage(target):
                    unexpected.append(name)
                continue
            for shard, part in _shard_parts(module, param_name, shard, tensor):
                try:
                    if module is not None:
                        filled = module.load(param_name, part, shard)
                    else:
                        filled = param_name
                        _copy_checked(params[target], part)
                except ValueError as exc:
                    raise ValueError(
                        f"Checkpoint tensor {name}: {exc} The config.json does not describe "
                        "these weights."
                    ) from exc
                if filled is not None:
                    loaded.add((f"{module_name}.{filled}", shard))

        if unexpected:
            raise ValueError(
                f"The checkpoint has {len(unexpected)} tensor(s) {type(self).__name__} has no "
                f"place for: {_preview(unexpected)}. Check that config.json's architectures "
                "matches the weights."
            )
        missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
        if missing:
            raise ValueError(
                f"The checkpoint lacks {len(missing)} weight(s) {type(self).__name__} needs: "
                f"{_preview(missing)}."
            )


    def _held_by_another_stage(self, target: str) -> bool:
        """Whether the parameter ``target`` belongs to another pipeline stage's part of the
        model (a layer, the embedding, the final norm or the LM head it holds)."""
        pp = get_pp()
        if pp.num_stages == 1:
            return False
        match = re.match(r"model\.layers\.(\d+)\.", target)
        if match:
            return isinstance(self.model.layers[int(match.group(1))], LayerOfAnotherStage)
        return target.startswith(("model.embed_tokens.", "model.norm.", "lm_head."))

    def _load_expert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, str]]:
        """An expert tensor (``model.layers.N.mlp.experts.<rest>``) into its layer's
        stacked weights; returns the (parameter, part) pairs filled."""
        module_name, _, rest = name.partition(".experts.")
        module_name += ".experts"
        try:
            experts = self.get_submodule(module_name)
        except AttributeError:
            experts = None
        if not isinstance(experts, FusedMoE):
            raise ValueError(f"Checkpoint tensor {name}: layer {module_name} has no experts "
                             "(config.json's mlp_only_layers / decoder_sparse_step make it "
                             "dense).")
        try:
            filled = experts.load(rest, tensor)
        except ValueError as exc:
            raise ValueError(f"Checkpoint tensor {name}: {exc} The config.json does not "
                             "describe these weights.") from exc
        return [(f"{module_name}.{param}", part) for param, part in filled]

    def _linear(self, module_name: str) -> Linear | Embedding | None:
        """The projection (or embedding) called ``module_name``, which loads its own
        tensors (its rank's part of them), or None when there is none."""
        try:
            module = self.get_submodule(module_name)
        except AttributeError:
            return None
        return module if isinstance(module, (Linear, Embedding)) else None

    @classmethod
    def projection_names(cls, checkpoint_module: str) -> list[str]:
        """The names ``projections`` gives what a checkpoint module holds: its name as
        ``load_weights`` reads it (``checkpoint_renames``), or the names of the shards a
        fused checkpoint module holds (Phi-3's ``qkv_proj`` and ``gate_up_proj``)."""
        name = checkpoint_module
        for pattern, replacement in cls.checkpoint_renames:
            name = re.sub(pattern, replacement, name, count=1)
        parent, _, last = name.rpartition(".")
        return [f"{parent}.{original}" for fused, original, _ in STACKED_PARAMS
                if fused == last] or [name]

    def projections(self) -> Iterator[tuple[Linear | FusedMoE, list[str]]]:
        """Each projection inside the decoder layers with the checkpoint module names it
        holds (``...self_attn.q_proj``, ``k_proj``, ``v_proj`` for the fused qkv): what a
        checkpoint's quantization config names. A layer's experts come as one
        ``FusedMoE`` named by every expert's gate, up and down projections as the family's
        checkpoints name them (``expert_checkpoint_names``: they take one scheme); the
        routers (``mlp.gate``, ``shared_expert_gate``) are never quantized and not listed."""
        routers = set()
        for module in self.model.layers.modules():
            if isinstance(module, MoEBlock):
                routers.add(id(module.gate))
                if isinstance(getattr(module, "shared_expert_gate", None), Linear):
                    routers.add(id(module.shared_expert_gate))
        for name, module in self.model.layers.named_modules(prefix="model.layers"):
            if isinstance(module, FusedMoE):
                block, projections = self.expert_checkpoint_names
                prefix = name.replace(".mlp.experts", f".{block}.experts")
                yield module, [f"{prefix}.{e}.{p}" for e in range(module.num_experts)
                               for p in projections]
            elif isinstance(module, FusedLinear):
                parent, fused = name.rsplit(".", 1)
                shards = {shard: original for f, original, shard in STACKED_PARAMS if f == fused}
                yield module, [f"{parent}.{shards[shard]}" for shard in module.shard_sizes]
            elif isinstance(module, Linear) and id(module) not in routers:
                yield module, [name]

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> None:
        """A checkpoint's KV-cache scale (``model.layers.N.self_attn.k_scale`` or
        ``v_scale``, one value) onto layer N's attention, as a float."""
        parts = name.split(".")
        try:
            layer = self.model.layers[int(parts[parts.index("layers") + 1])]
        except (ValueError, IndexError):
            raise ValueError(f"Checkpoint tensor {name}: a KV-cache scale outside the "
                             "decoder layers.") from None
        if isinstance(layer, LayerOfAnotherStage):
            return
        if tensor.numel() != 1:
            raise ValueError(f"Checkpoint tensor {name}: a KV-cache scale must be one value "
                             f"(per tensor), got shape {tuple(tensor.shape)}.")
        setattr(layer.self_attn.attn, parts[-1], float(tensor.float().reshape(())))


def _copy_checked(param: nn.Parameter, tensor: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"Expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}.")
    param.data.copy_(tensor)


def _shard_parts(module: Linear | None, param_name: str, shard: str | None,
                 tensor: torch.Tensor) -> list[tuple[str | None, torch.Tensor]]:
    """``[(shard, tensor)]``; a checkpoint that stores a fused projection whole (Phi-3's
    ``qkv_proj`` and ``gate_up_proj``) is cut into its shards' parts, in shard order
    (``FusedLinear.checkpoint_parts``)."""
    if shard is None and isinstance(module, FusedLinear):
        return module.checkpoint_parts(param_name, tensor)
    return [(shard, tensor)]


def _fused_target(name: str) -> tuple[str, str | None]:
    """Checkpoint name -> (our parameter name, shard or None)."""
    for fused, original, shard in STACKED_PARAMS:
        marker = f".{original}."
        if marker in name:
            return name.replace(marker, f".{fused}."), shard
    return name, None


def _preview(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


class MistralForCausalLM(LlamaForCausalLM):
    family = "mistral"


class Qwen2ForCausalLM(LlamaForCausalLM):
    family = "qwen2"


class Qwen3ForCausalLM(LlamaForCausalLM):
    family = "qwen3"


class Phi3ForCausalLM(LlamaForCausalLM):
    family = "phi3"


class MixtralForCausalLM(LlamaForCausalLM):
    family = "mixtral"
    expert_checkpoint_names = ("block_sparse_moe", ("w1", "w3", "w2"))


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    family = "qwen2_moe"


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    family = "qwen3_moe"
