"""Training data for the bundled demo models: the running Python's standard library source.

Every machine with Python has this corpus, so the weights can be rebuilt anywhere. The
corpus is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (installed
third-party packages in ``site-packages``/``dist-packages`` excluded), in sorted order of
their paths relative to that root. Files that are not valid UTF-8 are skipped.

Split rule (deterministic, independent of the Python version): a file is held out when the
first byte of ``sha256(relative_posix_path)`` is below ``HELD_OUT_BYTE_LIMIT`` (about 2.3%
of the files). Held-out files go to the "validation" half (used only to pick the best
checkpoint) when the second byte is even, and to the "test" half (the reported numbers)
when it is odd. No held-out file contributes to the tokenizer, the chat samples or training.

Chat samples turn documented functions into instruction/answer pairs: the user asks for a
function by signature and the first paragraph of its docstring, the assistant answers with
the function's source in a fenced code block. They are rendered with the same chat
template that ships in ``tokenizer_config.json``, so training sees the exact serving format.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import random
import re
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

import jinja2.sandbox

HELD_OUT_BYTE_LIMIT = 6  # out of 256

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|end|>"  # ends a document and every chat turn
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN]  # ids 0..4

# One turn is "<|role|>\n{content}<|end|>\n"; the conversation starts with <|bos|>.
# Roles other than system and assistant (user, tool, ...) are rendered as user turns.
# Content may be a string or a list of OpenAI-style parts, whose text parts are joined.
# Every newline is a quoted literal, so trim_blocks/lstrip_blocks cannot change the output.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' }}"
    "{% else %}{{ '<|user|>\n' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_SYSTEM_PROMPTS = [
    "You are a helpful assistant that writes Python code.",
    "You are a concise Python programmer. Answer with code.",
    "You write clear, correct Python.",
]
_FUNCTION_PROMPTS = [
    "Write a Python function `{sig}`. {doc}",
    "Implement `{sig}` in Python. {doc}",
    "{doc} Write this as a Python function `{sig}`.",
    "Write `{sig}`: {doc}",
]
_METHOD_PROMPTS = [
    "Write the method `{cls}.{sig}`. {doc}",
    "Implement the `{cls}` method `{sig}` in Python. {doc}",
    "{doc} Write this as the method `{sig}` of class `{cls}`.",
]
_MAX_FUNCTION_CHARS = 1800
_MIN_DOC_CHARS, _MAX_DOC_CHARS = 12, 320


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # posix path relative to the stdlib root
    text: str


@dataclass(frozen=True)
class Corpus:
    root: str
    train: list[SourceFile]
    validation: list[SourceFile]
    test: list[SourceFile]


def split_of(relpath: str) -> str:
    """``"train"``, ``"validation"`` or ``"test"`` for a path relative to the stdlib root."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    if digest[0] >= HELD_OUT_BYTE_LIMIT:
        return "train"
    return "validation" if digest[1] % 2 == 0 else "test"


def load_stdlib_corpus(root: str | None = None, max_files: int | None = None) -> Corpus:
    """Read and split the standard library's ``*.py`` files.

    ``max_files`` keeps an evenly spread subset of the training files (held-out files are
    always kept whole), so a smoke run trains on a small sample but evaluates on the same
    held-out files as a full run.
    """
    base = Path(root or sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p for p in base.rglob("*.py")
        if p.is_file() and not {"site-packages", "dist-packages"} & set(p.relative_to(base).parts)
    )
    splits: dict[str, list[SourceFile]] = {"train": [], "validation": [], "test": []}
    for path in paths:
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not text.strip():
            continue
        relpath = path.relative_to(base).as_posix()
        splits[split_of(relpath)].append(SourceFile(relpath, text))
    if max_files is not None and len(splits["train"]) > max_files:
        stride = len(splits["train"]) / max_files
        splits["train"] = [splits["train"][int(i * stride)] for i in range(max_files)]
    if not splits["validation"] or not splits["test"]:
        raise ValueError(f"no held-out files found under {base}: is it a standard library?")
    return Corpus(str(base), splits["train"], splits["validation"], splits["test"])


def chat_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The jinja environment Hugging Face transformers renders chat templates in."""
    return jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)


@functools.lru_cache(maxsize=1)
def _chat_template() -> jinja2.Template:
    return chat_environment().from_string(CHAT_TEMPLATE)


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    return _chat_template().render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
    )


def _doc_summary(node: ast.AST) -> str | None:
    doc = ast.get_docstring(node)
    if not doc:
        return None
    first = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
    summary = " ".join(first.split())
    if not _MIN_DOC_CHARS <= len(summary) <= _MAX_DOC_CHARS:
        return None
    return summary


def _function_source(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The ``def`` through the body's last line, with the def's own indentation removed."""
    body = lines[node.lineno - 1:node.end_lineno]
    indent = body[0][:node.col_offset]
    return "\n".join(line[len(indent):] if line.startswith(indent) else line for line in body)


def _documented_functions(text: str):
    """Yields ``(class name or None, function node)`` for module-level functions and methods."""
    try:
        with warnings.catch_warnings():  # another version's escapes warn; they still parse
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield None, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield node.name, item


@dataclass(frozen=True)
class FunctionRecord:
    """A documented function: what a user would ask for and the code that answers it."""

    cls: str | None  # the enclosing class for a method
    signature: str  # "name(args)"
    doc: str  # first docstring paragraph, whitespace collapsed
    code: str  # the def's source, dedented


def function_records(files: list[SourceFile]) -> list[FunctionRecord]:
    """Documented module-level functions and methods of ``files``, in file order."""
    records = []
    for source in files:
        lines = source.text.splitlines()
        for cls, node in _documented_functions(source.text):
            doc = _doc_summary(node)
            if doc is None:
                continue
            code = _function_source(lines, node)
            if len(code) > _MAX_FUNCTION_CHARS:
                continue
            try:
                signature = f"{node.name}({ast.unparse(node.args)})"
            except (ValueError, RecursionError):  # unparse gives up on a few odd nodes
                continue
            records.append(FunctionRecord(cls, signature, doc, code))
    return records


def render_chat_sample(record: FunctionRecord, rng: random.Random) -> str:
    """One conversation (starting with <|bos|>): optional system turn, request, code answer.

    The phrasing and the system prompt are drawn from ``rng``, so rendering the same record
    twice with different draws gives two different requests for the same code.
    """
    if record.cls is None:
        prompt = rng.choice(_FUNCTION_PROMPTS).format(sig=record.signature, doc=record.doc)
    else:
        prompt = rng.choice(_METHOD_PROMPTS).format(
            cls=record.cls, sig=record.signature, doc=record.doc
        )
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
    messages.append({"role": "user", "content": prompt})
    messages.append({"role": "assistant", "content": f"```python\n{record.code}\n```"})
    return render_chat(messages)
