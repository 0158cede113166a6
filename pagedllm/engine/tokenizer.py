"""The tokenizer: a Hugging Face checkpoint's tokenizer.json, its special tokens and chat template.

Built on ``tokenizers`` (the Rust tokenizer HF's fast tokenizers wrap) and ``jinja2`` alone,
so the engine does not import transformers. What it reproduces from transformers, and how:

- ``encode`` / ``decode`` give the ids and text ``AutoTokenizer`` gives for a checkpoint that
  ships a tokenizer.json: the tokenizer.json post-processor decides which special tokens
  ``add_special_tokens=True`` adds (it already adds BOS where the model wants one, so BOS is
  never added twice). Only when tokenizer.json has no post-processor does ``add_bos_token``
  / ``add_eos_token`` from tokenizer_config.json add them.
- Special tokens named in tokenizer_config.json (``bos_token``, ``eos_token``, ...; a string or
  a ``{"content": ...}`` dict) and ``added_tokens_decoder`` entries that tokenizer.json lacks
  are added, as transformers adds them.
- Chat templates render with the environment transformers uses (a sandboxed Jinja
  environment with ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a ``tojson`` that
  does not escape HTML, ``raise_exception``, ``strftime_now``), so a prompt is byte for byte
  the one the model was trained on. Templates come from ``chat_template.jinja`` (plus named
  ones in ``additional_chat_templates/``), else tokenizer_config.json's ``chat_template`` (a
  string or a list of ``{"name", "template"}``), else a legacy ``chat_template.json``.

A prompt rendered from a chat template already holds its special tokens: encode it with
``add_special_tokens=False``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import fields, is_dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"

# The named special tokens transformers knows (its SPECIAL_TOKENS_ATTRIBUTES), in its order.
NAMED_SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)
_TOKENIZER_FILES = [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, GENERATION_CONFIG_FILE,
                    CHAT_TEMPLATE_FILE, f"{CHAT_TEMPLATE_DIR}/*.jinja", LEGACY_CHAT_TEMPLATE_FILE]
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"A special token must be a string or a dict with 'content', got {value!r}.")


def _added_token(value: Any, special: bool) -> tokenizers.AddedToken:
    if isinstance(value, str):
        return tokenizers.AddedToken(value, special=special, normalized=not special)
    return tokenizers.AddedToken(
        value["content"],
        single_word=value.get("single_word", False),
        lstrip=value.get("lstrip", False),
        rstrip=value.get("rstrip", False),
        normalized=value.get("normalized", not value.get("special", special)),
        special=value.get("special", special),
    )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


class Tokenizer:
    """A checkpoint's tokenizer: ids <-> text, special token ids, and chat templates.

    ``vocab_size`` counts added tokens (it is ``len(tokenizer)``); a model's embedding may
    be wider. ``eos_token_ids`` is every id that ends generation: the tokenizer's EOS plus
    generation_config.json's ``eos_token_id`` (an int or a list).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: dict | None = None,
        generation_config: dict | None = None,
        chat_template: str | dict[str, str] | None = None,
        name_or_path: str = "",
    ) -> None:
        config = dict(config or {})
        generation_config = generation_config or {}
        self.name_or_path = name_or_path
        self._backend = backend
        # Encoding never truncates or pads, whatever tokenizer.json says.
        backend.no_truncation()
        backend.no_padding()

        for _, entry in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0])):
            if backend.token_to_id(entry["content"]) is None:
                if entry.get("special", False):
                    backend.add_special_tokens([_added_token(entry, special=True)])
                else:
                    backend.add_tokens([_added_token(entry, special=False)])

        self.special_tokens_map: dict[str, str] = {}
        for name in NAMED_SPECIAL_TOKENS:
            content = _token_content(config.get(name))
            if content is not None:
                self.special_tokens_map[name] = content
        # Model-specific named tokens (``image_token``...) are template variables too.
        for name, value in config.items():
            if name.endswith("_token") and name not in self.special_tokens_map:
                if isinstance(value, str) or (isinstance(value, Mapping) and "content" in value):
                    self.special_tokens_map[name] = _token_content(value)
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra, Mapping):  # {name: token} form
            for name, value in extra.items():
                self.special_tokens_map.setdefault(name, _token_content(value))
            extra = list(extra.values())
        self.extra_special_tokens: list[str] = [_token_content(t) for t in extra]
        for token in [*self.special_tokens_map.values(), *self.extra_special_tokens]:
            if backend.token_to_id(token) is None:
                backend.add_special_tokens([tokenizers.AddedToken(token, special=True, normalized=False)])

        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.add_eos_token = bool(config.get("add_eos_token", False))
        self._template_special = backend.post_processor is None and (self.add_bos_token or self.add_eos_token)
        self.clean_up_tokenization_spaces = (
            bool(config.get("clean_up_tokenization_spaces", False))
            and type(backend.model).__name__ != "BPE"  # transformers skips it for BPE
        )

        self.bos_token: str | None = self.special_tokens_map.get("bos_token")
        self.eos_token: str | None = self.special_tokens_map.get("eos_token")
        self.pad_token: str | None = self.special_tokens_map.get("pad_token")
        self.unk_token: str | None = self.special_tokens_map.get("unk_token")
        self.bos_token_id = self._id_or_none(self.bos_token)
        self.pad_token_id = self._id_or_none(self.pad_token)
        gen_eos = generation_config.get("eos_token_id")
        gen_eos_ids = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
        tok_eos = self._id_or_none(self.eos_token)
        self.eos_token_id: int | None = tok_eos if tok_eos is not None else (
            gen_eos_ids[0] if gen_eos_ids else None)
        self.eos_token_ids: frozenset[int] = frozenset(
            gen_eos_ids + ([tok_eos] if tok_eos is not None else []))

        if isinstance(chat_template, list):
            chat_template = {t["name"]: t["template"] for t in chat_template}
        self.chat_template: str | dict[str, str] | None = chat_template

    # -- loading --------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, revision: str | None = None) -> "Tokenizer":
        """Load from a directory holding tokenizer.json (or from a Hugging Face hub id)."""
        directory = Path(path).expanduser()
        if not directory.is_dir():
            directory = _download(str(path), revision)
        tokenizer_file = directory / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise ValueError(
                f"{directory} has no {TOKENIZER_FILE}: pagedllm needs a fast-tokenizer checkpoint "
                "(convert a slow one with transformers' `AutoTokenizer.from_pretrained(...)."
                "save_pretrained(...)`) or pass another directory with --tokenizer."
            )
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(directory / TOKENIZER_CONFIG_FILE)
        generation_config = _read_json(directory / GENERATION_CONFIG_FILE)
        return cls(backend, config, generation_config, _load_chat_template(directory, config),
                   name_or_path=str(path))

    # -- vocabulary -----------------------------------------------------------------------
    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (for incremental decoding)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def all_special_tokens(self) -> list[str]:
        """Named special tokens, then the extra ones, without repeats (transformers' order)."""
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in (self._backend.token_to_id(t) for t in self.all_special_tokens) if i is not None]

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._backend.token_to_id(tokens)
        return [self._backend.token_to_id(t) for t in tokens]

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    # -- text <-> ids ---------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while the Rust tokenizer works and encode does not:
        # a long prompt tokenized on a worker thread then leaves the server's loop running.
        ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._template_special:
            if self.add_bos_token and self.bos_token_id is not None:
                ids = [self.bos_token_id, *ids]
            if self.add_eos_token and self.eos_token_id is not None:
                ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    # -- chat -----------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template to render: a name among the model's templates, a literal, or the default."""
        if isinstance(self.chat_template, dict):
            if chat_template is not None:
                return self.chat_template.get(chat_template, chat_template)
            if tools is not None and "tool_use" in self.chat_template:
                return self.chat_template["tool_use"]
            if "default" in self.chat_template:
                return self.chat_template["default"]
            raise ValueError(
                "This model has several chat templates and none is named 'default': pass "
                f"chat_template= one of {sorted(self.chat_template)} or a Jinja template."
            )
        if chat_template is not None:
            return chat_template
        if self.chat_template is None:
            raise ValueError(
                f"The tokenizer of {self.name_or_path or 'this model'} has no chat template: "
                "pass one with --chat-template (a Jinja file or string), or use the completions "
                "API with a plain prompt."
            )
        return self.chat_template

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        continue_final_message: bool | str = False,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` (role/content dicts) to the prompt text, exactly as transformers does.

        The template sees the messages as given (a ``None`` value included; the OpenAI
        conventions of ``chat_messages`` are the server's and ``LLM.chat``'s). ``kwargs``
        become template variables (``enable_thinking``...) and override the special tokens
        (``bos_token``, ``eos_token``...) of the same name. ``continue_final_message`` leaves
        the last message's ``content`` open for the model to continue, or the field it names
        (``"reasoning_content"``).
        """
        if not messages:
            raise ValueError("messages is empty: a chat needs at least one message.")
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true: continue "
                "the last message, or start a new assistant turn."
            )
        template = self.get_chat_template(chat_template, tools)
        if tools is not None and any(not isinstance(t, Mapping) for t in tools):
            raise ValueError("tools must be a list of JSON-schema dicts.")
        chat = [_plain_message(m) for m in messages]

        final_text = None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final_text = _tag_final_message(chat, template, field)

        variables = {**self.special_tokens_map, **_plain(kwargs)}
        try:
            rendered = _compile(template).render(
                messages=chat, tools=_plain(tools), documents=_plain(documents),
                add_generation_prompt=add_generation_prompt, **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            # raise_exception() in a template reports a malformed chat ("roles must alternate").
            raise ValueError(f"The chat template rejected these messages: {exc}") from exc
        if final_text is not None:
            rendered = _cut_at_continue_tag(rendered, final_text)
        return rendered

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size})"


def _download(name: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=_TOKENIZER_FILES))
    except Exception as exc:  # offline, missing repo, no cache...
        raise ValueError(
            f"Tokenizer {name!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub ({type(exc).__name__}: {exc}): pass a directory holding "
            f"{TOKENIZER_FILE} with --tokenizer."
        ) from exc


def _load_chat_template(directory: Path, config: dict) -> str | dict[str, str] | None:
    templates: dict[str, str] = {}
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (directory / CHAT_TEMPLATE_DIR).is_dir():
        for file in sorted((directory / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    if template is None:
        template = _read_json(directory / LEGACY_CHAT_TEMPLATE_FILE).get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return template


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (WordPiece-era space fixes)."""
    return (
        text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
        .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s")
        .replace(" 've", "'ve").replace(" 're", "'re")
    )


# -- chat template rendering -------------------------------------------------------------
def _plain(value: Any) -> Any:
    """Plain JSON-like data for the sandbox: dataclasses and pydantic models become dicts."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _plain_message(message: Any) -> dict:
    message = _plain(message)
    if not isinstance(message, dict):
        raise ValueError(f"Each chat message must be a dict with 'role' and 'content', got {message!r}.")
    return message


def _tag_final_message(chat: list[dict], template: str, field: str) -> str:
    """Mark the end of the last message's ``field`` so rendering can be cut there; returns
    its text."""
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f"continue_final_message is set but the last message has no {field!r}.")
    if field not in template:
        raise ValueError(f"continue_final_message is set to {field!r} but the chat template "
                         "never reads it.")
    if isinstance(final, (list, tuple)):
        for part in reversed(final):
            if isinstance(part, dict) and "text" in part:
                text = part["text"]
                part["text"] = text + _CONTINUE_TAG
                return text
        raise ValueError("continue_final_message is set but the last message has no text part.")
    chat[-1][field] = final + _CONTINUE_TAG
    return final


def _cut_at_continue_tag(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ValueError(
            "continue_final_message is set but the chat template does not render the last "
            "message's text: it cannot be continued with this template."
        )
    at = rendered.rindex(tag)
    if rendered[at: at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers marks
    assistant spans with it for training masks; inference only needs the text)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


class _TemplateDict:
    """``dict(...)`` for templates, without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names (no reaching into object internals)."""

    def __init__(*args, **kwargs):  # same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot set underscore attributes on a namespace, got {name!r}."
            )


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"The chat template is not valid Jinja (line {exc.lineno}): {exc.message}") from exc
