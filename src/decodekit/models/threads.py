"""How many threads the compiled kernels use: all of torch's, unless the machine is shared.

Threads that split every matrix between them wait for each other at the end of each split. When
another process takes one of the cores, every pass waits for the descheduled thread, and decoding
with two threads fell to a quarter of its quiet speed, below one thread alone. So the
:class:`ThreadGovernor` times one-token passes and keeps, for each thread count it tries (one, or
all of torch's), a running estimate of a pass's time, and uses the faster. Now and then it tries
the other count for one pass, so it returns to all threads once the machine is quiet again. The
pause between those probes doubles while the other count keeps losing (16 passes up to 512).

A pass is never faster than the machine allows, only slower when something else runs. So a
faster timing replaces the estimate at once, and a slower one moves it a fifth of the way: one
quiet probe is enough evidence that a count is fast again, while the estimate still follows the
slow growth of a pass's cost with the context.

The governor sets torch's thread count, which the kernels also take, so the small torch operations
of a step (an argmax over the vocabulary) stop waiting for a descheduled thread too. The choice never
changes a result: the kernels never split a row between threads, and a test holds torch's
operations on the decode path to the same (tokens identical with one thread and with two).
``DECODEKIT_THREAD_GOVERNOR=0`` turns it off (torch's count for every pass).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

FIRST_PROBE = 16  # passes before the first try of the other thread count
LONGEST_PAUSE = 512  # passes between tries while the other count keeps losing
SLOWER_WEIGHT = 0.2  # how far a slower timing moves an estimate


class ThreadGovernor:
    """Chooses torch's thread count (which the kernels take too) pass by pass: one, or the count
    set when the process started (or last set by someone else)."""

    def __init__(self) -> None:
        self.current: int | None = None  # the count this governor last set
        self.most = 1  # the count it may use: torch's, as found
        self.estimate: dict[int, float] = {}  # seconds of a one-token pass, per thread count
        self.pause = FIRST_PROBE
        self.since_probe = 0
        self.probing = False
        self.leader: int | None = None  # the count with the best estimate at the last choice
        self.held: int | None = None  # set by hold(): every pass uses it, nothing is timed
        self._lock = threading.Lock()

    def choose(self, timed: bool) -> int:
        """Set and return the thread count for the next pass; ``timed``: a one-token pass whose
        time will be reported to :meth:`observe` (only those passes try the other count)."""
        with self._lock:
            found = torch.get_num_threads()
            if os.environ.get("DECODEKIT_THREAD_GOVERNOR", "1") == "0":  # off: torch's count, always
                self.current = found
                return found
            if found != self.current:  # the first pass, or someone set torch's count: start over
                self.most, self.estimate, self.pause, self.since_probe = found, {}, FIRST_PROBE, 0
            counts = (self.most, 1) if self.most > 1 else (1,)
            if self.held is not None:  # a measurement that must not mix thread counts
                best = self.held
                if best != found:
                    torch.set_num_threads(best)
                self.current = best
                return best
            best = min(counts, key=lambda n: self.estimate.get(n, -math.inf if n == self.most else math.inf))
            if best != self.leader:  # a switch: try the count just left again soon (a burst may be over)
                self.leader, self.pause, self.since_probe = best, FIRST_PROBE, 0
            self.probing = False
            if timed and len(counts) > 1:
                unmeasured = [n for n in counts if n not in self.estimate]
                self.since_probe += 1
                if unmeasured:
                    best, self.probing = unmeasured[0], True
                elif self.since_probe >= self.pause:
                    best, self.probing = (1 if best == self.most else self.most), True
                    self.since_probe = 0
            if best != found:
                torch.set_num_threads(best)
            self.current = best
            return best

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Every pass inside uses all threads and nothing is timed: for measurements of pass costs
        (the verify-cost table, ``decodekit profile``), which must not mix thread counts."""
        outer = self.held
        self.held = outer or (torch.get_num_threads() if self.current is None else self.most)
        try:
            yield
        finally:
            self.held = outer

    @contextmanager
    def governed(self, timed: bool) -> Iterator[int]:
        """Around a pass: choose its thread count and, for a ``timed`` one, report its time."""
        timed = timed and self.held is None
        threads = self.choose(timed)
        t0 = time.perf_counter()
        yield threads
        if timed:
            self.observe(threads, time.perf_counter() - t0)

    def observe(self, threads: int, seconds: float) -> None:
        """A one-token pass run with ``threads`` threads took ``seconds``."""
        with self._lock:
            old = self.estimate.get(threads)
            if old is None or seconds < old:
                self.estimate[threads] = seconds
            else:
                self.estimate[threads] = old + SLOWER_WEIGHT * (seconds - old)
            if self.probing:
                others = [s for n, s in self.estimate.items() if n != threads]
                won = not others or self.estimate[threads] <= min(others)
                self.pause = FIRST_PROBE if won else min(LONGEST_PAUSE, 2 * self.pause)


#: The process's governor: thread contention is a property of the machine, not of a model.
GOVERNOR = ThreadGovernor()
