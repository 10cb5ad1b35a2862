"""The server's scheduler: request slots, a bounded waiting queue, one batcher for all passes.

Each slot is an :class:`..engine.Engine` over its own clone of the model (its own cache, and
its own memory of what speculative methods learn). A running request decodes in its slot as a
member of one :class:`..models.batching.PassBatcher`, on the thread that runs every slot's forward
passes together: continuous batching with the engine's decode loop unchanged, so every method
(speculative ones included) serves concurrent requests, and a request's output does not depend on
what else runs (the kernels compute each row on its own), except a speculative method's under an
evicting cache (``sink:``, ``h2o:``, ``snapkv:``), where the passes the controller sizes, from the
batch too, decide what is evicted (as the README says).

A prompt that starts like what an idle slot holds reads only the rest there (a chat's next turn);
what a slot held before another prompt overwrote it goes to the prompt cache in host memory
(:mod:`.prompt_cache`), from which a later prompt that starts the same way starts instead.

Admission: at most ``max_batch`` requests run and ``max_queue`` wait; past that a request is
refused at once (:class:`Overloaded`, HTTP 503 with ``Retry-After``) rather than left to wait
without bound. A cancelled request (its client went away) stops at its next step and frees its
slot.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine import Engine
from ..engine.core import Generation
from ..engine.stops import shown_tokens
from ..errors import DecodeKitError, InvalidParameter
from ..models import LoadedModel
from ..models.batching import PassBatcher
from ..speculative.drafters.base import give_features, kept_features
from . import MAX_BATCH, MAX_QUEUE, PROMPT_CACHE_MIB
from .prompt_cache import PromptCache


class Overloaded(DecodeKitError):
    """Every slot is busy and the waiting queue is full."""


class ShuttingDown(DecodeKitError):
    """The server is shutting down: :meth:`Scheduler.cancel_all` has stopped every choice."""


@dataclass(eq=False)  # each job is itself (a set member), whatever its fields
class Job:
    """One choice of one request, tokenised and checked, ready to run in a slot."""

    prompt_ids: list[int]
    method: str
    params: dict[str, Any]  # sampler parameters and method options
    max_new_tokens: int
    stop: list[str] = field(default_factory=list)
    on_text: Callable[[str], None] | None = None  # called as the choice decodes (on the pass thread)
    top_logprobs: int | None = None  # None: no log-probabilities
    ignore_eos: bool = False
    constraint: dict | None = None  # structured output (see samplers/constraint.py)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None


@dataclass
class Outcome:
    generation: Generation
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None  # per token: (its logprob, top alternatives)
    queued_s: float


def token_logprobs(backend, prompt_ids: list[int], tokens: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """The model's own log-probability of each generated token (before temperature or truncation)
    and its ``top`` most likely alternatives, from one teacher-forced pass over prompt + answer. Under
    a cache that drops entries as a request goes on (``sink:``, ``h2o:``, ``snapkv:``), one pass would
    not drop them as decoding did: there the prompt's read and one step a token run again, as plain
    decoding ran them, so the values are those of the cache that chose the tokens in plain decoding
    (a speculative method's passes evict otherwise; its output may differ there, as documented)."""
    if not tokens:
        return []
    policy = getattr(backend, "kv_policy", None)
    if policy is not None and policy.evicts():
        steps = [backend.prefill(prompt_ids)] + [backend.step(torch.tensor([token])) for token in tokens[:-1]]
        logits = torch.cat(steps)
    else:
        backend.reset(1)
        logits = backend.append(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    best = torch.topk(logprobs, top, dim=-1) if top else None
    rows = []
    for i, value in enumerate(chosen):
        alternatives = list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else []
        rows.append((value, alternatives))
    return rows


class Scheduler:
    """Slots, admission and the shared batcher for one loaded model."""

    def __init__(self, model: LoadedModel, *, max_batch: int = MAX_BATCH, max_queue: int = MAX_QUEUE,
                 passes_on_caller: bool = False, prompt_cache_mib: float = PROMPT_CACHE_MIB):
        """``passes_on_caller``: the passes wait for a thread to call ``self.batcher.serve`` (the
        main thread, in ``decodekit serve``) instead of running on a thread of their own.
        ``prompt_cache_mib``: the prompt cache's budget (0: none)."""
        self.model = model
        self.prompt_cache = PromptCache(int(prompt_cache_mib * 2**20)) if prompt_cache_mib > 0 else None
        self.batcher = PassBatcher(own_thread=not passes_on_caller)
        self.batching = getattr(model.backend, "batch_key", None) is not None
        # a backend that cannot batch its passes serves one request at a time
        self.max_batch = max_batch if self.batching else 1
        self.max_queue = max_queue
        self._free: list[Engine] = []  # idle slots; each cache still holds its last request (kept_ids)
        backends = [model.backend.clone()]
        # every slot's cache starts as this first clone's: refuse, before making the others, the
        # slots whose caches would take more memory than the machine has left
        backends[0].check_rows(self.max_batch, remedy=f"ask for a smaller --max-batch (each of its {self.max_batch} "
                                                       "slots has a cache of its own)")
        backends += [model.backend.clone() for _ in range(self.max_batch - 1)]
        for backend in backends:
            if self.batching:
                backend.batcher = self.batcher
            self._free.append(Engine(LoadedModel(backend, model.tokenizer, model.name)))
        self.prefix_tokens = 0  # prompt tokens taken from a slot's cache or the prompt cache instead of being read again
        self._lock = threading.Lock()
        self._running: set[Job] = set()  # the choices decoding in a slot
        self._stopped = False  # cancel_all or close was called: nothing new starts
        # the choices admitted that wait for a slot, oldest first, with the futures their callers hold:
        # here, not in the pool's queue, so that one cancelled is dropped at once, memory and all
        self._queued: dict[Job, Future[Outcome]] = {}

    @property
    def running(self) -> int:
        """Choices decoding in a slot."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Choices admitted that wait for a slot."""
        return len(self._queued)

    def submit(self, jobs: list[Job]) -> list[Future[Outcome]]:
        """Queue the choices of one request together, or refuse them all (:class:`Overloaded`)."""
        room = self.max_batch + self.max_queue
        if len(jobs) > room:  # never fits, however long the client waits: not a 503 to retry
            raise InvalidParameter(f"n={len(jobs)} choices exceed what this server holds at once ({self.max_batch} "
                                   f"running + {self.max_queue} waiting)", param="n")
        with self._lock:
            if self._stopped:  # (a request read while the server stopped its answers: refused with them)
                raise ShuttingDown("the server is shutting down")
            if self.running + self.waiting + len(jobs) > room:
                raise Overloaded(f"the server is busy ({self.running} requests running, {self.waiting} waiting); "
                                 "retry shortly")
            futures: list[Future[Outcome]] = [Future() for _ in jobs]
            self._queued.update(zip(jobs, futures))
            self._dispatch()
        return futures

    def _dispatch(self) -> None:
        """Start the waiting choices, oldest first, while slots are free (called with the lock held)."""
        while self._queued and self._free:
            job = next(iter(self._queued))
            future = self._queued.pop(job)
            if not future.set_running_or_notify_cancel():  # its caller cancelled the future meanwhile
                continue
            engine = self._take_slot(job.prompt_ids)
            self._running.add(job)
            job.started = time.perf_counter()
            self.batcher.start(functools.partial(self._run, job, engine, future))

    def _take_slot(self, prompt_ids: list[int]) -> Engine:
        """The idle slot whose cache shares the longest prefix with the prompt; of slots that share
        as much, the one freed first, so the caches used last stay (called with the lock held, where
        one is free)."""
        shared, best = max((e.model.backend.shared_prefix(prompt_ids), -i) for i, e in enumerate(self._free))
        self.prefix_tokens += shared
        return self._free.pop(-best)

    def _from_prompt_cache(self, prompt_ids: list[int], engine: Engine) -> None:
        """Before a prompt is read in this slot: what the slot holds beyond the prompt's shared
        prefix goes to the prompt cache (the prompt would overwrite it), and where a cached prefix
        shares more with the prompt than that, the part it shares is copied into the slot, to be
        read no further (not the whole entry: its rest would be overwritten at once)."""
        cache, backend = self.prompt_cache, engine.model.backend
        if cache is None:
            return
        own, kept = backend.shared_prefix(prompt_ids), backend.kept_ids
        if kept and own < len(kept) and not cache.covers(kept):
            snapshot = backend.snapshot(max_bytes=cache.budget_bytes)
            if snapshot is not None:  # with the features of its positions, where an EAGLE request left them
                cache.put(dataclasses.replace(snapshot, features=kept_features(backend, snapshot.ids)))
        entry, shared = cache.longest(prompt_ids, beyond=own)
        if entry is not None:
            backend.restore(entry, shared)
            if entry.features is not None:
                give_features(backend, entry.ids[:shared], entry.features[:shared])
            with self._lock:
                self.prefix_tokens += shared - own

    def cancel(self, jobs: list[Job]) -> None:
        """Stop these choices: a running one at its next step or between its prompt's passes, a
        waiting one before it starts, its queue place given back now (for the next client)."""
        with self._lock:
            waited = [(job, self._queued.pop(job)) for job in jobs if job in self._queued]
            for job in jobs:
                job.cancelled.set()
        for job, future in waited:  # never started: answered now (outside the lock: callbacks run here),
            if future.set_running_or_notify_cancel():  # unless its caller cancelled the future itself
                future.set_result(Outcome(Generation.cancelled(), None, time.perf_counter() - job.submitted))

    def cancel_all(self) -> None:
        """Stop every choice, running or waiting, and refuse new ones (the server shutting down)."""
        with self._lock:
            self._stopped = True
            jobs = [*self._queued, *self._running]
        self.cancel(jobs)

    def _run(self, job: Job, engine: Engine, future: Future[Outcome]) -> None:
        """Decode a choice in its slot, give the slot back (the next waiting choice starts), then
        answer its future: a caller that submits again at once finds the slot free."""
        try:
            self._from_prompt_cache(job.prompt_ids, engine)
            outcome = self._decode(job, engine)
        except BaseException as err:  # handed to the caller, whatever it is (nothing is left hanging)
            self._release(job, engine)
            future.set_exception(err)
            return
        self._release(job, engine)
        future.set_result(outcome)

    def _release(self, job: Job, engine: Engine) -> None:
        with self._lock:
            self._free.append(engine)
            self._running.discard(job)
            self._dispatch()

    def _decode(self, job: Job, engine: Engine) -> Outcome:
        """The choice decoded in its slot's engine, with its log-probabilities where asked for."""
        generation = engine.generate(
            job.prompt_ids, method=job.method, max_new_tokens=job.max_new_tokens, stop=job.stop, chat=False,
            on_text=job.on_text, should_stop=job.cancelled.is_set, ignore_eos=job.ignore_eos,
            constraint=job.constraint, **job.params,
        )
        logprobs = None
        if job.top_logprobs is not None and generation.finish_reason != "cancelled":
            shown = shown_tokens(engine.model.tokenizer, generation.text, generation.tokens, generation.cut_off)
            logprobs = token_logprobs(engine.model.backend, job.prompt_ids, shown, job.top_logprobs)
            if shown:  # the teacher-forced pass read prompt and answer: the cache holds them, after a search too
                engine.model.backend.keep(job.prompt_ids + generation.tokens)
        if engine.model.backend.batch_size > 1:  # a search's candidates: their rows freed, not kept until the slot's next request
            engine.model.backend.reset()
        return Outcome(generation, logprobs, job.started - job.submitted)

    def close(self) -> None:
        """Stop: what waits is dropped (its futures cancelled), what runs finishes on its own, and
        nothing new is taken."""
        with self._lock:
            self._stopped = True
            waiting, self._queued = list(self._queued.values()), {}
        for future in waiting:
            future.cancel()
        self.batcher.close()
