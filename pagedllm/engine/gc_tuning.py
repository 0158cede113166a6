"""The garbage collector in the server's long-lived processes: the engine core and each API
process.

After startup, nearly every object alive lives as long as the process: the model's
modules, compiled kernels and captured graphs in the core; the app, its routes and its
validators in an API process. ``tune_for_serving()``, called once startup is done:

- freezes them (``gc.freeze()``), so the oldest generation's collections no longer walk
  them;
- raises the youngest generation's threshold from 700 to ``YOUNG_THRESHOLD`` allocations.
  A step's outputs, or a burst of requests, hold a few thousand objects at once and set off
  a collection each time at 700, though nearly all of them are freed by reference
  counting moments later.

Collections still run, so cyclic garbage is still reclaimed. The offline engine runs in the
caller's process and is left alone: a frozen heap there would keep every dropped ``LLM``
alive (its object graph has cycles).

``PAGEDLLM_SERVER_GC=0`` leaves the collector as Python sets it (for A/B runs).
"""

from __future__ import annotations

import gc

from pagedllm.switches import switch

GC_ENV = "PAGEDLLM_SERVER_GC"
YOUNG_THRESHOLD = 10_000


def tune_for_serving() -> None:
    """Freeze the startup heap and raise the youngest generation's threshold (see above)."""
    if not switch(GC_ENV, True):
        return
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)
