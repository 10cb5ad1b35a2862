"""The process's memory: giving back what a load freed."""

from __future__ import annotations

import ctypes
from functools import cache


@cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library). Looked up once: the symbol comes from
    the C library already loaded into the process, without searching for it on disk."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> None:
    """Give the heap's free pages back to the system where the C library can (glibc's
    ``malloc_trim``; elsewhere nothing happens): what a load freed then stops counting as the
    process's memory."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
