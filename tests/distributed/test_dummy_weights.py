"""Dummy weights (``--load-format dummy``) are a function of the checkpoint tensor and the
seed alone: a tensor-parallel rank holds exactly its part of the one-rank model's values,
a pipeline stage the same values for its layers, and greedy tokens at TP=2 equal TP=1."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.distributed import parallel_state
from pagedllm.models.loader import load_model
from tests.utils import make_tiny_checkpoint

HEAD = 16  # 64 hidden / 4 heads


def _dummy(path, monkeypatch, tp_rank: int = 0, tp_size: int = 1, stage: int = 0,
           num_stages: int = 1):
    """The dummy model as rank ``tp_rank`` of ``tp_size`` in pipeline stage ``stage`` sees it."""
    monkeypatch.setattr(parallel_state, "_TP", parallel_state.TensorParallelGroup(tp_rank, tp_size))
    monkeypatch.setattr(parallel_state, "_PP", parallel_state.PipelineStage(
        stage, num_stages, stage * tp_size + tp_rank, tp_size))
    model = load_model(ModelConfig(str(path), load_format="dummy", seed=11), "cpu", torch.float32)
    monkeypatch.setattr(parallel_state, "_TP", parallel_state.TensorParallelGroup())
    monkeypatch.setattr(parallel_state, "_PP", parallel_state.PipelineStage())
    return model


def _half(tensor: torch.Tensor, rank: int, dim: int = 0) -> torch.Tensor:
    return tensor.chunk(2, dim=dim)[rank]


def _fp8_config(path):
    """``path``'s config as a static FP8 checkpoint's (the dummy load needs no tensors)."""
    fp8 = path.parent / "fp8"
    fp8.mkdir()
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8


@pytest.mark.parametrize("fp8", [False, True], ids=["float32", "fp8"])
def test_each_rank_holds_its_part_of_the_one_rank_dummy_weights(fp8, tmp_path,
                                                                monkeypatch) -> None:
    """Ranks 0 and 1 of 2 hold the halves of TP=1's q/k/v heads and gate/up rows (and
    biases), of o_proj's and down_proj's columns, and of the vocabulary rows (251 rows in
    parts of 126, the last padded with a zero row); norms are 1 everywhere."""
    path = make_tiny_checkpoint(tmp_path, "llama", vocab_size=251, attention_bias=not fp8,
                                mlp_bias=not fp8)
    if fp8:
        path = _fp8_config(path)
    whole = _dummy(path, monkeypatch)
    embed, head = whole.model.embed_tokens.weight, whole.lm_head.weight
    for rank in (0, 1):
        part = _dummy(path, monkeypatch, rank, 2)
        for i, layer in enumerate(part.model.layers):
            want = whole.model.layers[i]
            qkv, w_qkv = layer.self_attn.qkv_proj, want.self_attn.qkv_proj
            params = ["weight"] + ([] if fp8 else ["bias"])
            for name in params:
                q, k, v = getattr(w_qkv, name).split([4 * HEAD, 2 * HEAD, 2 * HEAD])
                assert torch.equal(getattr(qkv, name).float(), torch.cat(
                    [_half(q, rank), _half(k, rank), _half(v, rank)]).float()), name
                gate, up = getattr(want.mlp.gate_up_proj, name).chunk(2)
                assert torch.equal(getattr(layer.mlp.gate_up_proj, name).float(),
                                   torch.cat([_half(gate, rank), _half(up, rank)]).float())
            for proj, w_proj in ((layer.self_attn.o_proj, want.self_attn.o_proj),
                                 (layer.mlp.down_proj, want.mlp.down_proj)):
                assert torch.equal(proj.weight.float(), _half(w_proj.weight, rank, 1).float())
                if not fp8:  # a row-parallel bias is whole on every rank
                    assert torch.equal(proj.bias, w_proj.bias)
            if fp8:
                assert qkv.weight.dtype == torch.float8_e4m3fn
                assert torch.equal(qkv.weight_scale, w_qkv.weight_scale[:qkv.output_size])
            assert (layer.input_layernorm.weight == 1).all()
        part_embed, part_head = part.model.embed_tokens.weight, part.lm_head.weight
        rows = slice(0, 126) if rank == 0 else slice(126, 251)
        assert part_embed.shape[0] == part_head.shape[0] == 126
        assert torch.equal(part_embed[:rows.stop - rows.start], embed[rows])
        assert torch.equal(part_head[:rows.stop - rows.start], head[rows])
        if rank == 1:
            assert not part_embed[125].any() and not part_head[125].any()


def test_pipeline_stages_hold_the_whole_models_dummy_weights(tmp_path, monkeypatch) -> None:
    """Every stage (alone, and as rank 1 of 2 within it) holds the whole model's values
    for its layers; the last stage's tied LM head is the first stage's embedding."""
    path = make_tiny_checkpoint(tmp_path, "qwen3", num_hidden_layers=3,
                                tie_word_embeddings=True)
    whole = dict(_dummy(path, monkeypatch).named_parameters())
    whole_tp = dict(_dummy(path, monkeypatch, 1, 2).named_parameters())
    for tp_rank, tp_size, want in ((0, 1, whole), (1, 2, whole_tp)):
        held = set()
        for stage in (0, 1):
            params = dict(_dummy(path, monkeypatch, tp_rank, tp_size, stage, 2).named_parameters())
            assert "model.embed_tokens.weight" in params
            for name, param in params.items():
                assert torch.equal(param, want[name]), name
            held.update(params)
        assert held == set(want)


def test_dummy_greedy_tokens_at_tp2_equal_tp1(tmp_path) -> None:
    """The engine on dummy float32 weights: two ranks over gloo sample what one does."""
    from pagedllm import LLM, SamplingParams
    from tests.engine.conftest import VOCAB_SIZE, random_prompts
    from tests.tokenizer_utils import make_tiny_tokenizer

    path = make_tiny_checkpoint(tmp_path, "llama", vocab_size=VOCAB_SIZE)
    make_tiny_tokenizer(path, vocab_size=VOCAB_SIZE)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 5, 20, seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def greedy(tp: int) -> list[list[int]]:
        llm = LLM(str(path), load_format="dummy", dtype="float32", tensor_parallel_size=tp,
                  block_size=8, num_kv_blocks=32, max_model_len=48)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                 use_tqdm=False)]
        finally:
            llm.llm_engine.engine_core.shutdown()

    one = greedy(1)
    assert len({tuple(t) for t in one}) > 1  # not one token everywhere: the test can fail
    assert greedy(2) == one
