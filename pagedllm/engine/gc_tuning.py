"""The garbage collector in the server's long-lived processes (the engine core and each API
process) and around the offline ``LLM.generate``.

After startup, nearly every object alive lives as long as the process: the model's
modules, compiled kernels and captured graphs in the core; the app, its routes and its
validators in an API process. ``tune_for_serving()``, called once startup is done:

- freezes them (``gc.freeze()``), so the oldest generation's collections no longer walk
  them;
- raises the youngest generation's threshold from 700 to ``YOUNG_THRESHOLD`` allocations.
  A step's outputs, or a burst of requests, hold a few thousand objects at once and set off
  a collection each time at 700, though nearly all of them are freed by reference
  counting moments later.

Collections still run, so cyclic garbage is still reclaimed.

The offline engine runs in the caller's process, whose heap must not stay frozen (that
would keep every dropped ``LLM`` alive: its object graph has cycles). ``LLM.generate``
tunes the collector the same way only while it runs (``offline_generate``), and pauses it
while the requests are admitted.

``PAGEDLLM_GC_TUNING=0`` leaves the collector as Python sets it, in both (for A/B runs).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

from pagedllm.switches import switch

GC_ENV = "PAGEDLLM_GC_TUNING"
YOUNG_THRESHOLD = 10_000


def tune_for_serving() -> None:
    """Freeze the startup heap and raise the youngest generation's threshold (see above)."""
    if not switch(GC_ENV, True):
        return
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)


@contextlib.contextmanager
def offline_generate() -> Iterator[Callable[[], None]]:
    """The collector around one ``LLM.generate``; yields ``admitted``, to call once every
    request is admitted.

    Until ``admitted()``, no collection runs: admission builds a few objects per request and
    frees nearly none, so there is no garbage to find, while each collection of the oldest
    generation would walk everything admitted so far. ``admitted()`` freezes the heap
    alive then (the model, the admitted requests), raises the youngest generation's
    threshold to ``YOUNG_THRESHOLD`` and lets the collector run again: it reclaims the
    cyclic garbage the steps make without walking the frozen heap. On exit the frozen
    objects return to the oldest generation and the thresholds are restored, so nothing
    outlives its last reference for longer than one ``generate``. A collector the caller
    disabled, or a heap the caller froze, is left as it is.
    """
    if not (gc.isenabled() and switch(GC_ENV, True)) or gc.get_freeze_count():
        yield lambda: None
        return
    thresholds = gc.get_threshold()
    frozen = False

    def admitted() -> None:
        nonlocal frozen
        gc.freeze()
        frozen = True
        gc.set_threshold(YOUNG_THRESHOLD, *thresholds[1:])
        gc.enable()

    gc.disable()
    try:
        yield admitted
    finally:
        if frozen:
            gc.unfreeze()
        gc.set_threshold(*thresholds)
        gc.enable()
