"""What this process may run on, in a module without torch: the Ray cluster code, the bench's machine
description and the grammar's mask threads ask it, and a cluster worker imports it before it knows
whether its payload needs a model."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), where the system says."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
