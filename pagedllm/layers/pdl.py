"""Programmatic dependent launch (PDL, compute capability 9.0 and later): a kernel's programs
are placed on the GPU while the kernel before it is still finishing.

A batch-1 decode step is about five kernels a layer back to back in a CUDA graph. Between
two plain launches the GPU drains the first grid, makes its writes visible and only then
starts placing the second's programs: a gap of a microsecond or two each time, against
the 10-30 us a one-row product takes. A kernel launched with PDL (Triton's ``launch_pdl``)
may be placed once every program of the kernel before it has started, so its programs are
resident and waiting when that kernel completes.

The contract, for every kernel that takes a ``PDL`` constexpr (``launch_options`` sets it
together with ``launch_pdl``, never one without the other): with ``PDL`` set, each program
first calls ``wait_for_previous_kernel`` (``_triton_ops_kernels``), which returns once the
kernel before it has completed with its writes visible (``griddepcontrol.wait``); no load
or store comes before it. So a PDL kernel completes only after the kernel before it, and
every kernel after it sees what all earlier kernels wrote, as on a plain stream; a plain
kernel after a PDL one waits for it as usual. Each program also calls
``release_next_kernel`` (``griddepcontrol.launch_dependents``: the next kernel may be
placed once every program has), right after the wait in short kernels
(``follow_previous_kernel``) and after the main loop in the small-batch product: released
at its start, the next kernel's waiting programs held room the product's tiles needed
(docs/benchmarks.md).

It is on wherever the GPU supports it (compute capability 9.0 and later, not the Triton
interpreter); ``PAGEDLLM_PDL=0`` turns it off.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from pagedllm.switches import switch

logger = logging.getLogger(__name__)

PDL_ENV = "PAGEDLLM_PDL"


@functools.cache
def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: a CUDA GPU of compute capability 9.0
    or later, not the Triton interpreter, and ``PAGEDLLM_PDL`` not ``0``. Asked for
    (``PAGEDLLM_PDL=1``) where it cannot run, it says so once and stays off."""
    asked = os.environ.get(PDL_ENV, "").strip() == "1"
    wanted = switch(PDL_ENV, True)  # a value the switch does not take is refused anywhere
    if not wanted or os.environ.get("TRITON_INTERPRET") == "1" or device.type != "cuda":
        return False
    capability = torch.cuda.get_device_capability(device)
    if capability < (9, 0):
        if asked:
            logger.warning("%s=1 is ignored on %s: programmatic dependent launch needs compute "
                           "capability 9.0 or later, this GPU has %d.%d.", PDL_ENV,
                           torch.cuda.get_device_name(device), *capability)
        return False
    return True


@functools.cache
def launch_options(device: torch.device) -> dict:
    """Keyword arguments for launching a kernel that takes the ``PDL`` constexpr on
    ``device`` (a ``torch.device``): the constexpr and Triton's ``launch_pdl`` together.
    The dict is shared: pass it with ``**``, never change it."""
    if pdl_enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
