"""Reasoning parsers: whole outputs, streamed outputs cut every way, the documented qwen3 choice."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.reasoning import (
    REASONING_PARSERS, DeepSeekR1ReasoningParser, MistralReasoningParser, Qwen3ReasoningParser,
    ReasoningParser, get_reasoning_parser,
)
from tests.tool_parsers import chunkings

THOUGHT = "The user asks for 2 + 2.\nThat is 4; \"simple\" — no <tools> needed. 🤔"
ANSWER = "2 + 2 = **4**.\n"


def streamed(parser: ReasoningParser, chunks: list[str]) -> tuple[str, str]:
    stream = parser.stream()
    reasoning = content = ""
    for delta in filter(None, [stream.feed(chunk) for chunk in chunks] + [stream.finish()]):
        assert delta.reasoning_content or delta.content, "an empty delta is returned as None"
        assert not delta.tool_calls
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
    return reasoning, content


def assert_streams_like_extract(parser: ReasoningParser, text: str) -> None:
    reasoning, content = parser.extract(text)
    for chunks in chunkings(text):
        assert streamed(parser, chunks) == (reasoning or "", content or ""), chunks


DEEPSEEK_CASES = [
    (f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}", THOUGHT, ANSWER),
    (f"{THOUGHT}\n</think>\n\n{ANSWER}", THOUGHT, ANSWER),  # <think> was in the prompt
    (f"\n<think>{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
    (f"<think>\n{THOUGHT}", THOUGHT, None),  # stopped while thinking
    (THOUGHT, THOUGHT, None),
    (f"<think>\n\n</think>\n\n{ANSWER}", None, ANSWER),
    (f"{THOUGHT}</think>", THOUGHT, None),
    (f"{THOUGHT} </thin", f"{THOUGHT} </thin", None),
    ("<thi", "<thi", None),
    ("", None, None),
]

QWEN3_CASES = [
    (f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}", THOUGHT, ANSWER),
    (f"\n\n<think>{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
    (f"<think>\n\n</think>\n\n{ANSWER}", None, ANSWER),
    (ANSWER, None, ANSWER),  # thinking off
    (f"\n{ANSWER}", None, f"\n{ANSWER}"),
    ("<thi", None, "<thi"),
    ("<b>bold</b>", None, "<b>bold</b>"),
    ("", None, None),
]

MISTRAL_CASES = [
    (f"[THINK]{THOUGHT}[/THINK]{ANSWER}", THOUGHT, ANSWER),
    (f"\n[THINK]\n{THOUGHT}\n[/THINK]\n\n{ANSWER}", THOUGHT, ANSWER),
    (f"[THINK]{THOUGHT}", THOUGHT, None),  # stopped while thinking
    (ANSWER, None, ANSWER),  # no thinking
    (f"{THOUGHT}[/THINK]{ANSWER}", None, f"{THOUGHT}[/THINK]{ANSWER}"),
    ("[THI", None, "[THI"),
    ("[TOOL_CALLS]get_time[ARGS]{}", None, "[TOOL_CALLS]get_time[ARGS]{}"),
    ("", None, None),
]

CASES = [(DeepSeekR1ReasoningParser, case) for case in DEEPSEEK_CASES] + [
    (Qwen3ReasoningParser, case) for case in QWEN3_CASES] + [
    (MistralReasoningParser, case) for case in MISTRAL_CASES]
CASE_IDS = [f"{cls.name}-{i}" for i, (cls, _) in enumerate(CASES)]


@pytest.mark.parametrize(("parser_cls", "case"), CASES, ids=CASE_IDS)
def test_extract_splits_reasoning_from_content(parser_cls, case):
    text, reasoning, content = case
    assert parser_cls().extract(text) == (reasoning, content)


@pytest.mark.parametrize(("parser_cls", "case"), CASES, ids=CASE_IDS)
def test_stream_cut_anywhere_adds_up_to_extract(parser_cls, case):
    assert_streams_like_extract(parser_cls(), case[0])


def test_end_token_prefix_is_held_back_until_decided():
    stream = DeepSeekR1ReasoningParser().stream()
    assert stream.feed("Four.</thi").reasoning_content == "Four."
    assert stream.feed("nk>\n") is None
    delta = stream.feed("4")
    assert (delta.reasoning_content, delta.content) == (None, "4")
    assert stream.finish() is None


def test_qwen3_stream_decides_on_the_first_characters():
    """Documented choice: an output opening with <think> streams as reasoning even if it
    never closes; one that does not streams as content even if </think> comes later."""
    parser = Qwen3ReasoningParser()
    unclosed = f"<think>\n{THOUGHT}"
    assert parser.extract(unclosed) == (None, unclosed)
    assert streamed(parser, list(unclosed)) == (THOUGHT, "")
    unopened = f"{THOUGHT}\n</think>\n\n{ANSWER}"
    assert parser.extract(unopened) == (THOUGHT, ANSWER)
    assert streamed(parser, list(unopened)) == ("", unopened)


def test_qwen3_holds_only_a_possible_think_tag():
    stream = Qwen3ReasoningParser().stream()
    assert stream.feed("\n<th") is None
    assert stream.feed("ink>Hm").reasoning_content == "Hm"
    stream = Qwen3ReasoningParser().stream()
    assert stream.feed("\n<b").content == "\n<b"


def test_registry_names_the_parsers():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "mistral", "qwen3"}
    for name, cls in REASONING_PARSERS.items():
        assert get_reasoning_parser(name) is cls and cls.name == name
        markers = ("[THINK]", "[/THINK]") if name == "mistral" else ("<think>", "</think>")
        assert (cls.start_token, cls.end_token) == markers
        assert cls.keeps_special_tokens == (name == "mistral")


def test_unknown_parser_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"'r1'.*deepseek_r1, mistral, qwen3"):
        get_reasoning_parser("r1")
