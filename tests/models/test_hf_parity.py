"""Our models reproduce Hugging Face transformers' logits, prefill and paged decode alike."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.layers.attention.backend import set_forward_context
from pagedllm.models.loader import load_model
from tests.utils import make_attention_metadata, make_kv_caches, make_tiny_checkpoint

BLOCK_SIZE = 8
PROMPT_LENS = (13, 5, 21)
# Per prompt, the tokens fed at each step of the paged run (sums equal PROMPT_LENS): prefill
# chunks, later chunks on top of cached context and single-token decodes share steps.
CHUNK_PLANS = ((6, 1, 4, 1, 1), (2, 1, 1, 1), (9, 5, 1, 3, 1, 2))

CASES = {
    "llama_gqa_llama3_rope_untied": ("llama", dict(
        num_key_value_heads=2,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    )),
    "llama_tied_embeddings": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "llama_linear_rope_with_biases": ("llama", dict(
        rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True, mlp_bias=True,
    )),
    "llama_mqa": ("llama", dict(num_key_value_heads=1)),
    "mistral_sliding_window": ("mistral", dict(sliding_window=5)),
    "qwen2_qkv_bias": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2_sliding_upper_layers_yarn": ("qwen2", dict(
        use_sliding_window=True, sliding_window=4, max_window_layers=1,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )),
    "qwen3_qk_norm_wide_head_dim": ("qwen3", dict(head_dim=24, num_key_value_heads=2)),
    "phi3_fused_checkpoint_sliding_window": ("phi3", dict(sliding_window=7)),
    # Prompts stay below the original context, where HF rotates by the short factors.
    "phi3_longrope_short_factors": ("phi3", dict(
        max_position_embeddings=1024, original_max_position_embeddings=64,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(8)],
                      "long_factor": [2.0 + i for i in range(8)]})),
    "gemma2_softcaps_alternating_window": ("gemma2", dict(
        num_hidden_layers=3, sliding_window=6, attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0)),
    "gemma2_untied_without_caps": ("gemma2", dict(
        tie_word_embeddings=False, attn_logit_softcapping=None, final_logit_softcapping=None,
        sliding_window=4)),
    "gemma3_local_and_scaled_global_rope_qk_norm": ("gemma3", dict(
        num_hidden_layers=3, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 10000.0}})),
    "gpt_neox_parallel_partial_rotary": ("gpt_neox", dict(rotary_pct=0.25)),
    "gpt_neox_sequential_full_rotary_tied": ("gpt_neox", dict(
        use_parallel_residual=False, rotary_pct=1.0, tie_word_embeddings=True)),
    "falcon_7b_multi_query_shared_norm": ("falcon", dict(multi_query=True)),
    "falcon_40b_grouped_kv_two_norms_bias": ("falcon", dict(
        new_decoder_architecture=True, num_kv_heads=2, bias=True)),
    "falcon_per_head_sequential_untied": ("falcon", dict(
        multi_query=False, parallel_attn=False, tie_word_embeddings=False)),
    "opt_pre_norm_learned_positions": ("opt", dict()),
    "opt_post_norm_projected_embeddings": ("opt", dict(
        do_layer_norm_before=False, word_embed_proj_dim=32)),
    "phi3_partial_rotary_longrope": ("phi3", dict(
        partial_rotary_factor=0.5, max_position_embeddings=1024,
        original_max_position_embeddings=64,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                      "long_factor": [2.0, 3.0, 5.0, 8.0]})),
    "qwen2_moe_shared_expert_dense_layer": ("qwen2_moe", dict(
        num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=False)),
    "mixtral_top2_of_4_sliding_window": ("mixtral", dict(sliding_window=6)),
    "mixtral_top1_of_3": ("mixtral", dict(num_local_experts=3, num_experts_per_tok=1)),
    "qwen3_moe_unnormalised_top3_of_5": ("qwen3_moe", dict(
        num_experts=5, num_experts_per_tok=3, norm_topk_prob=False)),
    "qwen3_moe_normalised_dense_and_stepped_layers": ("qwen3_moe", dict(
        num_hidden_layers=4, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3],
        use_sliding_window=True, sliding_window=5)),
}


@dataclass
class Pair:
    ours: torch.nn.Module
    hf_logits: list[torch.Tensor]  # per prompt, [len, vocab] float32
    prompts: list[torch.Tensor]


_pairs: dict[str, Pair] = {}


def _prompts(vocab_size: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in PROMPT_LENS]


@pytest.fixture
def pair(request, tmp_path_factory) -> Pair:
    """Our model and HF's reference logits for one case, built once per session."""
    case = request.param
    if case not in _pairs:
        import transformers

        family, overrides = CASES[case]
        overrides = {k: (dict(v) if isinstance(v, dict) else v) for k, v in overrides.items()}
        path = make_tiny_checkpoint(tmp_path_factory.mktemp(case), family, **overrides)
        ours = load_model(ModelConfig(model=str(path)), "cpu", torch.float32)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        prompts = _prompts(ours.config.vocab_size)
        with torch.no_grad():
            hf_logits = [hf(p[None]).logits[0].float() for p in prompts]
        _pairs[case] = Pair(ours, hf_logits, prompts)
    return _pairs[case]


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4 * max(scale, 1.0))


def _kv_caches(model: torch.nn.Module, num_blocks: int) -> list[torch.Tensor]:
    cfg = model.config
    return make_kv_caches(cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)


@pytest.mark.parametrize("pair", list(CASES), indirect=True)
def test_prompt_logits_match_hf_in_one_flat_batch(pair: Pair) -> None:
    tables, next_block = [], 0
    for n in PROMPT_LENS:
        blocks = -(-n // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    metadata = make_attention_metadata(tables, list(PROMPT_LENS), list(PROMPT_LENS), BLOCK_SIZE)
    input_ids = torch.cat(pair.prompts)
    positions = torch.cat([torch.arange(n) for n in PROMPT_LENS])
    with torch.inference_mode(), set_forward_context(metadata, _kv_caches(pair.ours, next_block)):
        logits = pair.ours.compute_logits(pair.ours(input_ids, positions))

    assert logits.dtype == torch.float32
    assert logits.shape == (sum(PROMPT_LENS), pair.ours.config.vocab_size)
    for rows, ref in zip(logits.split(list(PROMPT_LENS)), pair.hf_logits):
        assert_logits_close(rows, ref)


@pytest.mark.parametrize("pair", list(CASES), indirect=True)
def test_chunked_and_decoded_tokens_through_shuffled_paged_cache_match_hf(pair: Pair) -> None:
    rng = random.Random(7)
    num_blocks = 24
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for n in PROMPT_LENS:
        blocks = -(-n // BLOCK_SIZE)
        tables.append(free[:blocks])
        free = free[blocks:]
    caches = _kv_caches(pair.ours, num_blocks)
    computed = [0] * len(PROMPT_LENS)
    collected: list[list[torch.Tensor]] = [[] for _ in PROMPT_LENS]

    for step in range(max(len(plan) for plan in CHUNK_PLANS)):
        batch = [b for b, plan in enumerate(CHUNK_PLANS) if step < len(plan)]
        if step % 2:
            batch.reverse()  # batch order must not matter
        query_lens = [CHUNK_PLANS[b][step] for b in batch]
        seq_lens = [computed[b] + q for b, q in zip(batch, query_lens)]
        metadata = make_attention_metadata(
            [tables[b] for b in batch], seq_lens, query_lens, BLOCK_SIZE
        )
        input_ids = torch.cat([pair.prompts[b][computed[b]:s] for b, s in zip(batch, seq_lens)])
        positions = torch.cat([torch.arange(computed[b], s) for b, s in zip(batch, seq_lens)])
        with torch.inference_mode(), set_forward_context(metadata, caches):
            logits = pair.ours.compute_logits(pair.ours(input_ids, positions))
        for b, rows in zip(batch, logits.split(query_lens)):
            collected[b].append(rows)
        for b, s in zip(batch, seq_lens):
            computed[b] = s

    assert computed == list(PROMPT_LENS)
    for rows, ref in zip(collected, pair.hf_logits):
        assert_logits_close(torch.cat(rows), ref)


@pytest.mark.parametrize("pair", ["mistral_sliding_window", "qwen3_qk_norm_wide_head_dim"],
                         indirect=True)
def test_forward_without_metadata_runs_tokens_as_one_causal_sequence(pair: Pair) -> None:
    """The profiling pass (no KV cache yet) sees the tokens as one prompt."""
    prompt = pair.prompts[2]
    with torch.inference_mode(), set_forward_context(None, []):
        logits = pair.ours.compute_logits(pair.ours(prompt, torch.arange(len(prompt))))
    assert_logits_close(logits, pair.hf_logits[2])
