"""Running a sweep's independent units on a Ray cluster (``decodekit bench --ray``, ``eval --ray``).

Ray places the processes; this module only keeps every worker busy and recovers from lost ones.
Each worker is one Ray actor (:class:`Host`) that builds its payload once (loads its model, warms
its contestants up) and then runs one unit at a time: a benchmark question with all its
contestants, or one evaluation item. A unit goes to whichever worker is idle, in the order given.

When a worker's process dies, the unit it was running is put back at the front of the queue and a
new worker replaces the lost one; a unit's result is accepted once, from the one run that returned
it, so nothing is counted twice and the run ends with the same units it would have had without the
fault. An exception raised by the payload itself (a bad model path, a bug) is not a lost worker:
running it elsewhere would raise it again, so it ends the run as the same one-line error a
single-machine run gives.

``address``: ``None`` starts a private Ray instance on this machine's usable cores and stops it
at the end; ``"auto"`` joins the cluster this machine belongs to (``ray start``); anything else is
a cluster address. Workers on other machines need decodekit installed as on this one.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .errors import ClusterError, InvalidParameter
from .machine import usable_cores
from .options import check_int

INSTALL_HINT = "pip install 'decodekit[ray]'"
LOCAL_OBJECT_STORE = 256 * 1024 * 1024  # results are small; Ray's default takes 30% of the memory
_SETUP = object()  # the in-flight key of a worker's setup call
UNIT_LOSSES = 2  # workers one unit may lose before the run stops: that unit ends any worker it runs on


def import_ray():
    try:
        import ray
    except ImportError:
        raise InvalidParameter(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


#: An HTTP/2 client's connection preface and an empty SETTINGS frame: a gRPC server (Ray's GCS, a
#: Ray Client server) answers with a SETTINGS frame of its own (RFC 9113, section 3.4).
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
SETTINGS_FRAME = 0x04


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """An address of the form ``host:port`` (or ``ray://host:port``) must take a connection and
    answer as a gRPC server does: Ray itself retries an unreachable address, or another service's
    (a web server on that port), for minutes, printing its own warnings."""
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon or not port.isdigit():  # "auto", or a form Ray resolves itself
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as conn:
            conn.sendall(HTTP2_PREFACE)
            header = b""
            while len(header) < 9:  # the first frame's header
                part = conn.recv(9 - len(header))
                if not part:
                    break
                header += part
    except OSError as err:
        reason = f"no answer within {timeout_s:g} s" if isinstance(err, TimeoutError) else err.strerror or type(err).__name__
        raise ClusterError(f"could not reach the Ray cluster at {address!r}: {reason}") from None
    if len(header) < 9 or header[3] != SETTINGS_FRAME:
        raise ClusterError(f"{address!r} is not a Ray cluster: what listens there does not answer as Ray's gRPC "
                           "server does (the head's GCS port, 6379 by default, or ray://HOST:10001 for Ray Client)")


@contextmanager
def connected(address: str | None) -> Iterator[Any]:
    """The ``ray`` module, initialised for ``address`` (see the module docstring) for the block."""
    ray = import_ray()
    if ray.is_initialized():  # a caller (a test, a notebook) already chose the cluster
        yield ray
        return
    if address is not None:
        check_reachable(address)
    try:
        if address is None:
            # address="local": a new instance even where `ray start` left one or RAY_ADDRESS names one
            ray.init(address="local", num_cpus=usable_cores(), include_dashboard=False,
                     object_store_memory=LOCAL_OBJECT_STORE, logging_level=logging.WARNING, log_to_driver=False)
        else:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as err:
        where = "a local Ray instance" if address is None else f"the Ray cluster at {address!r}"
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ClusterError(f"could not start or join {where}: {first}") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def host_description() -> dict[str, Any]:
    """Where a worker runs: enough to tell workers apart in a run's ``machines`` section."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "platform": platform.platform(),
            "usable_cores": usable_cores()}


class Host:
    """The body of one worker actor: builds its payload once, then runs units on it. A payload is
    any object with ``run(unit)`` and ``describe() -> dict``."""

    def __init__(self, threads: int) -> None:
        # As many threads as the worker reserved, not the machine's. torch reads the variable when
        # the payload first imports it; a payload that never does (a test's) need not pay for it.
        os.environ["OMP_NUM_THREADS"] = str(threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)
        self.threads = threads
        self.payload: Any = None

    def setup(self, make_payload: Callable[[], Any]) -> dict[str, Any]:
        self.payload = make_payload()
        return {**host_description(), "threads": self.threads, **self.payload.describe()}

    def run(self, unit: Any) -> Any:
        return self.payload.run(unit)


def lost_worker_errors(ray: Any) -> tuple[type[BaseException], ...]:
    """What ``ray.get`` raises for a call whose worker's process is gone. Ray's memory
    monitor kills a worker when its node runs low on memory, and the call then raises
    ``OutOfMemoryError``, not an actor error: such a worker is lost too, its unit run again elsewhere
    (a unit that needs more memory than any worker has ends the run after :data:`UNIT_LOSSES`)."""
    return tuple(getattr(ray.exceptions, name) for name in ("RayActorError", "OutOfMemoryError")
                 if hasattr(ray.exceptions, name))


@dataclass
class PoolSettings:
    workers: int | None = None  # None: as many as the cluster's CPUs hold at ``threads`` each
    threads: int = 1  # CPUs reserved by (and threads used by) each worker
    max_lost: int | None = None  # lost workers tolerated before the run stops; None: 2 per worker
    start_timeout_s: float = 600.0  # a worker not set up by then was never placed (no free CPUs) or hangs

    def validate(self) -> None:
        for name in ("workers", "threads", "max_lost"):
            value = getattr(self, name)
            if value is not None:
                check_int(f"--{name.replace('_', '-')}", value, 0 if name == "max_lost" else 1)


class Pool:
    """Workers on a connected Ray cluster, each holding one payload built by ``make_payload``.

    ``descriptions`` holds one entry per worker that finished its setup (replacements included),
    with the keys of the units it completed under ``"done"`` and ``"lost": True`` once its process
    died. ``lost`` counts every lost worker, those lost before their setup finished included."""

    def __init__(self, ray: Any, make_payload: Callable[[], Any], settings: PoolSettings) -> None:
        settings.validate()
        self.ray, self.make_payload, self.settings = ray, make_payload, settings
        self.actor_class = ray.remote(Host).options(num_cpus=settings.threads, max_restarts=0)
        cpus = int(ray.cluster_resources().get("CPU", 0))
        count = settings.workers or cpus // settings.threads
        if count < 1 or count * settings.threads > cpus:
            raise ClusterError(f"the Ray cluster has {cpus} CPUs: {max(count, 1)} worker(s) of {settings.threads} "
                               "thread(s) do not fit; lower --workers" + (" or --threads" if settings.threads > 1 else ""))
        self.max_lost = settings.max_lost if settings.max_lost is not None else 2 * count
        self.lost = 0
        self._lost_by_unit: dict[Any, int] = {}  # workers each unit's runs lost
        self.idle: list[Any] = []
        self.in_flight: dict[Any, tuple[Any, Any]] = {}  # object ref -> (actor, unit key or _SETUP)
        self.started: dict[Any, float] = {}  # setup ref -> when it was asked for
        self.created: dict[Any, Any] = {}  # setup ref -> a ref that is ready once Ray has created the actor
        self.descriptions: list[dict[str, Any]] = []
        self._description_of: dict[Any, dict[str, Any]] = {}
        try:
            for _ in range(count):
                self._start_worker()
            while self.in_flight:  # every worker set up (or replaced) before the first unit
                self._collect(on_result=None, pending=deque())
        except BaseException:
            self.close()
            raise

    def _start_worker(self) -> None:
        actor = self.actor_class.remote(self.settings.threads)
        created = actor.__ray_ready__.remote()  # asked first: an actor runs its calls in order
        ref = actor.setup.remote(self.make_payload)
        self.in_flight[ref], self.started[ref], self.created[ref] = (actor, _SETUP), time.monotonic(), created

    def map(self, units: Mapping[Hashable, Any], on_result: Callable[[Hashable, Any], None]) -> dict[Hashable, Any]:
        """Run every unit once, in the mapping's order as workers free up; ``on_result(key, result)``
        as each arrives (e.g. to checkpoint). Returns ``{key: result}``."""
        pending: deque = deque(units)
        results: dict[Hashable, Any] = {}

        def accept(key: Hashable, result: Any) -> None:
            if key in results:  # a unit is in flight on one worker at a time: this cannot happen
                raise ClusterError(f"unit {key!r} returned twice")
            results[key] = result
            on_result(key, result)

        try:
            while pending or any(key is not _SETUP for _, key in self.in_flight.values()):
                while pending and self.idle:
                    actor, key = self.idle.pop(), pending.popleft()
                    self.in_flight[actor.run.remote(units[key])] = (actor, key)
                self._collect(accept, pending)
        except BaseException:
            self.close()
            raise
        return results  # replacements still starting are not waited for: close() stops them

    def _collect(self, on_result: Callable[[Hashable, Any], None] | None, pending: deque) -> None:
        """Wait for one call to end and act on it: a finished unit is handed on, a finished setup
        frees its worker, a lost worker's unit goes back to the front of the queue."""
        ray = self.ray
        timeout = None
        if all(key is _SETUP for _, key in self.in_flight.values()):  # nothing else can end: bound the wait
            timeout = max(0.0, min(self.started.values()) + self.settings.start_timeout_s - time.monotonic())
        ready, _ = ray.wait(list(self.in_flight), num_returns=1, timeout=timeout)
        if not ready:
            raise ClusterError(f"no worker started within {self.settings.start_timeout_s:.0f} s (is the cluster "
                               "out of free CPUs, or does a node lack decodekit?)")
        ref = ready[0]
        actor, key = self.in_flight.pop(ref)
        self.started.pop(ref, None)
        self.created.pop(ref, None)
        try:
            value = ray.get(ref)
        except ray.exceptions.RayTaskError as err:  # the payload raised: the same error anywhere
            ray.kill(actor)
            raise (err.cause if isinstance(err.cause, BaseException) else err) from None
        except lost_worker_errors(ray) as err:  # the worker's process died
            self._replace(actor, key, pending, err)
            return
        if key is _SETUP:
            value["done"], value["lost"] = [], False
            self.descriptions.append(value)
            self._description_of[actor] = value
        else:
            self._description_of[actor]["done"].append(key)
            assert on_result is not None
            on_result(key, value)
        self.idle.append(actor)

    def _replace(self, actor: Any, key: Any, pending: deque, err: BaseException) -> None:
        # killed, in case it still runs (Ray says an actor it cannot reach is lost too): it would
        # hold its CPUs and its model, and no list of the pool's holds it any more for close()
        self.ray.kill(actor)
        self.lost += 1
        if actor in self._description_of:
            self._description_of[actor]["lost"] = True
        last = (str(err).strip().splitlines() or ["?"])[0]
        if key is not _SETUP:
            # a unit that loses every worker it runs on (a crash in a kernel, memory it cannot have on
            # that item) is said so after two, not given every worker the run may lose
            self._lost_by_unit[key] = self._lost_by_unit.get(key, 0) + 1
            if self._lost_by_unit[key] >= UNIT_LOSSES:
                raise ClusterError(f"work unit {key!r} lost {UNIT_LOSSES} workers (it ends any worker that runs "
                                   f"it); the last: {last}")
        if self.lost > self.max_lost:
            raise ClusterError(f"{self.lost} workers lost, more than the {self.max_lost} tolerated; the last: {last}")
        if key is not _SETUP:
            pending.appendleft(key)
        self._start_worker()

    def close(self, creation_timeout_s: float = 5.0) -> None:
        # An actor killed while Ray is still creating it can leave its worker process leased, holding
        # its CPU for good (the kill reaches the process before the creation task, which then never
        # comes): the next pool's workers never start. So workers still in their setup are first let
        # finish being created (a moment: Host's constructor only sets the thread count), not set up.
        creating = list(self.created.values())
        if creating:
            self.ray.wait(creating, num_returns=len(creating), timeout=creation_timeout_s)
        for actor in [*self.idle, *(a for a, _ in self.in_flight.values())]:
            self.ray.kill(actor)
        self.idle, self.in_flight, self.started, self.created = [], {}, {}, {}


def parse_address(value: str | None) -> str | None:
    """``--ray`` given alone means a local instance (None); otherwise the address as given."""
    return None if value in (None, "", "local") else value
