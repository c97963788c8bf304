"""glibc malloc settings for CPU training.

glibc serves large blocks with mmap and raises its mmap threshold dynamically as blocks are freed.
A training step frees and re-allocates the same large activation buffers every step; depending on
the order of allocations the threshold can stay low, and every step then maps, page-faults and
unmaps those buffers again. Pinning the threshold (and not trimming the heap) keeps them in the
heap (compare: scripts/bench/bench_peers.py --trainer-override dist.pin_cpu_malloc=false); on
GPUs the caching allocator makes this moot.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 * 2**20  # glibc's largest allowed value on 64-bit systems
_TRIM_THRESHOLD = 2**30


def pin_malloc_thresholds() -> bool:
    """Fix glibc's mmap and trim thresholds for this process; False where that is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = (
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
        and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    )
    logger.debug("glibc malloc thresholds pinned: %s", ok)
    return ok
