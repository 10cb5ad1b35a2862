"""Continuous batching of forward passes: many sequences, one pass over the weights.

Each request keeps decoding with its own backend clone (its own cache, drafter and sampler state),
exactly as it would alone. When a clone attached to a :class:`PassBatcher` runs a forward pass,
the pass waits for the other active sequences' passes and all of them run as one: projections
over every row together (the weights stream from memory once for the whole batch), rotary
embedding, cache writes and attention per sequence on its own cache. Sequences join and leave
between passes; a long prompt arrives as chunks (:data:`PREFILL_CHUNK` tokens a pass), so it never
stalls the others' decode steps for a whole prefill.

Batch invariance: every row is computed on its own in the kernels (see ``kernels/forward.c``),
so a request's tokens are the same whatever else shares its passes: plain, speculative (a
verification tree is just a pass of several rows) or sampled.

A request decodes either as a *member* started with :meth:`PassBatcher.start` (the server's
requests, and the answers that train drafters), or on a thread of its own inside
:meth:`PassBatcher.member`. A member is a greenlet on the pass thread itself: its pass switches
back to the pass loop, which switches into each member of a batch once the batch has run, so a
member's Python work between its passes (choosing its tokens, checking its stops) costs no thread
wake-up and no handoff of the interpreter's lock. With a thread per request, those handoffs cost
more than the work itself (see docs/BENCHMARKS.md, "Requests as greenlets"). Members leave their
greenlet only inside :meth:`PassBatcher.run`, from a pass, with torch in inference mode, and the
loop runs in inference mode too: what the greenlets share of their thread's state is the same at
every switch. A member must never block its thread waiting for another member (they all run on it).

When does a batch run? At once when every active sequence has a pass waiting (members always do
when the loop runs: none is still choosing its next tokens), else ``wait_s`` after the oldest pass
arrived, or when the waiting rows fill ``max_rows``. Waiting threads block, never spin: each
request thread on its own pass's event, set when that pass is done, and the pass thread on a
condition variable, woken only when a pass arrives that could start a batch (the first one, which
starts the wait, or the one that completes it), when a member is started, or when a request
leaves.

Which thread runs the passes matters. The kernels split each step over OpenMP threads, and
GNU OpenMP keeps a team of worker threads per thread that starts parallel work. Once the teams
hold more threads than there are cores, it stops letting idle workers spin and puts them to sleep
between parallel regions; waking them costs a fraction of a millisecond a region, a few hundred
regions a step (a pass on a second thread measured several times slower than on the main
thread). So the passes run on one thread (:meth:`PassBatcher.serve`, ideally called by the main
thread, whose team already exists), members run on it, and request threads keep their own torch
work on one thread (:func:`single_threaded`), so that they never start a team of their own.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import greenlet
import torch

from .kernels import MAX_ROWS

if TYPE_CHECKING:  # pragma: no cover
    from .native import NativeLlama

#: Prompt tokens a sequence sends per batched pass while its prompt is being read.
PREFILL_CHUNK = 32
#: Longest an idle pass thread sleeps between looks at its state: an arrival or a close wakes it at
#: once; this only bounds a wake-up that was missed.
IDLE_WAIT_S = 0.5


def single_threaded() -> None:
    """For a thread that decodes a request while another runs its passes: its own torch work
    (sampling, drafting) on this thread alone, starting no OpenMP team (the thread count is a
    per-thread setting; the pass thread keeps its own)."""
    torch.set_num_threads(1)


@dataclass(eq=False)  # a pass is itself (the queue removes passes by identity), never equal to another
class _Pass:
    backend: "NativeLlama"
    tokens: torch.Tensor  # [k]
    positions: torch.Tensor  # [k]
    visible: torch.Tensor | None  # [k, start + k] or None: every cached key
    start: int
    last_only: bool
    key: object  # the backend's batch_key: passes of the same layer kernels (one model) can share a batch
    arrived: float = field(default_factory=time.perf_counter)
    output: tuple[torch.Tensor, torch.Tensor] | None = None  # logits, features
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)  # set by the pass thread (a thread's pass)
    member: greenlet.greenlet | None = None  # a started member's pass: switched back into when done
    work: Callable[[], Any] | None = None  # a pass run on its own (PassBatcher.take_turn): its whole job


class _Member(greenlet.greenlet):
    """A member started by :meth:`PassBatcher.start`: a greenlet on its batcher's pass thread."""

    def __init__(self, run: Callable[[], None], batcher: "PassBatcher"):
        super().__init__(run)
        self.batcher = batcher


class PassBatcher:
    """Gathers the forward passes of the sequences attached to it and runs them together, all on
    one thread: a thread of its own started at the first pass, or, with ``own_thread=False``,
    the one that calls :meth:`serve` (passes wait for it). A sequence is attached either as a
    member started on that thread (:meth:`start`: no thread of its own) or as a thread of its
    own that decodes inside :meth:`member`.

    ``max_rows``: most rows in one pass (the kernels' few-row limit for the ``exact`` numerics);
    ``wait_s``: longest a pass waits for the other sequences."""

    def __init__(self, max_rows: int = MAX_ROWS, wait_s: float = 0.005, own_thread: bool = True):
        self.max_rows, self.wait_s, self.own_thread = max_rows, wait_s, own_thread
        self._cond = threading.Condition()
        self._waiting: list[_Pass] = []
        self._active = 0
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()  # the own thread's end (close)
        self._last_end = 0.0  # when the last batch finished: its sequences need a moment to come back
        self.passes = 0  # batched passes run (for metrics and tests)
        self.rows = 0  # rows they carried
        self._last_batch: dict[int, int] = {}  # the last batch: rows per sequence (by backend id)
        self._arrivals: list[tuple[Callable[[], Any], Future]] = []  # members started, not yet begun
        self._hub: greenlet.greenlet | None = None  # the pass loop's greenlet while it runs

    def start(self, work: Callable[[], Any]) -> Future:
        """Run ``work`` as a member on the pass thread, as a greenlet (see the module docstring): it
        counts as active until it returns, and its passes join the batches. Returns the future of
        its result (or of what it raised). ``work`` must not block its thread waiting for another
        member (a lock held by one, say): they all run on it."""
        future: Future = Future()
        with self._cond:
            if self._closed.is_set():  # its thread ends once no member is left: this one would never run
                raise RuntimeError("this batcher is closed")
            self._ensure_thread()
            self._active += 1
            self._arrivals.append((work, future))
            self._cond.notify()
        return future

    @contextlib.contextmanager
    def member(self) -> Iterator[None]:
        """Count the calling request as active while it decodes: a batch waits for its passes."""
        with self._cond:
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify()  # a batch may have been waiting for this one

    @property
    def active(self) -> int:
        return self._active

    def others(self, backend: "NativeLlama") -> tuple[int, int]:
        """The other sequences of the last batch, and the rows they carried, as ``backend`` sees
        the batches it joins (what a speculation budget weighs its own rows against)."""
        last = self._last_batch
        mine = id(backend) in last
        return len(last) - mine, sum(last.values()) - last.get(id(backend), 0)

    def run(self, backend: "NativeLlama", tokens: torch.Tensor, positions: torch.Tensor,
            visible: torch.Tensor | None, start: int, last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[k, V]`` (``[1, V]`` with ``last_only``) and features ``[k, D]`` of one
        sequence's pass, run with the others'."""
        job = _Pass(backend, tokens, positions, visible, start, last_only, backend.batch_key)
        current = greenlet.getcurrent()
        if isinstance(current, _Member) and current.batcher is self:
            job.member = current
        with self._cond:
            self._ensure_thread()
            self._waiting.append(job)
            # the pass thread needs to hear of a thread's first pass (its wait starts) and of the
            # one that fills the batch; it waits for a timeout in between (a member's pass is
            # already on the pass thread)
            if job.member is None and (len(self._waiting) == 1 or self._full()):
                self._cond.notify()
        if job.member is not None:
            self._hub.switch()  # the loop runs the batch, then switches back here
        else:
            job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.output is not None
        return job.output

    def take_turn(self, backend: "NativeLlama", rows: int, work: Callable[[], Any]) -> Any:
        """``work()``: a pass of ``backend`` over ``rows`` rows that no batch can take (a search's
        sequences), run for the calling member at once where it is the only request, else as a batch
        of its own after the passes waiting: where another request is active (its pass waiting, or its
        Python about to run after the last batch), it gets a turn first. A member whose passes never
        batch would otherwise hold the pass thread, and every other request with it, for its whole
        run. (A request on a thread of its own runs it at once: the others' passes are not on its
        thread.)"""
        current = greenlet.getcurrent()
        if not (isinstance(current, _Member) and current.batcher is self and self._active > 1):
            return work()
        job = _Pass(backend, torch.empty(rows), torch.empty(0), None, 0, False, object(), member=current, work=work)
        with self._cond:
            self._waiting.append(job)
        self._hub.switch()  # the loop runs the passes waiting before it, then this one, then switches back
        if job.error is not None:
            raise job.error
        return job.output

    def run_here(self, works: list[Callable[[], Any]]) -> list[Any]:
        """Run ``works`` as members on the calling thread until every one has returned (a batcher
        made with ``own_thread=False``): their results, in order, or the error of the first in that
        order that failed."""
        if self.own_thread:  # (checked before any work starts: none is left running on a failed call)
            raise RuntimeError("this batcher runs its passes on a thread of its own")
        futures = [self.start(work) for work in works]
        if not futures:
            return []
        all_done, left = threading.Event(), [len(futures)]

        def one_done(_: Future) -> None:  # called on this thread, as a member ends
            left[0] -= 1
            if not left[0]:
                all_done.set()

        for future in futures:
            future.add_done_callback(one_done)
        self.serve(all_done)
        return [future.result() for future in futures]

    def _ensure_thread(self) -> None:
        """Start the batcher's own pass thread if it has one and it is not running (lock held); a
        closed batcher's thread that has ended is not started again: a pass would wait for ever."""
        if self.own_thread and self._closed.is_set() and not (self._thread and self._thread.is_alive()):
            raise RuntimeError("this batcher is closed")
        if self._thread is None and self.own_thread:
            self._thread = threading.Thread(target=self._loop, args=(self._closed,), name="decodekit-passes",
                                            daemon=True)
            self._thread.start()

    def serve(self, until: threading.Event) -> None:
        """Run the passes on the calling thread until ``until`` is set (a batcher made with
        ``own_thread=False``; ``decodekit serve`` calls it from the main thread). Members still
        decoding then stay suspended, their futures unanswered, until a later call runs them on."""
        if self.own_thread:
            raise RuntimeError("this batcher runs its passes on a thread of its own")
        self._loop(until)

    def close(self) -> None:
        """Take no new members, and end the batcher's own thread once no request is left to run
        passes for (a scheduler closed: each thread left would wake twice a second for ever)."""
        with self._cond:  # (under the lock: a member started now either runs or is refused)
            self._closed.set()
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and not self._active:
            thread.join(timeout=10)

    def stop_waiting(self) -> None:
        """Wake :meth:`serve` (to see that its event is set)."""
        with self._cond:
            self._cond.notify_all()

    def _finished(self, until: threading.Event | None) -> bool:
        """Whether the loop ends: ``until`` set, and for the batcher's own thread (closed) no request
        left whose passes it would run."""
        return until is not None and until.is_set() and not (self.own_thread and (self._active or self._waiting))

    def _loop(self, until: threading.Event | None = None) -> None:
        self._hub = greenlet.getcurrent()
        try:
            # the members' state on this thread: inference mode at every switch (see the module docstring)
            with torch.inference_mode():
                while not self._finished(until):
                    with self._cond:
                        arrivals, batch = self._next()
                        while not arrivals and not batch and not self._finished(until):
                            oldest = max(self._waiting[0].arrived, self._last_end) if self._waiting else None
                            self._cond.wait(IDLE_WAIT_S if oldest is None else max(0.0, oldest + self.wait_s - time.perf_counter()))
                            arrivals, batch = self._next()
                    for work, future in arrivals:  # each runs until its first pass (or its end)
                        _Member(self._member_body(work, future), self).switch()
                    if batch:
                        self._execute(batch)
        finally:
            self._hub = None

    def _next(self) -> tuple[list[tuple[Callable[[], Any], Future]], list[_Pass]]:
        """The members to begin, or else the next batch (lock held): members begin first, so that
        their first passes join the batch."""
        arrivals, self._arrivals = self._arrivals, []
        return arrivals, ([] if arrivals else self._ready())

    def _member_body(self, work: Callable[[], Any], future: Future) -> Callable[[], None]:
        def body() -> None:
            try:
                if future.set_running_or_notify_cancel():
                    future.set_result(work())
            except BaseException as err:  # the caller's, through the future
                future.set_exception(err)
                if isinstance(err, (KeyboardInterrupt, SystemExit, greenlet.GreenletExit)):
                    raise  # out of the pass loop too, at once: not after every other member has ended
            finally:
                with self._cond:
                    self._active -= 1
                    self._cond.notify()  # a thread's batch may have been waiting for this one
        return body

    def _full(self) -> bool:
        """Whether the waiting passes make a batch without waiting longer: every active sequence's
        pass is in, or they fill ``max_rows``. Called with the lock held."""
        return len(self._waiting) >= self._active or sum(len(p.tokens) for p in self._waiting) >= self.max_rows

    def _ready(self) -> list[_Pass]:
        """The next batch to run, taken off the queue (empty: not yet). Called with the lock held."""
        if not self._waiting:
            return []
        # the wait counts from when the oldest pass could first have run: a pass that arrived while
        # a batch was running waits for that batch's sequences to come back, not from its arrival
        since = time.perf_counter() - max(self._waiting[0].arrived, self._last_end)
        if not (self._full() or since >= self.wait_s):
            return []
        batch, taken, key = [], 0, self._waiting[0].key
        for job in list(self._waiting):  # oldest first; a pass is never split
            if job.key is not key:
                continue
            if batch and taken + len(job.tokens) > self.max_rows:
                break
            batch.append(job)
            taken += len(job.tokens)
            self._waiting.remove(job)
        return batch

    def _execute(self, batch: list[_Pass]) -> None:
        try:
            if batch[0].work is not None:  # a pass of its own (its key is no other pass's)
                batch[0].output = batch[0].work()
            else:
                outputs = batch[0].backend.forward_batch(batch)
                for job, output in zip(batch, outputs):
                    job.output = output
        except BaseException as err:  # every waiting request hears of it
            for job in batch:
                job.error = err
        with self._cond:
            self._last_end = time.perf_counter()
            self.passes += 1
            self.rows += sum(len(p.tokens) for p in batch)
            self._last_batch = {id(p.backend): len(p.tokens) for p in batch}
        for job in batch:
            if job.member is None:
                job.done.set()
        for job in batch:  # each member's Python runs now, until its next pass (or its end)
            if job.member is not None:
                job.member.switch()
