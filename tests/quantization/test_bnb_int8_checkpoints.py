"""bitsandbytes 8-bit (LLM.int8) checkpoints, made by the tools operators use: transformers
loads a tiny model with ``BitsAndBytesConfig(load_in_8bit=True)`` (bitsandbytes quantizes
it, on the CPU) and ``save_pretrained`` writes it. pagedllm detects them from config.json
and picks the greedy tokens of HF transformers running the same file through
bitsandbytes' ``Linear8bitLt`` one token a forward pass (the engine multiplies each token
on its own: ``pagedllm.quantization.llm_int8``), and those of HF's own ``generate`` where
the two agree (no outliers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedllm import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, random_prompts
from tests.quantization.int_checkpoints import read_tensors
from tests.quantization.teacher_forced import assert_engine_picks, full_pass_logprobs
from tests.quantization.checkpoint_runs import runner_model, with_quantization_config
from tests.utils import make_tiny_checkpoint

bnb = pytest.importorskip("bitsandbytes")

TINY = dict(vocab_size=256, max_position_embeddings=128, hidden_size=128,
            intermediate_size=256)


def write_int8(src: Path, out: Path, **config) -> Path:
    """``src`` quantized to 8 bits by bitsandbytes as transformers loads it, saved to ``out``."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=BitsAndBytesConfig(load_in_8bit=True, **config),
        device_map="cpu", dtype=torch.float32)
    model.save_pretrained(out)
    return out


def hf_int8(model_dir: Path):
    """transformers' model of the checkpoint: its 8-bit projections are bitsandbytes'."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, device_map="cpu",
                                                dtype=torch.float32).eval()


def hf_greedy_row_by_row(model, prompt: list[int], max_tokens: int
                         ) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation with every forward pass one token long, the prompt's too
    (bitsandbytes' products of one row each, as the engine computes every row:
    ``pagedllm.quantization.llm_int8``), and the logprobs of each of its steps
    (``[max_tokens, vocab]``)."""
    from transformers import DynamicCache

    cache, tokens, steps = DynamicCache(), list(prompt), []
    with torch.no_grad():
        for token in prompt[:-1]:
            model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        for _ in range(max_tokens):
            logits = model(torch.tensor([tokens[-1:]]), past_key_values=cache,
                           use_cache=True).logits[0, -1].float()
            steps.append(torch.log_softmax(logits, dim=-1))
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):], torch.stack(steps)


def hf_full_prompt_greedy(model, prompt: list[int], max_tokens: int
                          ) -> tuple[list[int], torch.Tensor]:
    """HF's own greedy continuation (``generate``: the prompt in one pass) and the
    logprobs of its steps, from one forward pass over prompt and continuation."""
    want = hf_greedy(model, prompt, max_tokens)
    return want, full_pass_logprobs(model, prompt, want)


# bitsandbytes quantizes an input through float16, which turns float noise (the engine
# and HF sum attention in other orders) into a float16 rounding step now and then, and at
# a rounding boundary into another int8 code: a logprob moves by up to about 0.01 on these
# models. Tokens within TIE of each other are a tie either may win (``assert_engine_picks``).
TIE = 0.03


def engine(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", block_size=8, max_model_len=128, device="cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bnb-int8")
    llama = make_tiny_checkpoint(root, "llama", **TINY)
    qwen3 = make_tiny_checkpoint(root, "qwen3", head_dim=32, **TINY)
    return {
        "llama": llama,
        "llama-int8": write_int8(llama, root / "llama-int8"),  # threshold 6.0
        # most inputs of these tiny models lie within 1.5: many outliers
        "llama-int8-threshold-1.5": write_int8(llama, root / "t15", llm_int8_threshold=1.5),
        "qwen3-int8-threshold-0": write_int8(qwen3, root / "t0", llm_int8_threshold=0.0),
        "qwen3-int8-skip-down": write_int8(qwen3, root / "skip",
                                           llm_int8_skip_modules=["down_proj", "lm_head"]),
    }


@pytest.mark.parametrize("name, threshold", [
    ("llama-int8", 6.0), ("llama-int8-threshold-1.5", 1.5), ("qwen3-int8-threshold-0", 0.0),
    ("qwen3-int8-skip-down", 6.0)])
def test_bnb_8bit_checkpoint_picks_hfs_tokens_one_row_at_a_time(checkpoints, name, threshold):
    """HF's greedy tokens with bitsandbytes' products one row at a time
    (``hf_greedy_row_by_row``) are the engine's, teacher-forced (``assert_engine_picks``)."""
    llm = engine(checkpoints[name])
    layer = runner_model(llm).model.layers[0]
    qkv, down = layer.self_attn.qkv_proj, layer.mlp.down_proj
    assert qkv.weight.dtype == torch.int8 and qkv.llm_int8_threshold == threshold
    assert down.weight.dtype == (torch.float32 if name.endswith("skip-down") else torch.int8)
    model = hf_int8(checkpoints[name])
    prompts = random_prompts(4, 3, 20, seed=31, vocab=256)
    for prompt in prompts:
        assert_engine_picks(llm, prompt, *hf_greedy_row_by_row(model, prompt, 10), TIE)


def test_threshold_0_picks_hfs_own_generate(checkpoints):
    """With no outliers (threshold 0) bitsandbytes' products of a whole prompt at once are
    those of its rows one at a time: the engine picks the tokens of HF's own ``generate``."""
    llm = engine(checkpoints["qwen3-int8-threshold-0"])
    model = hf_int8(checkpoints["qwen3-int8-threshold-0"])
    for prompt in random_prompts(3, 3, 20, seed=33, vocab=256):
        assert_engine_picks(llm, prompt, *hf_full_prompt_greedy(model, prompt, 10), TIE)


def test_8_bits_and_the_outlier_threshold_change_the_logprobs(checkpoints):
    """What the comparisons above tell apart: the float model's logprobs, and those of
    the same weights with 1.5 for the outlier threshold, are more than 3 * TIE from those
    of the 8-bit checkpoint with 6.0 on some token."""
    prompts = random_prompts(4, 3, 20, seed=31, vocab=256)
    _, int8 = engine_greedy_logprobs(engine(checkpoints["llama-int8"]), prompts, 10)
    for other in ("llama", "llama-int8-threshold-1.5"):
        _, logprobs = engine_greedy_logprobs(engine(checkpoints[other]), prompts, 10)
        gap = max(abs(a - b) for x, y in zip(int8, logprobs) for a, b in zip(x, y))
        assert gap > 3 * TIE, (other, gap)


def engine_greedy_logprobs(llm: LLM, prompts, max_tokens: int
                           ) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outputs],
            [[entry[token].logprob for token, entry in zip(o.outputs[0].token_ids,
                                                           o.outputs[0].logprobs)]
             for o in outputs])


def _edited(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for path in src.iterdir():
        if path.suffix != ".safetensors":
            (dst / path.name).write_bytes(path.read_bytes())
    tensors = read_tensors(src)
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_column_major_weights_are_refused_naming_the_layout(checkpoints, tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight_format"
    model_dir = _edited(checkpoints["llama-int8"], tmp_path / "col",
                        lambda t: t.update({name: torch.tensor(2, dtype=torch.uint8)}))
    with pytest.raises(ValueError, match=r"o_proj\.weight_format is 'col_turing'.*row-major"):
        engine(model_dir)


@pytest.mark.parametrize("edit, message", [
    (dict(llm_int8_has_fp16_weight=True), "llm_int8_has_fp16_weight=true"),
    (dict(llm_int8_threshold=-1), "llm_int8_threshold=-1 must be a number >= 0"),
    # 8-bit tensors under a 4-bit config
    (dict(load_in_8bit=False, _load_in_8bit=False, load_in_4bit=True, _load_in_4bit=True),
     r"_proj is stored in 8-bit bitsandbytes tensors, but .* says load_in_4bit"),
])
def test_unsupported_8bit_variants_are_refused_by_name(checkpoints, tmp_path, edit, message):
    model_dir = with_quantization_config(checkpoints["llama-int8"], tmp_path / "edited",
                                         lambda q: q.update(edit))
    with pytest.raises(ValueError, match=message):
        engine(model_dir)


def test_8bit_experts_are_refused(tmp_path):
    """bitsandbytes quantizes experts that are ``Linear`` modules (transformers' older
    mixture-of-experts classes); their LLM.int8 products are not implemented here."""
    src = make_tiny_checkpoint(tmp_path, "qwen3_moe", vocab_size=256, max_position_embeddings=128)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (src / "config.json").write_text(json.dumps(config))

    def experts_in_8_bits(tensors: dict) -> None:
        for name in [n for n in tensors if ".experts." in n and n.endswith(".weight")]:
            scb = tensors[name].abs().amax(dim=1).float()
            tensors[name] = torch.round(tensors[name] * 127 / scb[:, None]).to(torch.int8)
            tensors[name.removesuffix("weight") + "SCB"] = scb

    model_dir = _edited(src, tmp_path / "experts", experts_in_8_bits)
    with pytest.raises(ValueError, match="experts.*bitsandbytes 8-bit experts"):
        engine(model_dir)


def test_weight_bytes_counts_8bit_weights_as_the_engine_stores_them(checkpoints):
    """``pagedllm doctor`` and ``plan`` size the KV cache from ``weight_bytes``: a byte a
    weight and a float32 ``SCB`` a row, to the byte."""
    from pagedllm.worker import kv_allocator

    llm = engine(checkpoints["llama-int8"])
    held = sum(p.numel() * p.element_size() for p in runner_model(llm).parameters())
    config = llm.llm_engine.config.model_config
    assert config.quant_config.storage() == ("fp8", -1)
    assert kv_allocator.weight_bytes(config.hf_config, 4, "fp8", -1) == held


def test_bitsandbytes_flags_take_an_8bit_checkpoint(checkpoints):
    """vLLM's ``--quantization bitsandbytes --load-format bitsandbytes`` load it as without
    them; a flag naming another method is refused."""
    llm = LLM(str(checkpoints["llama-int8"]), quantization="bitsandbytes",
              load_format="bitsandbytes", dtype="float32", max_model_len=128, device="cpu")
    assert runner_model(llm).model.layers[0].mlp.down_proj.llm_int8_threshold == 6.0
    with pytest.raises(ValueError, match="--quantization fp8 contradicts the checkpoint"):
        LLM(str(checkpoints["llama-int8"]), quantization="fp8", device="cpu")


def test_dummy_8bit_weights_span_the_dummy_range(checkpoints):
    """``--load-format dummy`` with bitsandbytes' 8-bit config (the benchmarks' way): the
    weights (``q * SCB / 127``) span what the float dummy weights span, and generate."""
    config = {"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}
    int8 = LLM(str(checkpoints["llama"]), load_format="dummy", hf_overrides=config,
               dtype="float32", max_model_len=64, device="cpu")
    plain = LLM(str(checkpoints["llama"]), load_format="dummy", dtype="float32",
                max_model_len=64, device="cpu")
    qkv = runner_model(int8).model.layers[0].self_attn.qkv_proj
    assert qkv.llm_int8_threshold == 6.0
    weights = qkv.weight.float() * qkv.weight_scale / 127
    float_max = runner_model(plain).model.layers[0].self_attn.qkv_proj.weight.abs().max()
    assert weights.abs().max().item() == pytest.approx(float_max.item(), rel=0.05)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    assert len(int8.generate([{"prompt_token_ids": [1, 2, 3]}], params,
                             use_tqdm=False)[0].outputs[0].token_ids) == 5
