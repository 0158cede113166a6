"""N-gram prompt lookup: propose the tokens that followed an earlier occurrence of a
request's last tokens in its own prompt and output. No model, no torch: numpy on the
request's token ids, in the engine core between steps.

For ``n`` from ``max_n`` down to ``min_n``, the request's last ``n`` tokens are looked up
earlier in its tokens; the first ``n`` with a match wins. Among its matches, the latest
one followed by ``k`` tokens is used (the most recent context, with a full proposal),
else the earliest (the longest continuation there is)::

    tokens:    ... a b c d e ... x y a b c | ?        (last n = 3 tokens: a b c)
                   ^^^^^ match       ^^^^^ suffix
    proposal:  d e ...  (up to k tokens)

Pays where outputs repeat spans of their input: code edits, copying, quoting, retrieval
answers. Written by hand: a few vectorised comparisons over one array per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class NgramProposer:
    """Up to ``num_speculative_tokens`` (k) proposals per request, from its own tokens.

    Keeps one growing int64 copy of each request's tokens (appended to, never rebuilt), so
    a step costs O(tokens) vectorised work per request rather than a list conversion;
    ``retain`` drops the copies of requests that are gone.
    """

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}.")
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, request_id: str, token_ids: Sequence[int]) -> list[int]:
        """Proposals for the request whose tokens so far are ``token_ids`` (possibly none)."""
        tokens = self._array(request_id, token_ids)
        return lookup(tokens, self.k, self.min_n, self.max_n)

    def __len__(self) -> int:
        """Requests whose tokens it holds."""
        return len(self._tokens)

    def retain(self, request_ids: Iterable[str]) -> None:
        """Forget every request not in ``request_ids``."""
        keep = set(request_ids)
        for request_id in [r for r in self._tokens if r not in keep]:
            del self._tokens[request_id]

    def _array(self, request_id: str, token_ids: Sequence[int]) -> np.ndarray:
        buffer, length = self._tokens.get(request_id, (None, 0))
        total = len(token_ids)
        if buffer is None or total > len(buffer):
            grown = np.empty(max(2 * total, 64), dtype=np.int64)
            if buffer is not None:
                grown[:length] = buffer[:length]
            buffer = grown
        if total > length:
            buffer[length:total] = token_ids[length:total]
        self._tokens[request_id] = (buffer, total)
        return buffer[:total]


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """The proposal for ``tokens`` (see the module docstring); ``[]`` when no suffix of
    ``min_n`` to ``max_n`` tokens occurs earlier."""
    length = len(tokens)
    if length < min_n + 1:
        return []
    # Candidate match ends: earlier positions holding the last token.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        found = ends[ends >= n - 1]
        for back in range(1, n):
            if not len(found):
                break
            found = found[tokens[found - back] == tokens[length - 1 - back]]
        if len(found):
            full = found[found + k <= length - 1]
            end = int(full[-1]) if len(full) else int(found[0])
            return tokens[end + 1:end + 1 + k].tolist()
    return []
