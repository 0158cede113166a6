"""``scripts/gluon_int4_rows.py`` compiles its Gluon candidate for one row of 4-bit weights
on any machine, and the candidate's sm_90 loop is what docs/benchmarks.md says of it: no
barrier, no shuffle, no shared memory, no spill, and fewer instructions a weight than the
engine's Triton kernel (4.23 at 128 x 128)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

pytest.importorskip("triton.experimental.gluon")


def test_the_gluon_loop_exchanges_nothing_between_lanes():
    import gluon_int4_rows

    counts = gluon_int4_rows.sass_counts((8, 4, 4, 4, 1))
    assert (counts["barriers"], counts["shuffles"], counts["shared"], counts["spills"]) == (
        0, 0, 0, 0)
    assert counts["per_weight"] < 4.23
    assert gluon_int4_rows.rows_per_program(8, 4, 4) == 256
    assert gluon_int4_rows.fits((8, 4, 4, 4, 8), 4096) and not gluon_int4_rows.fits(
        (8, 4, 4, 4, 8), 14336 - 128)
