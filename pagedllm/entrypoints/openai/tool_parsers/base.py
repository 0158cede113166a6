"""Tool-call parsers: the data they return and the stream every format shares.

A format only says how to cut an output into segments (``ToolParser.scan``): content
text, calls, and, while the output is still being generated, a ``HOLD`` at the end for what
is not decided yet. The rest is shared:

- content is the text outside the call markup. Whitespace that only separates it from a call
  is dropped, and content pieces on either side of a call are joined with one newline; with
  no calls the content is the output as it is. A call that does not parse (malformed JSON, an
  unknown shape) is content, verbatim, markup included.
- a call's arguments are ``dumps_json`` of the arguments object, the same text whether the
  output was read whole (``extract``) or streamed. The JSON formats share ``read_json_calls``:
  a value holding one ``{"name": ..., "arguments": {...}}`` object or a list of them.

``ToolCallStream`` scans the text received so far on every delta and emits what grew since
the last delta: content, a call's first ``DeltaToolCall`` (index, id, name and any arguments
known), then its arguments fragments. As a scan of a prefix only returns what a scan of any
longer text returns too, the deltas add up to ``extract``'s result however the output is cut
into deltas. The one exception is a call whose name has been streamed and whose markup
then fails to parse (a malformed argument value, an output cut short by a length limit): it
cannot be withdrawn, so it stays as streamed, and its raw text follows as content, as
``extract`` reports it.

A scan takes time linear in the text so far, nearly all of it in C (``str.find``, the
``json`` decoder); only the call still open is read in Python, by ``partial``.
"""

from __future__ import annotations

import secrets
import string
import uuid
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from pagedllm.entrypoints.openai.tool_parsers.partial import (
    decode_json_at, dumps_json, extension, held_suffix_len, member_closers, parse_partial_json,
    skip_space, stable_dumps,
)

if TYPE_CHECKING:
    from pagedllm.engine.tokenizer import Tokenizer


@dataclass
class FunctionCall:
    name: str
    arguments: str  # the JSON text of an object


@dataclass
class ToolCall:
    id: str
    function: FunctionCall
    type: str = "function"


@dataclass
class ExtractedToolCalls:
    content: str | None  # None when the output holds only calls
    tool_calls: list[ToolCall]


@dataclass
class DeltaToolCall:
    """A call's first delta carries ``index``, ``id`` and ``name``; later ones ``arguments``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class DeltaMessage:
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


_ALPHANUMERIC = string.ascii_letters + string.digits


def make_tool_call_id(kind: str = "random") -> str:
    """``"call_"`` and 24 hex digits; for ``kind="mistral"`` 9 alphanumerics, as Mistral's
    chat templates require of the ids they are sent back."""
    if kind == "random":
        return f"call_{uuid.uuid4().hex[:24]}"
    if kind == "mistral":
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
    raise ValueError(f"Unknown tool call id kind {kind!r}: use 'random' or 'mistral'.")


@dataclass
class PartialCall:
    """A call as far as a scan can tell: ``arguments`` is the part of the final arguments
    text known so far (all of it once the call is complete). ``key`` names the call by
    where its markup starts, the same in every scan of a longer text."""

    key: Hashable
    name: str
    arguments: str


class _Hold:
    """The end of a partial output that is not decided yet (a possible marker, a call whose
    name is not known): it emits nothing, and content before it keeps its trailing whitespace
    back, as a call may follow."""

    def __repr__(self) -> str:
        return "HOLD"


HOLD = _Hold()
Segment = str | PartialCall | _Hold


def json_call(obj: object, closers: str, key: Hashable, *,
              args_keys: tuple[str, ...] = ("arguments",),
              args_required: bool = False) -> PartialCall | None:
    """The call a (partial) ``{"name": ..., "arguments": {...}}`` object holds.

    None while the name is not complete, and for a complete object that is no call: no
    non-empty string ``name``, arguments that are neither an object nor a string, or
    (``args_required``) no arguments key. Without arguments (when allowed) the call has
    ``{}``. Arguments written as a JSON string (Granite's models do) are that string's
    object where it holds one, else the string itself as a JSON value (vLLM's rule); they
    are known once the string is complete.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or member_closers(obj, "name", closers):
        return None
    args_key = next((k for k in args_keys if k in obj), None)
    if args_key is None:
        if args_required:
            return None
        return PartialCall(key, name, "" if closers else "{}")
    args = obj[args_key]
    args_closers = member_closers(obj, args_key, closers)
    if isinstance(args, str):
        return PartialCall(key, name, "" if args_closers else _string_arguments(args))
    if not isinstance(args, dict):
        return PartialCall(key, name, "") if closers else None
    return PartialCall(key, name, stable_dumps(args, args_closers))


def _string_arguments(text: str) -> str:
    """The arguments a model wrote as a JSON string: the object the string holds, else the
    string as a JSON value."""
    decoded = decode_json_at(text, skip_space(text, 0))
    if decoded is not None and isinstance(decoded[0], dict) and not text[decoded[1]:].strip():
        return dumps_json(decoded[0])
    return dumps_json(text)


def json_calls(value: object, closers: str, at: int, **call_options) -> list[PartialCall] | None:
    """The calls a (partial) call object or list of call objects holds, keyed ``(at, i)``.

    None when a complete member is no call, or a complete list is empty. The last member of
    an open list is left out while its name is not known.
    """
    members = value if isinstance(value, list) else [value]
    if not members and not closers:
        return None
    calls = []
    for i, member in enumerate(members):
        open_closers = member_closers(value, i, closers) if isinstance(value, list) else closers
        call = json_call(member, open_closers, (at, i), **call_options)
        if call is None:
            if open_closers:
                break
            return None
        calls.append(call)
    return calls


def read_json_calls(text: str, pos: int, final: bool,
                    **call_options) -> tuple[list[PartialCall], int | None] | None:
    """The calls in the JSON value at ``text[pos]``: (calls, the index after the value), or,
    while a partial scan's value is still open, (the calls known so far, None). None when the
    value holds no calls, or (partial scan) cannot be read yet."""
    decoded = decode_json_at(text, pos)
    if decoded is not None:
        calls = json_calls(decoded[0], "", pos, **call_options)
        return None if calls is None else (calls, decoded[1])
    partial = None if final else parse_partial_json(text[pos:])
    if partial is None:
        return None
    calls = json_calls(*partial, pos, **call_options)
    return None if calls is None else (calls, None)


def content_tail(text: str, markers: tuple[str, ...], final: bool) -> list[Segment]:
    """Text after the last markup: content, and in a partial scan a HOLD for its end that may
    start one of ``markers``."""
    if final:
        return [text]
    return [text[: len(text) - held_suffix_len(text, markers)], HOLD]


def assemble(segments: list[Segment]) -> tuple[str, list[PartialCall]]:
    """The content and calls of a scan (see the module docstring for the content rule)."""
    calls = [s for s in segments if isinstance(s, PartialCall)]
    pieces: list[str] = []
    run: list[str] = []
    after_boundary = False
    for segment in [*segments, None]:
        if isinstance(segment, str):
            run.append(segment)
            continue
        text = "".join(run)
        if after_boundary:
            text = text.lstrip()
        if segment is not None:
            text = text.rstrip()
        if text:
            pieces.append(text)
        run, after_boundary = [], True
    return "\n".join(pieces), calls


class ToolParser:
    """One tool-call format. Subclasses set ``name`` and implement ``scan``."""

    name: ClassVar[str]
    # True when the call markers are special tokens that must not be skipped in decoding.
    keeps_special_tokens: ClassVar[bool] = False
    # The ``make_tool_call_id`` kind of the ids given to calls.
    id_kind: ClassVar[str] = "random"

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self.tokenizer = tokenizer

    def for_tools(self, tools: list[dict] | None) -> ToolParser:
        """The parser for one request's ``tools``: this one, unless the format reads its
        calls by the tools' parameters (``qwen3_coder`` types its values by them)."""
        return self

    def scan(self, text: str, final: bool) -> list[Segment]:
        """Cut an output into content strings and calls, in order.

        With ``final=False`` the text is a prefix of the output: every content string and
        call returned must come back, the same or extended, from the scan of any longer
        text, so what is undecided goes into a ``HOLD`` at the end.
        """
        raise NotImplementedError

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole output and the content around them; never raises on bad markup."""
        content, calls = assemble(self.scan(text, final=True))
        tool_calls = [ToolCall(id=make_tool_call_id(self.id_kind),
                               function=FunctionCall(name=c.name, arguments=c.arguments))
                      for c in calls]
        return ExtractedToolCalls(content=content or None, tool_calls=tool_calls)

    def stream(self) -> ToolCallStream:
        """A new stream state, for one choice."""
        return ToolCallStream(self)


@dataclass
class _SentCall:
    index: int
    name: str
    arguments: str


def registered(registry: dict, name: str, what: str, flag: str):
    """``registry[name]``; a ValueError naming ``flag`` and the known names otherwise."""
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(sorted(registry))
        raise ValueError(f"Unknown {what} {name!r} ({flag}): choose one of {known}.") from None


class TextStream:
    """A streamed output read again whole on every delta: ``_emit(final)`` returns what the
    text received so far adds to what was emitted (``final``: generation has ended)."""

    def __init__(self) -> None:
        self._text = ""

    def feed(self, delta_text: str) -> DeltaMessage | None:
        """The next piece of output text; None when nothing can be emitted yet."""
        self._text += delta_text
        return self._emit(final=False)

    def finish(self) -> DeltaMessage | None:
        """The end of generation: emits what was held back."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> DeltaMessage | None:
        raise NotImplementedError


class ToolCallStream(TextStream):
    """The deltas of one streamed output (see the module docstring)."""

    def __init__(self, parser: ToolParser) -> None:
        super().__init__()
        self._parser = parser
        self._content = ""
        self._sent: dict[Hashable, _SentCall] = {}

    def _emit(self, final: bool) -> DeltaMessage | None:
        content, calls = assemble(self._parser.scan(self._text, final))
        delta = DeltaMessage()
        new_content = extension(self._content, content)
        if new_content:
            delta.content = new_content
            self._content = content
        for call in calls:
            sent = self._sent.get(call.key)
            if sent is None:
                sent = self._sent[call.key] = _SentCall(len(self._sent), call.name, call.arguments)
                delta.tool_calls.append(DeltaToolCall(
                    index=sent.index, id=make_tool_call_id(self._parser.id_kind),
                    name=call.name, arguments=call.arguments or None))
            elif sent.name == call.name and (more := extension(sent.arguments, call.arguments)):
                delta.tool_calls.append(DeltaToolCall(index=sent.index, arguments=more))
                sent.arguments = call.arguments
        return delta if delta.content or delta.tool_calls else None
