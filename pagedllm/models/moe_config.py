"""Which layers of a mixture-of-experts checkpoint are sparse, and their experts' shape,
read from config.json (no torch: the memory model of doctor and plan uses it too)."""

from __future__ import annotations

from typing import Any

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def moe_fields(hf: dict, family: str, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of ``LlamaArchConfig`` (none for dense families):
    ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``norm_topk_prob``, ``moe_layers`` (one bool per layer: sparse) and
    ``shared_expert_intermediate_size`` (Qwen2-MoE; 0 elsewhere)."""
    if family == "mixtral":
        return dict(num_experts=num_experts(hf),
                    num_experts_per_tok=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True,
                    moe_layers=(True,) * num_layers, shared_expert_intermediate_size=0)
    if family in ("qwen2_moe", "qwen3_moe"):
        experts = num_experts(hf)
        step = hf.get("decoder_sparse_step", 1)
        if step < 1:
            raise ValueError(f"decoder_sparse_step={step} is not supported (must be >= 1).")
        dense = set(hf.get("mlp_only_layers") or [])
        return dict(num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["moe_intermediate_size"],
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    moe_layers=tuple(experts > 0 and i not in dense
                                     and (i + 1) % step == 0 for i in range(num_layers)),
                    shared_expert_intermediate_size=(
                        hf.get("shared_expert_intermediate_size") or 0
                        if family == "qwen2_moe" else 0))
    return {}


def num_experts(hf: dict) -> int:
    """Published configs say ``num_local_experts`` (Mixtral) or ``num_experts``
    (Qwen3-MoE); transformers writes either name for both."""
    value = hf.get("num_experts", hf.get("num_local_experts"))
    if value is None:
        raise ValueError("config.json gives no number of experts (num_experts or "
                         "num_local_experts).")
    return value
