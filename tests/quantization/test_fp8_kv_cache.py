"""``--kv-cache-dtype fp8`` end to end on the demo model: greedy tokens equal HF transformers'
(up to a tie of its top logits) with every layer's keys (after the rope) and values
quantized to FP8 the same way, through
prefix-cache hits, chunked prefill and preemption; per-layer scales reach the kernels;
held-out perplexity moves by under 1%; bad values and old GPUs are refused."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import resolve_model_path
from pagedllm.engine.arg_utils import EngineArgs

FP8 = torch.float8_e4m3fn
DEMO = resolve_model_path("pagedllm-demo")
MAX_NEW = 16
# Per-layer scales, as an FP8 checkpoint's self_attn.k_scale / v_scale set them.
K_SCALES = [0.05, 0.11, 0.3, 0.07, 0.2, 0.13]
V_SCALES = [0.02, 0.06, 0.015, 0.09, 0.04, 0.03]

STEM = '''import os


def find_files(root, suffix=".py"):
    """Yield the paths of the files under root whose name ends with suffix."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(filenames):
'''
TAILS = ["            if name.endswith(suffix):", "            yield", "            if name",
         "            path = os.path.join(", "            print("]
OTHERS = ["class Stack:\n    def push(self, item):", "def fibonacci(n):"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread; more only contend on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    bos = tokenizer.token_to_id("<|bos|>")
    return [[bos, *tokenizer.encode(text, add_special_tokens=False).ids]
            for text in [STEM + tail for tail in TAILS] + OTHERS]


def _fake_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8).float().mul(scale).to(x.dtype)


# Logits this close to the largest are a tie: a key one rounding step of FP8 away (a GPU's
# float32 arithmetic differs from the CPU's in the last bits) may pick either token.
TIE = 1e-2


def hf_fp8_kv_greedy(prompts, max_new_tokens, monkeypatch) -> list[list[tuple[int, set]]]:
    """HF transformers' greedy tokens with each layer's rotated keys and its values stored
    as an FP8 cache of that layer's scales stores them (quantized, then read back): per
    prompt, each step's (token, tokens tied with it)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    layer = {}
    rope = modeling_llama.apply_rotary_pos_emb

    def rope_then_fp8_keys(q, k, cos, sin, *args, **kwargs):
        q, k = rope(q, k, cos, sin, *args, **kwargs)
        return q, _fake_fp8(k, K_SCALES[layer["index"]])

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rope_then_fp8_keys)
    for i, decoder in enumerate(model.model.layers):
        decoder.self_attn.register_forward_pre_hook(lambda m, a, i=i: layer.update(index=i))
        decoder.self_attn.v_proj.register_forward_hook(
            lambda m, a, out, i=i: _fake_fp8(out, V_SCALES[i]))
    with torch.no_grad():
        return [_greedy_without_cache(model, p, max_new_tokens) for p in prompts]


def _greedy_without_cache(model, prompt: list[int], max_new_tokens: int
                          ) -> list[tuple[int, set]]:
    """Greedy steps, each from a full forward pass (the prompts start with <|bos|>, id 0,
    which ``generate`` would take for padding): (token, tokens within ``TIE`` of it)."""
    ids, steps = list(prompt), []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        token = int(logits.argmax())
        steps.append((token, set(torch.nonzero(logits >= logits[token] - TIE).flatten().tolist())))
        ids.append(token)
    return steps


def assert_greedy_matches(got: list[list[int]], want: list[list[tuple[int, set]]]) -> None:
    """Each request's tokens are HF's, up to a step where HF's top logits tie and the
    engine took another of the tied tokens (after which the two texts part)."""
    for tokens, steps in zip(got, want, strict=True):
        assert len(tokens) == len(steps)
        for token, (hf_token, tied) in zip(tokens, steps):
            if token != hf_token:
                assert token in tied, (tokens, [t for t, _ in steps])
                break


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _set_scales(llm: LLM) -> None:
    """The per-layer scales onto a running engine, as loading an FP8 checkpoint sets them
    (an engine built with ``enforce_eager``: a CUDA graph keeps the scales of its capture)."""
    layers = llm.llm_engine.engine_core.model_runner.model.model.layers
    assert len(layers) == len(K_SCALES)
    for decoder, k_scale, v_scale in zip(layers, K_SCALES, V_SCALES):
        decoder.self_attn.attn.k_scale, decoder.self_attn.attn.v_scale = k_scale, v_scale


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_tokens_equal_hf_with_fp8_keys_and_values(prompts, monkeypatch, async_scheduling):
    """Shared prefixes (cache hits), a 24-token step budget (chunks) and 20 blocks of 8
    tokens for 7 requests of up to 96 tokens (preemption), all at once."""
    want = hf_fp8_kv_greedy(prompts, MAX_NEW, monkeypatch)
    # float32 as the reference, on any device (a GPU's default would be the checkpoint's
    # half precision, whose tokens part from float32's).
    llm = LLM(kv_cache_dtype="fp8", block_size=8, num_kv_blocks=20, max_num_batched_tokens=24,
              max_model_len=128, async_scheduling=async_scheduling, enforce_eager=True,
              dtype="float32")
    _set_scales(llm)
    assert llm.llm_engine.engine_core.model_runner.kv_caches[0].dtype == FP8
    assert_greedy_matches(_greedy(llm, prompts[:1]), want[:1])  # its full blocks stay cached
    assert_greedy_matches(_greedy(llm, prompts[1:]), want[1:])
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.num_preemptions_total > 0
    assert scheduler.kv_cache_manager.prefix_cache_stats.hits >= 4 * 48
    assert scheduler.kv_cache_manager.num_free_blocks == 20


def test_the_layers_scales_change_what_is_cached(prompts):
    """Scales of 1.0 (no checkpoint scales) and the per-layer ones store different bytes."""
    caches = []
    for scaled in (False, True):
        llm = LLM(kv_cache_dtype="fp8", num_kv_blocks=16, max_model_len=128, enforce_eager=True)
        if scaled:
            _set_scales(llm)
        _greedy(llm, prompts[-1:])
        caches.append(llm.llm_engine.engine_core.model_runner.kv_caches[0][0, 0].float())
    assert caches[1].abs().max() > 4 * caches[0].abs().max()


def test_fp8_kv_cache_changes_held_out_perplexity_by_under_one_percent():
    """The first 8 windows of 512 tokens of the demo model's held-out test files
    (scripts/demo_model_perplexity.py scores them all)."""
    scripts = Path(__file__).resolve().parents[2] / "scripts"
    sys.path.insert(0, str(scripts))
    try:
        import demo_model_perplexity as ppl
    finally:
        sys.path.remove(str(scripts))
    windows = ppl.held_out_windows(max_windows=8)
    auto, fp8 = (ppl.mean_nll(windows, kv_cache_dtype=d, max_model_len=ppl.SEQ_LEN + 1)
                 for d in ("auto", "fp8"))
    assert auto < 0.5 * math.log(4096)  # the model itself is sound on this text
    assert fp8 != auto  # the cache really is FP8
    assert abs(math.exp(fp8) / math.exp(auto) - 1.0) < 0.01


def test_an_unsupported_kv_cache_dtype_names_the_flag():
    with pytest.raises(ValueError, match="--kv-cache-dtype int8 .* use auto .* or fp8"):
        LLM(kv_cache_dtype="int8")
    assert EngineArgs(kv_cache_dtype="fp8_e4m3").create_engine_config().cache_config.cache_dtype == "fp8"


def test_fp8_kv_cache_is_refused_on_a_gpu_older_than_compute_capability_8_9(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability 8\.9 or higher .* has 8\.0: drop "
                                         r"--kv-cache-dtype"):
        EngineArgs(kv_cache_dtype="fp8", device="cuda").create_engine_config()
    EngineArgs(kv_cache_dtype="auto", device="cuda").create_engine_config()  # bf16 cache: fine
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    EngineArgs(kv_cache_dtype="fp8", device="cuda").create_engine_config()
