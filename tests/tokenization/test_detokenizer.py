"""Incremental detokenization: streamed text equals a one-shot decode, never shows half a
character, and stop strings cut the text exactly."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers

from pagedllm.engine.detokenizer import IncrementalDetokenizer

PROMPT = "Tell me a story about a robot."
TEXT = "Once upon a time, 你好世界 🎉🚀👍🏽 a robot said: naïve café! The end."


def stream(detok: IncrementalDetokenizer, token_ids: list[int], chunk_sizes=None) -> list[str]:
    """Feed tokens in chunks, collecting the deltas a streaming client would receive."""
    deltas, i, sizes = [], 0, iter(chunk_sizes or [])
    while i < len(token_ids):
        n = next(sizes, 1)
        if detok.update(token_ids[i:i + n]) is not None:
            break
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
        i += n
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_equals_full_decode_for_random_token_sequences(tokenizer, skip_special_tokens):
    rng = random.Random(1234)
    prompt_ids = tokenizer.encode(PROMPT)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 30))]
        chunks = [rng.choice([1, 1, 1, 2, 3]) for _ in ids]
        detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        text = "".join(stream(detok, ids, chunks))
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert text == expected, ids
        assert detok.output_text == expected
        assert detok.get_next_output_text(finished=True, delta=False) == expected


def test_characters_split_across_tokens_are_never_emitted_broken(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT))
    deltas = stream(detok, ids)
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    # The test is only meaningful if some character really is split across tokens.
    assert any(d == "" for d in deltas[:-1])


def test_long_sequences_stay_exact(tokenizer):
    text = (TEXT + " ") * 60
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT))
    assert "".join(stream(detok, ids, [random.Random(0).randint(1, 4) for _ in ids])) == text


def test_first_token_keeps_its_leading_space_after_the_prompt():
    # SentencePiece-style: a decode strips the leading space of its first word, but the
    # first output word after a prompt must keep it, as in decode(prompt + output).
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁again": 4}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    raw.decoder = decoders.Metaspace(prepend_scheme="first")
    assert raw.decode([2]) == "world"
    detok = IncrementalDetokenizer(raw, prompt_token_ids=[1])
    assert "".join(stream(detok, [2, 3, 4])) == " world! again"
    assert raw.decode([1, 2, 3, 4]) == "Hello" + " world! again"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_cuts_text(tokenizer, include):
    text = "The answer is 42. Done."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "is 42"
    # The stop string must not sit inside one token, or the test checks nothing.
    assert all(stop not in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT), stop=[stop],
                                   include_stop_str_in_output=include)
    hits = [detok.update([i]) for i in ids]
    assert hits.count(stop) == 1 and hits[-1] is None  # later tokens are ignored
    expected = "The answer is 42" if include else "The answer "
    assert detok.output_text == expected
    assert detok.stop_reason == stop
    assert detok.get_next_output_text(finished=True, delta=False) == expected


def test_streaming_never_sends_a_partial_stop_string(tokenizer):
    text = "go go STOP now STOP! tail"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["STOP!"])
    sent = ""
    for i in ids:
        hit = detok.update([i])
        sent += detok.get_next_output_text(finished=False, delta=True)
        # Whatever was sent is part of the final text: nothing sent is taken back.
        assert "go go STOP now ".startswith(sent)
        if hit:
            break
    sent += detok.get_next_output_text(finished=True, delta=True)
    assert sent == detok.output_text == "go go STOP now "


def test_held_back_text_is_sent_when_the_sequence_ends(tokenizer):
    ids = tokenizer.encode("almost ST", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["STOP!"])
    assert detok.update(ids) is None
    running = detok.get_next_output_text(finished=False, delta=True)
    assert running == "almost ST"[: -len("STOP")]  # the last len(stop) - 1 chars wait
    assert detok.get_next_output_text(finished=False, delta=False) == running
    assert running + detok.get_next_output_text(finished=True, delta=True) == "almost ST"


def test_earliest_stop_string_wins(tokenizer):
    ids = tokenizer.encode("alpha beta gamma", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["gamma", "beta"])
    assert detok.update(ids) == "beta"
    assert detok.output_text == "alpha "


def test_stop_token_text_is_left_out_unless_asked(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("fin", add_special_tokens=False) + [eos]
    for include, expected in ((False, "fin"), (True, "fin</s>")):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False,
                                       include_stop_str_in_output=include)
        detok.update(ids, stop_terminated=True)
        assert detok.get_next_output_text(finished=True, delta=False) == expected
