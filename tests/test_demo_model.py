"""The bundled demo models: valid Hugging Face checkpoints, trained, and served faithfully.

``pagedllm-demo`` (what ``LLM()`` loads) and ``pagedllm-demo-draft`` (its speculative-decoding
draft) ship inside the package; ``scripts/train_demo_model.py`` produced them. These tests
pin what users rely on: they load offline with the HF reference, they model unseen Python
far better than chance, their chat template renders the same everywhere, and pagedllm's
prompt logprobs equal the reference's.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.config import BUNDLED_MODELS_DIR, DEFAULT_MODEL, resolve_model_path

TARGET = "pagedllm-demo"
DRAFT = "pagedllm-demo-draft"
MIB = 1 << 20

# Code written for this test, so not in the training data (the standard library).
HELD_OUT_SNIPPET = '''import os


def count_lines(path):
    """Return the number of lines in the file at path."""
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


class Counter:
    """Count how often each key is seen."""

    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
        return self.counts[key]

    def most_common(self, n=None):
        items = sorted(self.counts.items(), key=lambda item: item[1], reverse=True)
        if n is not None:
            items = items[:n]
        return items


def find_files(root, suffix=".py"):
    """Yield the paths of the files under root whose name ends with suffix."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(filenames):
            if name.endswith(suffix):
                yield os.path.join(dirpath, name)
'''

CHATS = [
    [{"role": "user", "content": "Write a Python function `add(a, b)`. Return a + b."}],
    [
        {"role": "system", "content": "You write clear, correct Python."},
        {"role": "user", "content": "Write `is_even(n)`: Return True if n is even."},
        {"role": "assistant", "content": "```python\ndef is_even(n):\n    return n % 2 == 0\n```"},
        {"role": "user", "content": "Now `is_odd(n)`, please."},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "Write `square(x)`. "},
                                  {"type": "text", "text": "Return x squared."}]}],
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread; more only contend on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def _offline():
    """Everything here must work with no network, as on a newcomer's laptop."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


def _json(name: str, filename: str) -> dict:
    return json.loads((BUNDLED_MODELS_DIR / name / filename).read_text())


@pytest.fixture(scope="module")
def hf_models(_offline):
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(BUNDLED_MODELS_DIR / name).eval()
            for name in (TARGET, DRAFT)}


@pytest.fixture(scope="module")
def hf_tokenizer(_offline):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(BUNDLED_MODELS_DIR / TARGET)


def test_default_model_and_draft_resolve_by_name_to_the_bundled_checkpoints():
    assert DEFAULT_MODEL == TARGET
    assert resolve_model_path(None) == BUNDLED_MODELS_DIR / TARGET
    assert resolve_model_path(DRAFT) == BUNDLED_MODELS_DIR / DRAFT


@pytest.mark.parametrize("name", [TARGET, DRAFT])
def test_bundled_checkpoint_is_a_float32_llama_with_the_files_hf_expects(name):
    directory = BUNDLED_MODELS_DIR / name
    for filename in ("config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"):
        assert (directory / filename).is_file(), f"{name} lacks {filename}"
    config = _json(name, "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "float32"
    assert config["max_position_embeddings"] == 1024
    assert (directory / "model.safetensors").stat().st_size < 15 * MIB


def test_bundled_weights_stay_under_the_package_size_budget():
    total = sum((BUNDLED_MODELS_DIR / n / "model.safetensors").stat().st_size
                for n in (TARGET, DRAFT))
    assert total < 25_000_000


def test_draft_is_smaller_and_shares_the_target_tokenizer():
    for filename in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert _json(TARGET, filename) == _json(DRAFT, filename), filename
    target, draft = _json(TARGET, "config.json"), _json(DRAFT, "config.json")
    assert target["vocab_size"] == draft["vocab_size"]
    assert target["num_hidden_layers"] > draft["num_hidden_layers"]
    assert target["hidden_size"] > draft["hidden_size"]


def test_generation_config_ids_are_the_tokenizers_bos_and_end_tokens(hf_tokenizer):
    generation = _json(TARGET, "generation_config.json")
    assert generation["bos_token_id"] == hf_tokenizer.convert_tokens_to_ids("<|bos|>")
    assert generation["eos_token_id"] == hf_tokenizer.convert_tokens_to_ids("<|end|>")
    assert hf_tokenizer.eos_token == "<|end|>"
    ids = hf_tokenizer("def f(x):\n    return x").input_ids
    assert ids[0] == generation["bos_token_id"] and ids.count(generation["bos_token_id"]) == 1
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x"


@torch.no_grad()
def _mean_nll(model, ids: list[int]) -> float:
    batch = torch.tensor([ids])
    logits = model(input_ids=batch).logits[0, :-1]
    return torch.nn.functional.cross_entropy(logits, batch[0, 1:]).item()


def test_both_models_predict_unseen_python_far_better_than_a_uniform_guess(
    hf_models, hf_tokenizer
):
    ids = hf_tokenizer(HELD_OUT_SNIPPET).input_ids
    assert len(ids) > 200
    ln_vocab = math.log(_json(TARGET, "config.json")["vocab_size"])
    target = _mean_nll(hf_models[TARGET], ids)
    draft = _mean_nll(hf_models[DRAFT], ids)
    assert target < 0.4 * ln_vocab, (target, ln_vocab)
    assert draft < 0.4 * ln_vocab, (draft, ln_vocab)
    # The draft is the weaker model, but close enough to propose useful tokens.
    assert target < draft < target + 1.0, (target, draft)


def test_chat_request_gets_a_python_function_back(hf_models, hf_tokenizer):
    inputs = hf_tokenizer.apply_chat_template(
        CHATS[0], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = hf_models[TARGET].generate(**inputs, max_new_tokens=48, do_sample=False)
    reply = hf_tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert reply.startswith("```python\ndef add(a, b):"), reply


@pytest.mark.parametrize("messages", CHATS, ids=["one-turn", "multi-turn", "content-parts"])
def test_chat_template_renders_identically_in_hf_and_pagedllm(messages, hf_tokenizer):
    from pagedllm.engine.tokenizer import Tokenizer

    ours = Tokenizer.from_pretrained(BUNDLED_MODELS_DIR / TARGET)
    reference = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    rendered = ours.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == reference
    assert rendered.startswith("<|bos|>") and rendered.endswith("<|end|>\n<|assistant|>\n")
    assert ours.encode(rendered, add_special_tokens=False) == hf_tokenizer(
        rendered, add_special_tokens=False
    ).input_ids


def test_chat_template_matches_the_jinja_sandbox_rendering(hf_tokenizer):
    """The template must not depend on transformers' extras: plain jinja2 renders it too."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(_json(TARGET, "tokenizer_config.json")["chat_template"])
    for messages in CHATS:
        plain = template.render(messages=messages, add_generation_prompt=True,
                                bos_token="<|bos|>", eos_token="<|end|>")
        assert plain == hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


def _import_llm():
    """The engine's offline API; skipped (never passed) only while it cannot be imported."""
    try:
        from pagedllm import LLM, SamplingParams
    except ImportError as exc:
        pytest.skip(f"pagedllm.LLM cannot be imported: {exc}")
    return LLM, SamplingParams


def test_pagedllm_prompt_logprobs_match_hf_on_the_bundled_target(hf_models, hf_tokenizer):
    LLM, SamplingParams = _import_llm()
    text = HELD_OUT_SNIPPET[:400]
    llm = LLM(model=None)
    out = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]

    ids = hf_tokenizer(text).input_ids
    assert out.prompt_token_ids == ids
    with torch.no_grad():
        logits = hf_models[TARGET](input_ids=torch.tensor([ids])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)

    prompt_logprobs = out.prompt_logprobs
    assert len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry = prompt_logprobs[i]
        assert ids[i] in entry, f"position {i}: the prompt token is missing"
        expected = reference[i - 1, ids[i]].item()
        assert entry[ids[i]].logprob == pytest.approx(expected, abs=1e-3), f"position {i}"


def _load_training_script():
    import importlib.util

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    sys.path.insert(0, str(scripts))
    try:
        spec = importlib.util.spec_from_file_location(
            "train_demo_model", scripts / "train_demo_model.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(scripts))
    return module


def test_training_script_writes_loadable_checkpoints_and_metrics(tmp_path, hf_tokenizer):
    """A miniature run of the script that made the shipped weights, end to end on the CPU."""
    from transformers import AutoModelForCausalLM

    script = _load_training_script()
    out = tmp_path / "demo"
    results = script.main([
        "--out", str(out), "--device", "cpu", "--steps", "2", "--draft-steps", "2",
        "--batch-size", "2", "--seq-len", "64", "--max-files", "12", "--eval-tokens", "256",
        "--eval-every", "1", "--vocab-size", "512", "--sample-tokens", "4",
    ])
    for name in (TARGET, DRAFT):
        model = AutoModelForCausalLM.from_pretrained(out / name)
        assert model.config.vocab_size == 512
        metrics = results["models"][name]
        assert metrics["train_steps"] == 2 and metrics["tokens_seen"] == 2 * 2 * 64
        assert metrics["test_nll_over_ln_vocab"] == pytest.approx(
            metrics["test_nll"] / math.log(512), abs=1e-3
        )
        assert len(metrics["samples"]) == 5
        # The chat format the data was rendered with is the one that ships.
        assert json.loads((out / name / "tokenizer_config.json").read_text())["chat_template"] \
            == hf_tokenizer.chat_template
    split_of = sys.modules["demo_model_data"].split_of
    assert all(split_of(p) == "validation" for p in results["data"]["validation_files"])
    assert all(split_of(p) == "test" for p in results["data"]["test_files"])
    assert json.loads((out / "metrics.json").read_text())["models"].keys() == {TARGET, DRAFT}
