"""The tokenizer wrapper gives the ids, text and special tokens transformers gives."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from pagedllm.engine.tokenizer import Tokenizer
from tests.tokenizer_utils import BOS_TOKEN, CHAT_TOKENS, EOS_TOKEN, SPECIAL_TOKENS

TEXTS = [
    "Hello world!",
    "  leading and trailing spaces  ",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n",
    "你好，世界！ Emoji 🎉🚀👍🏽 and accents: naïve café",
    "text with special tokens <|user|>inside</s> and <s> too",
    "unseen words: zyzzyva quixotic ǅ ΩμέγΑ",
    "",
    "\n\n\t tabs and newlines \r\n",
]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tokenizer, hf_tokenizer, add_special_tokens):
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == hf_tokenizer.encode(
            text, add_special_tokens=add_special_tokens
        ), text


def test_encode_adds_bos_exactly_once(tokenizer):
    ids = tokenizer.encode("Hello world!")
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.encode("Hello world!", add_special_tokens=False) == ids[1:]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tokenizer, hf_tokenizer, skip_special_tokens):
    rng = random.Random(0)
    sequences = [tokenizer.encode(t) for t in TEXTS]
    # Arbitrary id sequences too: byte tokens that split characters, specials anywhere.
    sequences += [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(50)]
    for ids in sequences:
        assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens
        ), ids


def test_round_trip_of_plain_text_is_exact(tokenizer):
    for text in TEXTS:
        if "<" in text:
            continue
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens_match_transformers(tokenizer, hf_tokenizer):
    assert tokenizer.vocab_size == len(hf_tokenizer) == len(tokenizer)
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id == SPECIAL_TOKENS.index(BOS_TOKEN)
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id == SPECIAL_TOKENS.index(EOS_TOKEN)
    assert tokenizer.pad_token_id == hf_tokenizer.pad_token_id
    assert tokenizer.all_special_ids == hf_tokenizer.all_special_ids
    assert tokenizer.all_special_tokens == hf_tokenizer.all_special_tokens
    ids = list(range(0, tokenizer.vocab_size, 7))
    assert tokenizer.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)
    assert tokenizer.convert_ids_to_tokens(3) == CHAT_TOKENS[0]
    assert tokenizer.convert_tokens_to_ids(CHAT_TOKENS) == hf_tokenizer.convert_tokens_to_ids(CHAT_TOKENS)


def test_eos_token_ids_include_generation_config(tiny_tokenizer_dir, tmp_path):
    directory = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, directory)
    end_id = SPECIAL_TOKENS.index("<|end|>")
    eos_id = SPECIAL_TOKENS.index(EOS_TOKEN)

    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [end_id, eos_id]}))
    assert Tokenizer.from_pretrained(directory).eos_token_ids == frozenset({end_id, eos_id})

    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": end_id}))
    tok = Tokenizer.from_pretrained(directory)
    assert tok.eos_token_ids == frozenset({end_id, eos_id})
    assert tok.eos_token_id == eos_id  # the tokenizer's own EOS, as transformers reports it

    (directory / "generation_config.json").unlink()
    assert Tokenizer.from_pretrained(directory).eos_token_ids == frozenset({eos_id})


def test_added_tokens_from_config_are_added_like_transformers(tiny_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    directory = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    new_id = str(len(Tokenizer.from_pretrained(directory)))
    config["added_tokens_decoder"][new_id] = {
        "content": "<|tool|>", "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False, "special": True,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))

    ours, hf = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    text = "call <|tool|> now"
    assert ours.vocab_size == len(hf) == int(new_id) + 1
    assert ours.encode(text) == hf.encode(text)
    assert int(new_id) in ours.encode(text)
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_add_bos_token_applies_when_tokenizer_json_has_no_post_processor(tiny_tokenizer_dir, tmp_path):
    directory = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, directory)
    data = json.loads((directory / "tokenizer.json").read_text())
    data["post_processor"] = None
    (directory / "tokenizer.json").write_text(json.dumps(data))
    tok = Tokenizer.from_pretrained(directory)
    ids = tok.encode("Hello")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.encode("Hello", add_special_tokens=False) == ids[1:]


def test_directory_without_tokenizer_json_says_what_to_pass(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json.*--tokenizer"):
        Tokenizer.from_pretrained(tmp_path)
