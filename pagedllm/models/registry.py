"""Model classes by the Hugging Face ``architectures`` names in a checkpoint's config.json."""

from __future__ import annotations

from torch import nn

from pagedllm.models.gemma import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
)
from pagedllm.models.gpt_neox import FalconForCausalLM, GPTNeoXForCausalLM
from pagedllm.models.opt import OPTForCausalLM
from pagedllm.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    MixtralForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "FalconForCausalLM": FalconForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    """The class for the first supported name in ``architectures``.

    Raises ValueError naming the supported architectures when none is supported.
    """
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(
        f"Model architectures {list(architectures)} are not supported; supported "
        f"architectures: {supported_architectures()}. Check the checkpoint's config.json; "
        "docs/adding_a_model.md says how to add an architecture."
    )
