"""The process's memory: giving back what a load freed."""

from __future__ import annotations


def return_freed_memory() -> None:
    """Give the heap's free pages back to the system where the C library can (glibc's
    ``malloc_trim``; elsewhere nothing happens): what a load freed then stops counting as the
    process's memory."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
