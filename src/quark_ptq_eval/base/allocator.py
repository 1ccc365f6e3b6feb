"""Handing memory the C allocator keeps back to the operating system.

glibc's malloc serves allocations below its (dynamic, up to 32 MiB) mmap threshold from arenas and
returns freed pages only from an arena's top: a loop that frees and reallocates megabytes per step
while keeping a few small results leaves freed holes that stay resident. Tier 1 grew ~0.5 KiB of RSS
per scored token that way (bench/README.md) while holding 8 bytes per token. ``malloc_trim`` gives
those pages back; elsewhere (musl, macOS) there is nothing to call and nothing is done.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Return the allocator's free pages to the OS; False where the allocator offers no way."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True

