"""Integer helpers for kernel launches on the host: grid sizes and power-of-two blocks.

Triton's ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions; called
from host code they go through Triton's wrapper (several microseconds a call on a GPU
host), and an eager step computes a few of them per launch. These are the plain integer
versions, for host code only (kernels keep ``tl.cdiv``).
"""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
