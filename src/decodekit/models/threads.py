"""How many threads a forward pass uses: all of the process's, unless the machine is shared.

Threads that split every matrix between them wait for each other at the end of each split. When
another process takes one of the cores, every pass waits for the descheduled thread, and decoding
with two threads fell to a quarter of its quiet speed, below one thread alone. So the
:class:`ThreadGovernor` times plain one-token steps and keeps, per model (and cache policy) and per
thread count (one, or all), a running estimate of a step's time, and uses the faster. Drafts that
cost less than a step (attending to a window, skipping layers) are not timed: counted as steps, they
made whichever count they ran under look faster. Now and then it tries the other
count for one pass, so it returns to all threads once the machine is quiet again. The pause
between those tries doubles while the other count keeps losing (16 passes up to 512) and is short
again after a switch, in case a burst of load is already over.

Timing alone learns late and dearly: under load a pass with a descheduled thread took not 2x but
hundreds of times a quiet one (every parallel region waits a scheduler slice for it), so one try of
all threads could stall a request for a second or more, and passes no one times (the server's
batched ones) never switched at all. So where the system says how busy the cores are
(:class:`decodekit.machine.BusyElsewhere`: their busy time less this process's own), a pass runs on
the cores other processes left free, without a try, while they keep half a core or more busy; the
timings decide only when the cores look free (hyper-threads, or a slower machine, can still make
fewer threads faster).

A pass is never faster than the machine allows, only slower when something else runs. So a
faster timing replaces the estimate at once, and a slower one moves it a fifth of the way: one
quiet try is enough evidence that a count is fast again, while the estimate still follows the
slow growth of a pass's cost with the context.

The governor sets torch's thread count, which the kernels take too, so the small torch operations
of a step (an argmax over the vocabulary) stop waiting for a descheduled thread as well. The
kernels never split a row between threads, so their results do not depend on the count. For
torch's own operations (prefill of more than 64 tokens, and everything where the kernels are
unavailable) the claim rests on tests: one thread and two give identical tokens on the tiny and
the embedded model. ``DECODEKIT_THREAD_GOVERNOR=0`` turns the governor off.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..machine import BusyElsewhere, usable_cores

FIRST_PROBE = 16  # passes before the first try of the other thread count
LONGEST_PAUSE = 512  # passes between tries while the other count keeps losing
SLOWER_WEIGHT = 0.2  # how far a slower timing moves an estimate
BUSY_ELSEWHERE = 0.5  # cores kept busy by other processes from which the governor leaves them theirs


@dataclass
class _Record:
    """What the governor knows about one model's one-token passes."""

    estimate: dict[int, float] = field(default_factory=dict)  # seconds per pass, per thread count
    pause: int = FIRST_PROBE
    since_probe: int = 0
    leader: int | None = None  # the count with the best estimate at the last choice


class ThreadGovernor:
    """Chooses torch's thread count, which the kernels take too, pass by pass: one, or ``most``.
    ``most`` is torch's count when the governor first ran, or when someone else last set it."""

    def __init__(self, enabled: bool = True, busy_elsewhere: Callable[[], float | None] | None = None) -> None:
        self.enabled = enabled
        self.busy_elsewhere = busy_elsewhere  # cores other processes keep busy (None: unknown)
        self._crowded = False  # whether the last choice left cores to other processes
        self.current: int | None = None  # the count this governor last set, on whichever thread
        self._mine = threading.local()  # .count: the count it last set on this thread
        self.most = 1
        self.held: int | None = None  # set by hold(): every pass uses it, nothing is timed
        self.passes: Counter[int] = Counter()  # the passes governed, by the thread count they ran on
        self._records: dict[Hashable, _Record] = {}
        self._lock = threading.Lock()

    def _sync(self) -> int:
        """Torch's count now; when someone else changed it, that count becomes ``most`` and what
        was learnt starts over (called with the lock held). Torch's count belongs to the calling
        thread (a new one starts with the last count set on any), so it is compared with what the
        governor last set on this thread: compared with the last count set anywhere, a thread the
        governor had put on one thread (a try, or beside a busy process) met another thread's full
        count, took its own one thread for someone else's setting, and kept it as ``most``."""
        found = torch.get_num_threads()
        if found != getattr(self._mine, "count", self.current):
            self.most, self._records = found, {}
        self.current = self._mine.count = found
        return found

    def _set(self, threads: int) -> None:
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        self.current = self._mine.count = threads

    def choose(self, key: Hashable, timed: bool) -> tuple[int, bool]:
        """Set torch's count for the next pass of model ``key``; returns (count, whether the pass
        tries the other count). ``timed``: a one-token pass whose time goes to :meth:`observe`."""
        with self._lock:
            if not self.enabled:
                return torch.get_num_threads(), False
            self._sync()
            if self.held is not None:
                self._set(self.held)
                return self.held, False
            counts = (self.most, 1) if self.most > 1 else (1,)
            record = self._records.setdefault(key, _Record())
            others = self.busy_elsewhere() if self.busy_elsewhere is not None and self.most > 1 else None
            if others is not None and others >= BUSY_ELSEWHERE:
                self._crowded = True
                # to the nearest core, half a busy core given up whatever the count (round() went to
                # the even one: 3 - 0.5 gave 2 threads, 4 - 0.5 gave 4)
                threads = max(1, min(self.most, math.ceil(usable_cores() - others - 0.5)))
                self._set(threads)
                return threads, False
            if self._crowded:  # the cores are free again: the next timed pass tries the other count
                self._crowded = False
                for each in self._records.values():
                    each.since_probe = each.pause
            best = min(counts, key=lambda n: record.estimate.get(n, -math.inf if n == self.most else math.inf))
            if best != record.leader:  # a switch: try the count just left again soon
                record.leader, record.pause, record.since_probe = best, FIRST_PROBE, 0
            probing = False
            if timed and len(counts) > 1:
                record.since_probe += 1
                unmeasured = [n for n in counts if n not in record.estimate]
                if unmeasured:
                    best, probing = unmeasured[0], True
                elif record.since_probe >= record.pause:
                    best, probing, record.since_probe = (1 if best == self.most else self.most), True, 0
            self._set(best)
            return best, probing

    def observe(self, key: Hashable, threads: int, seconds: float, probing: bool = False) -> None:
        """A one-token pass of model ``key`` with ``threads`` threads took ``seconds``."""
        with self._lock:
            record = self._records.setdefault(key, _Record())
            old = record.estimate.get(threads)
            new = seconds if old is None or seconds < old else old + SLOWER_WEIGHT * (seconds - old)
            record.estimate[threads] = new
            if probing:
                won = all(new <= s for n, s in record.estimate.items() if n != threads)
                record.pause = FIRST_PROBE if won else min(LONGEST_PAUSE, 2 * record.pause)

    @contextmanager
    def governed(self, key: Hashable, timed: bool) -> Iterator[int]:
        """Around a pass of model ``key``: choose its thread count and, for a ``timed`` one-token
        pass, report its time."""
        threads, probing = self.choose(key, timed)
        with self._lock:
            self.passes[threads] += 1
        t0 = time.perf_counter()
        yield threads
        if timed and self.enabled and self.held is None:
            self.observe(key, threads, time.perf_counter() - t0, probing)

    @contextmanager
    def hold(self) -> Iterator[int]:
        """All threads from here on, for every pass inside, and nothing timed: for measurements
        (the verify-cost table, ``decodekit profile``), which must not mix thread counts."""
        with self._lock:
            self._sync()
            outer = self.held
            self.held = outer or self.most
            self._set(self.held)
        try:
            yield self.held
        finally:
            with self._lock:
                self.held = outer

    def full_count(self) -> int:
        """The count the governor uses when the machine is quiet: what a measurement keyed by the
        thread count should be filed under."""
        with self._lock:
            return self._sync() if self.current is None else self.most


#: The process's governor: thread contention is a property of the machine.
GOVERNOR = ThreadGovernor(enabled=os.environ.get("DECODEKIT_THREAD_GOVERNOR", "1") != "0", busy_elsewhere=BusyElsewhere())
