"""Chat templates render byte for byte as transformers renders them."""

from __future__ import annotations

import json
import shutil
from datetime import datetime

import pytest

from pagedllm.engine.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3? 你好 🎉"},
    ],
    [
        {"role": "user", "content": [{"type": "text", "text": "part one, "},
                                     {"type": "image_url", "image_url": {"url": "x"}},
                                     {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": "Seen.", "tool_calls": None},
    ],
]


def hf_render(hf_tokenizer, messages, **kwargs) -> str:
    return hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_rendering_matches_transformers(tokenizer, hf_tokenizer, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf_render(hf_tokenizer, messages, add_generation_prompt=add_generation_prompt)
    assert ours.endswith("<|assistant|>\n") == add_generation_prompt


def test_rendered_prompt_tokenizes_like_transformers_chat(tokenizer, hf_tokenizer):
    messages = CONVERSATIONS[1]
    text = tokenizer.apply_chat_template(messages)
    expected = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenizer.encode(text, add_special_tokens=False) == expected
    assert tokenizer.encode(text, add_special_tokens=False).count(tokenizer.bos_token_id) == 1


def test_tools_render_as_plain_json_like_transformers(tokenizer, hf_tokenizer):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in <city> & région",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = CONVERSATIONS[0]
    ours = tokenizer.apply_chat_template(messages, tools=tools)
    assert ours == hf_render(hf_tokenizer, messages, tools=tools, add_generation_prompt=True)
    assert "Weather in <city> & région" in ours  # no HTML escaping, no \\u escapes
    assert '\n  {\n    "type": "function"' in ours  # tojson(indent=2)


def test_extra_kwargs_and_special_tokens_are_template_variables(tokenizer, hf_tokenizer):
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking %}<think>{% endif %}{{ eos_token }}|{{ pad_token }}"
    )
    messages = CONVERSATIONS[0]
    for thinking in (True, False):
        ours = tokenizer.apply_chat_template(messages, chat_template=template, enable_thinking=thinking)
        assert ours == hf_render(hf_tokenizer, messages, chat_template=template, enable_thinking=thinking,
                                 add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages, chat_template=template, eos_token="END").endswith("END|<pad>")


def test_template_features_match_transformers(tokenizer, hf_tokenizer):
    # loopcontrols, namespace, trim_blocks/lstrip_blocks whitespace handling, dict(), {% generation %}.
    template = (
        "{% set ns = namespace(count=0) %}\n"
        "{% for m in messages %}\n"
        "    {% if m['role'] == 'system' %}{% continue %}{% endif %}\n"
        "    {% set ns.count = ns.count + 1 %}\n"
        "    {% generation %}[{{ m['role'] }}] {{ m['content'] }}{% endgeneration %}\n"
        "    {% if ns.count >= 2 %}{% break %}{% endif %}\n"
        "{% endfor %}\n"
        "{{ dict(a=1) | tojson }} {{ messages | length }} {{ 'x' | upper }}\n"
    )
    messages = CONVERSATIONS[1]
    ours = tokenizer.apply_chat_template(messages, chat_template=template)
    assert ours == hf_render(hf_tokenizer, messages, chat_template=template, add_generation_prompt=True)


def test_strftime_now_is_available(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATIONS[0], chat_template="{{ strftime_now('%Y') }}")
    assert text == str(datetime.now().year)


def test_continue_final_message_matches_transformers(tokenizer, hf_tokenizer):
    messages = CONVERSATIONS[1][:3] + [{"role": "assistant", "content": "The answer is"}]
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == hf_render(hf_tokenizer, messages, continue_final_message=True)
    assert ours.endswith("<|assistant|>\nThe answer is")
    with pytest.raises(ValueError, match="continue_final_message"):
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)


def test_missing_template_tells_user_to_pass_chat_template(tiny_tokenizer_dir, tmp_path):
    directory = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(directory)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="--chat-template"):
        tok.apply_chat_template(CONVERSATIONS[0])
    # A template passed by the caller works without one in the checkpoint.
    assert tok.apply_chat_template(CONVERSATIONS[0], chat_template="{{ messages[0]['content'] }}") == "Hi there!"


def test_template_exception_is_a_value_error_with_its_message(tokenizer):
    with pytest.raises(ValueError, match="Unknown role: robot"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_chat_template_jinja_file_overrides_config(tiny_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    directory = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, directory)
    (directory / "chat_template.jinja").write_text("FILE:{% for m in messages %}{{ m['content'] }}{% endfor %}")
    ours = Tokenizer.from_pretrained(directory).apply_chat_template(CONVERSATIONS[0])
    assert ours == "FILE:Hi there!"
    hf = AutoTokenizer.from_pretrained(directory)
    assert ours == hf_render(hf, CONVERSATIONS[0], add_generation_prompt=True)


def test_named_templates_pick_default_tool_use_or_by_name(tiny_tokenizer_dir, tmp_path):
    directory = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D:{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "T:{{ tools[0]['name'] }}"},
        {"name": "rag", "template": "R"},
    ]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(directory)
    assert tok.apply_chat_template(CONVERSATIONS[0]) == "D:Hi there!"
    assert tok.apply_chat_template(CONVERSATIONS[0], tools=[{"name": "f"}]) == "T:f"
    assert tok.apply_chat_template(CONVERSATIONS[0], chat_template="rag") == "R"
    assert tok.apply_chat_template(CONVERSATIONS[0], chat_template="literal {{ 1 + 1 }}") == "literal 2"


def test_invalid_template_syntax_is_a_value_error(tokenizer):
    with pytest.raises(ValueError, match="not valid Jinja"):
        tokenizer.apply_chat_template(CONVERSATIONS[0], chat_template="{% for %}")


def test_empty_conversation_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="messages"):
        tokenizer.apply_chat_template([])


NONE_AWARE_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:"
    "{% if m['content'] is none %}<none>{% else %}{{ m['content'] }}{% endif %}"
    "{% if m.reasoning_content is defined %}[r:{{ m.reasoning_content }}]{% endif %}"
    "{% if m.thinking is defined %}[t:{{ m.thinking }}]{% endif %}|{% endfor %}"
)


def test_messages_reach_the_template_as_given_like_transformers(tokenizer, hf_tokenizer):
    """A null ``content`` stays null and reasoning stays under the name it was given."""
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": None, "reasoning": "hmm"}]
    ours = tokenizer.apply_chat_template(messages, chat_template=NONE_AWARE_TEMPLATE)
    assert ours == hf_render(hf_tokenizer, messages, chat_template=NONE_AWARE_TEMPLATE,
                             add_generation_prompt=True)
    assert ours == "user:Hi|assistant:<none>|"


def test_continue_final_message_may_name_the_field_to_continue(tokenizer, hf_tokenizer):
    template = ("{% for m in messages %}{{ m.role }}:{% if m.reasoning_content %}<think>"
                "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}|{% endfor %}")
    messages = [{"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "reasoning_content": "Let me add", "content": ""}]
    ours = tokenizer.apply_chat_template(messages, chat_template=template,
                                         add_generation_prompt=False,
                                         continue_final_message="reasoning_content")
    assert ours == hf_render(hf_tokenizer, messages, chat_template=template,
                             continue_final_message="reasoning_content")
    assert ours == "user:2 + 2?|assistant:<think>Let me add"
    with pytest.raises(ValueError, match="'thinking'"):
        tokenizer.apply_chat_template(messages, chat_template=template,
                                      add_generation_prompt=False, continue_final_message="thinking")
