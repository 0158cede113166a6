"""Ways of cutting an output into stream deltas, shared by the parser tests."""

from __future__ import annotations

import random
from collections.abc import Iterator


def chunkings(text: str, seed: int = 0, num_random: int = 12) -> Iterator[list[str]]:
    """Every cut into two chunks, every character alone, and seeded random multi-way cuts."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(num_random):
        size = max(0, min(len(text) - 1, rng.randint(2, 12)))
        cuts = sorted(rng.sample(range(1, len(text)), size))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
