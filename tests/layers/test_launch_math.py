"""Host launch arithmetic gives Triton's own values (block sizes and grids depend on it)."""

import triton

from pagedllm.layers.launch_math import cdiv, next_power_of_2


def test_next_power_of_2_equals_tritons() -> None:
    for n in range(1, 70_000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_equals_tritons() -> None:
    for a in range(0, 3_000):
        for b in (1, 2, 3, 16, 64, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
