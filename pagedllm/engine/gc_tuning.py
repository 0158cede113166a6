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

The offline engine runs in the caller's process, whose heap is the caller's: ``LLM.generate``
freezes nothing. It pauses the collector while the requests are admitted, then, while the
steps run, raises the youngest generation's threshold as above and runs no collection of
the oldest generation (``offline_generate``): such a collection walks the whole heap (the
model's modules, every KV block, the requests), a pause in which the device runs dry,
and the young collections already reclaim the garbage the steps make. The thresholds
return when ``generate`` does.

``PAGEDLLM_GC_TUNING=0`` leaves the collector as Python sets it, in both (for A/B runs).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

from pagedllm.switches import switch

GC_ENV = "PAGEDLLM_GC_TUNING"
YOUNG_THRESHOLD = 10_000
# The oldest generation's threshold while ``generate`` runs: collections of the middle
# generation it would take before a full one, more than any run makes.
NO_FULL_COLLECTION = 2**30


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
    frees nearly none, so there is no garbage to find, while each collection would walk
    everything admitted so far. ``admitted()`` raises the youngest generation's threshold to
    ``YOUNG_THRESHOLD``, sets the oldest generation's out of reach (no full collection
    while the steps run) and lets the collector run again. On exit the thresholds are
    restored. A collector the caller disabled is left as it is; a frozen heap stays frozen.
    A ``generate`` that starts while another one's tuning holds (another ``LLM`` in another
    thread) leaves the collector to that one, so only the first restores the thresholds.
    """
    if (not (gc.isenabled() and switch(GC_ENV, True))
            or gc.get_threshold()[2] == NO_FULL_COLLECTION):
        yield lambda: None
        return
    thresholds = gc.get_threshold()

    def admitted() -> None:
        gc.set_threshold(YOUNG_THRESHOLD, thresholds[1], NO_FULL_COLLECTION)
        gc.enable()

    gc.disable()
    try:
        yield admitted
    finally:
        gc.set_threshold(*thresholds)
        gc.enable()
