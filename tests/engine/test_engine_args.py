"""Engine arguments as the offline API takes them: refusals say what to change."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams


def test_cuda_with_a_cpu_only_torch_is_refused_before_loading(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match="CPU-only build: install a CUDA build of torch") as info:
        LLM(device="cuda")
    assert "--device cpu" in str(info.value)


def test_cuda_that_sees_no_gpu_names_the_driver_and_visible_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(ValueError, match="sees no GPU: check the NVIDIA driver"):
        LLM(device="cuda")


def test_unknown_device_names_the_valid_ones():
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'gpu'"):
        LLM(device="gpu")


def test_unsupported_option_names_the_flag_to_drop_and_the_keyword():
    with pytest.raises(ValueError) as info:
        LLM(quantization="aqlm")
    assert str(info.value) == (
        "--quantization aqlm (quantization='aqlm') is not supported by "
        "pagedllm yet: use fp8, compressed-tensors, gptq, awq, auto-round, modelopt or "
        "bitsandbytes, or drop --quantization (the quantization keyword in Python).")
    with pytest.raises(ValueError, match=r"^--enable-lora \(enable_lora=True\) is not supported"):
        LLM(enable_lora=True)


def test_vllm_download_dir_is_refused_with_what_to_do_instead():
    """vLLM's --download-dir, as command lines copied from it pass it: refused with the
    flag, the keyword and the way pagedllm does it, unless off."""
    with pytest.raises(ValueError) as info:
        LLM(download_dir="/models")
    assert str(info.value).startswith(
        "--download-dir /models (download_dir='/models') is not supported")
    assert "set HF_HUB_CACHE=DIR" in str(info.value)


def test_swap_space_is_refused_with_pipeline_stages_and_below_zero():
    from pagedllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="--swap-space 1.0 does not work with pipeline stages"):
        EngineArgs(device="cpu", swap_space=1.0,
                   pipeline_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match="swap_space must be >= 0"):
        EngineArgs(device="cpu", swap_space=-1.0).create_engine_config()


def test_trust_remote_code_is_accepted_and_changes_nothing(tiny_model_dir):
    """vLLM's permission to run a repository's own code: pagedllm runs none, so the same
    model gives the same tokens with it."""
    prompt = {"prompt_token_ids": [1, 2, 3]}
    params = SamplingParams(max_tokens=6, temperature=0.0)
    outputs = [LLM(str(tiny_model_dir), device="cpu", trust_remote_code=trust).generate(
        prompt, params, use_tqdm=False)[0].outputs[0].token_ids for trust in (False, True)]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6


def test_hf_overrides_change_the_config_before_anything_reads_it(tiny_model_dir):
    """vLLM's --hf-overrides: a field replaced (the context bound the engine derives from
    it), an object merged key by key, null removing a field, and through it a block-wise
    FP8 quantization_config that random weights take (how a benchmark runs a layout no
    local checkpoint has)."""
    from pagedllm.config import merge_overrides
    from pagedllm.engine.arg_utils import EngineArgs

    assert merge_overrides({"a": 1, "rope": {"type": "x", "factor": 2}, "b": 3},
                           {"rope": {"factor": 8}, "b": None, "c": [1]}) == {
        "a": 1, "rope": {"type": "x", "factor": 8}, "c": [1]}
    config = EngineArgs(model=str(tiny_model_dir), device="cpu",
                        hf_overrides='{"max_position_embeddings": 64}').create_engine_config()
    assert config.model_config.max_model_len == 64
    llm = LLM(str(tiny_model_dir), device="cpu", load_format="dummy", hf_overrides={
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 32]}})
    qkv = llm.llm_engine.engine_core.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.fp8_block == (16, 32) and qkv.weight.dtype == torch.float8_e4m3fn
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 16
    with pytest.raises(ValueError, match="--hf-overrides is not valid JSON"):
        EngineArgs(model=str(tiny_model_dir), hf_overrides="{max: 1}").create_engine_config()
    with pytest.raises(ValueError, match="must be a JSON object"):
        EngineArgs(model=str(tiny_model_dir), hf_overrides="[1]").create_engine_config()


def test_generation_config_gives_the_sampling_defaults(tiny_model_dir, tmp_path):
    """vLLM's --generation-config: the sampling fields of the model's generation_config.json
    are what ``generate`` samples with when given no SamplingParams (HF's other fields and
    ``do_sample`` aside); 'none' turns them off; a folder's file, and overrides, replace them;
    what they cannot be is refused, naming the flag."""
    import json
    import shutil

    from pagedllm import SamplingParams
    from pagedllm.engine.arg_utils import EngineArgs

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(
        {**generation, "do_sample": True, "temperature": 0.9, "top_k": 1, "max_new_tokens": 5}))
    llm = LLM(str(model), device="cpu")
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.9, 1, 5)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    sampled = llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert sampled == greedy  # top_k 1 is greedy, whatever the temperature

    def defaults_of(**kw):
        return EngineArgs(model=str(model), **kw).create_engine_config().model_config.sampling_defaults

    assert defaults_of(generation_config="none") == {}
    folder = tmp_path / "generation"
    folder.mkdir()
    (folder / "generation_config.json").write_text('{"top_p": 0.5, "top_k": 3}')
    assert defaults_of(generation_config=str(folder),
                       override_generation_config='{"top_k": 7, "min_p": 0.1}') == {
        "top_p": 0.5, "top_k": 7, "min_p": 0.1}
    with pytest.raises(ValueError, match="--generation-config .*: no generation_config.json"):
        defaults_of(generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="do_sample is not a sampling default"):
        defaults_of(override_generation_config={"do_sample": False})
    with pytest.raises(ValueError, match="temperature must be non-negative"):
        defaults_of(override_generation_config={"temperature": -1})
