"""What this process may run on, in a module without torch: the Ray cluster code, the bench's machine
description and the grammar's mask threads ask it, and a cluster worker imports it before it knows
whether its payload needs a model; the model loader and the KV cache ask how much memory is free."""

from __future__ import annotations

import os
import time


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), where the system says."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cpu_times(cpus: set[int]) -> tuple[float, float] | None:
    """(busy, elapsed) seconds of these CPUs since boot, from /proc/stat: busy counts user, niced,
    system, interrupt and stolen time (a hypervisor's other guests). Niced work counts: Linux still
    gives it time slices that stall a parallel region, and a process run under ``nice`` has its own
    time booked there (left out, it would be subtracted without having been counted)."""
    try:
        with open("/proc/stat") as stat:
            lines = [line.split() for line in stat if line.startswith("cpu") and line[3].isdigit()]
    except OSError:
        return None
    busy = total = 0
    for fields in lines:
        if int(fields[0][3:]) in cpus:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, fields[1:9])
            busy += user + nice + system + irq + softirq + steal
            total += user + nice + system + idle + iowait + irq + softirq + steal
    tick = os.sysconf("SC_CLK_TCK")
    return (busy / tick, total / tick) if total else None


class BusyElsewhere:
    """How many of this process's cores other processes kept busy lately: the busy time of the cores
    it may run on (:func:`_cpu_times`) less its own CPU time, over windows of at least ``window_s``
    (the kernel counts in ticks of 10 ms). None until a window has passed, and where /proc/stat is
    not there. Calling it costs a file read once a window, a clock reading in between."""

    def __init__(self, window_s: float = 0.1, times=None, own=None, clock=time.monotonic):
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self.window_s, self.clock, self.cpus = window_s, clock, len(cpus)
        self._times = times or (lambda: _cpu_times(cpus))
        self._own = own or (lambda: sum(os.times()[:2]))
        self._since = self._sample()
        self.cores: float | None = None

    def _sample(self) -> tuple[float, tuple[float, float] | None, float]:
        return self.clock(), self._times(), self._own()

    def __call__(self) -> float | None:
        start, machine, own = self._since
        if machine is None or self.clock() - start < self.window_s:
            return self.cores
        now = self._sample()
        if now[1] is None:  # a failed read (no file handle left, say): the window goes on, read again next call
            return self.cores
        self._since = now
        busy, elapsed = now[1][0] - machine[0], now[1][1] - machine[1]
        if elapsed > 0:  # CPU-seconds of the cores over seconds of each: cores
            self.cores = max(0.0, (busy - (now[2] - own)) * self.cpus / elapsed)
        return self.cores
