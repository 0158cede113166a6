"""Incremental, UTF-8 safe detokenization of one sequence, with stop strings.

Tokens arrive a few at a time; the text must be streamed as it grows, equal in the end to
decoding all output tokens at once, and never show half a character (a byte-level token
may hold the first bytes of a CJK character or an emoji whose last bytes come next step).

The classic prefix/read-offset scheme, over the ``tokenizers`` decoder::

    ids:   ... p p p | o o o o o | n n
                     ^prefix     ^read      (n = tokens not yet turned into text)
    prefix_text = decode(ids[prefix:read])    already emitted
    new_text    = decode(ids[prefix:])        emit new_text[len(prefix_text):]

Decoding a window that starts a few tokens back gives tokens their context (the leading
space a SentencePiece word loses at the start of a decode, byte pieces of a character).
When ``new_text`` ends in U+FFFD the last character is incomplete: nothing is emitted and
the tokens wait for the next step. When the sequence finishes, whatever is left is flushed,
so the final text equals a one-shot decode. The window starts at the last prompt tokens, so
the first output token decodes as it would after its prompt.

Written by hand rather than with ``tokenizers.decoders.DecodeStream``, which runs the same
scheme in Rust but cannot flush: bytes it holds back when a sequence ends mid-character are
lost, so its text would differ from a one-shot decode. A step here costs one or two decodes
of a few tokens.

Stop strings are searched only in the text each step adds (starting ``len(stop) - 1``
characters back, for stops that span steps), so a step costs O(new text). Streaming holds
back the last ``len(longest stop) - 1`` characters until the sequence ends, so a partial
stop string is never sent to a client.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context for the first output tokens.
_PROMPT_CONTEXT_TOKENS = 5
# Ids before the window are dropped once this many pile up (keeps memory O(window)).
_TRIM_THRESHOLD = 512


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, step by step, and finds stop strings.

    ``output_text`` is the text of the output so far: characters still incomplete are not
    in it, and once a stop string is found it is cut before the stop string (or just after
    it when ``include_stop_str_in_output``) and later tokens are ignored.

    ``spaces_between_special_tokens`` is accepted for API parity: it is an option of
    transformers' slow (Python) tokenizers; tokenizer.json decoders, like transformers' fast
    tokenizers, join special tokens as their decoder says.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        # A pagedllm Tokenizer, or a bare tokenizers.Tokenizer.
        backend = getattr(tokenizer, "backend", tokenizer)
        if not isinstance(backend, tokenizers.Tokenizer):
            raise ValueError(
                f"tokenizer must be a pagedllm Tokenizer or a tokenizers.Tokenizer, got {type(tokenizer)}."
            )
        self._backend = backend
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1 if self.stop and not include_stop_str_in_output else 0
        )

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        prefix_text = self._decode(context)
        if prefix_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: its bytes would merge with the output's
            # first bytes, which a decode of the output alone never sees. Start fresh.
            context, prefix_text = [], ""
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = prefix_text

        self._text = ""
        self._last_output_offset = 0
        self.stop_reason: str | None = None

    # -- public API -----------------------------------------------------------------------
    @property
    def output_text(self) -> str:
        return self._text

    @property
    def stopped(self) -> bool:
        """True once a stop string was found (the text is final)."""
        return self.stop_reason is not None

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append this step's tokens; returns the stop string if the text now contains one.

        ``stop_terminated``: the last token is a stop token (EOS or a stop_token_id) whose
        text is not part of the output unless ``include_stop_str_in_output``.
        """
        if self.stop_reason is not None or not new_token_ids:
            return None
        ids = list(new_token_ids)
        if stop_terminated and not self.include_stop_str_in_output:
            ids.pop()
        if not ids:
            return None
        self._ids.extend(ids)
        return self._advance(flush=False)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to send now: all of it (``delta=False``) or what was not sent yet.

        While the sequence runs, the last ``stop_buffer_length`` characters are held back;
        when ``finished``, pending bytes are flushed and everything is returned.
        """
        if finished:
            self._advance(flush=True)
        length = max(0, len(self._text) - (0 if finished else self.stop_buffer_length))
        if not delta:
            return self._text[:length]
        start = self._last_output_offset
        if start >= length:
            return ""
        self._last_output_offset = length
        return self._text[start:length]

    # -- internals ------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, flush: bool) -> str | None:
        """Turn the tokens after the read offset into text if they end on a whole character.

        ``flush`` emits them even when they do not (the sequence is over).
        """
        if self.stop_reason is not None or self._read_offset == len(self._ids):
            return None
        new_text = self._decode(self._ids[self._prefix_offset:])
        if not flush and (len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)):
            return None
        added = new_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        if self._prefix_offset >= _TRIM_THRESHOLD:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return self._append(added)

    def _append(self, added: str) -> str | None:
        if not added:
            return None
        old_length = len(self._text)
        self._text += added
        if not self.stop:
            return None
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = self._text.find(stop, max(0, old_length - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self._text = self._text[: at + len(stop) if self.include_stop_str_in_output else at]
        self.stop_reason = stop
        return stop
