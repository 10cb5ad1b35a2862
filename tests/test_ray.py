"""Sweeps on a Ray cluster (decodekit.cluster, bench --ray, eval --ray): a local Ray instance with two
worker processes, started here and torn down at the end. A run on the cluster must give every token
sequence a single-machine run gives, in files of the same schema, and a worker killed mid-run must
leave every question done exactly once."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from decodekit.bench import cli as bench_cli
from decodekit.bench.distributed import execute_on_ray
from decodekit.bench.execution import execute
from decodekit.bench.report import compare
from decodekit.bench.results import validate_results
from decodekit.cluster import Pool, PoolSettings
from decodekit.errors import ClusterError, DecodeKitError, InvalidParameter
from decodekit.eval.distributed import evaluate_on_ray
from decodekit.eval.runner import EvalConfig, evaluate
from decodekit.eval.tasks import load_task
from decodekit.models.tiny import tiny_model

ray = pytest.importorskip("ray")

from test_bench import parse, write_questions  # noqa: E402

TINY = functools.partial(tiny_model, seed=0, scale=2.0)  # what every worker loads


@pytest.fixture(scope="module")
def cluster():
    """Two worker CPUs on loopback; this module's payload classes travel by value (workers cannot import tests)."""
    import logging

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=128 * 1024 * 1024,
             logging_level=logging.WARNING, log_to_driver=False)
    yield ray
    ray.shutdown()


def worker_pids(task: str | None = None) -> list[int]:
    """Processes of this test's Ray actors running ``Host`` (``ray::Host`` idle, ``ray::Host.run``
    during a unit): descendants of this process, so another test run's cluster on the same machine
    is never touched."""
    title = "ray::Host" + (f".{task}" if task else "")
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
            except OSError:
                continue
            if args == title and descends_from_this_process(int(entry.name)):
                found.append(int(entry.name))
    return found


def descends_from_this_process(pid: int) -> bool:
    """Whether this process is among ``pid``'s ancestors (a private Ray instance's raylet, and so its
    workers, are started under the driver)."""
    me = os.getpid()
    while pid > 1:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return False
        pid = int(fields[1])  # the parent's pid (after the state field)
        if pid == me:
            return True
    return False


def workers_gone(within: float = 10.0) -> bool:
    """Whether every worker process of this test's actors has exited within ``within`` seconds
    (a killed actor's process takes a moment to go)."""
    deadline = time.monotonic() + within
    while worker_pids():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def kill_a_worker(busy_within: float = 0.5) -> int:
    """SIGKILL a worker: one in the middle of a unit if one is within ``busy_within`` seconds, else an
    idle one (the driver finds it dead when it hands it the next unit)."""
    deadline = time.monotonic() + busy_within
    while True:
        busy = worker_pids("run")
        if busy or time.monotonic() > deadline:
            break
        time.sleep(0.001)
    victims = busy or worker_pids()
    assert victims, "no worker process found"
    os.kill(victims[0], signal.SIGKILL)
    return victims[0]


class MidUnitKiller(threading.Thread):
    """Once ``trigger`` is set (say, by the first result), kills a worker in the middle of a unit,
    from beside the driver: the driver goes on handing out units meanwhile, so one is soon busy."""

    def __init__(self):
        super().__init__(daemon=True)
        self.trigger, self.killed = threading.Event(), None

    def run(self):
        self.trigger.wait()
        deadline = time.monotonic() + 30
        while self.killed is None and time.monotonic() < deadline:
            busy = worker_pids("run")
            if busy:
                os.kill(busy[0], signal.SIGKILL)
                self.killed = busy[0]
            time.sleep(0.0005)


def test_a_cluster_that_cannot_be_joined_is_one_line(monkeypatch):
    import decodekit.cluster as cluster_module

    class Unreachable:
        def is_initialized(self):
            return False

        def init(self, **kwargs):  # what ray.init raises for --ray auto with no cluster running
            raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to\nmore")

    monkeypatch.setattr(cluster_module, "import_ray", Unreachable)
    with pytest.raises(ClusterError, match=r"^could not start or join the Ray cluster at 'auto': Could not find any running Ray instance\. Please specify the one to connect to$"):
        with cluster_module.connected("auto"):
            pass


def test_an_address_that_takes_no_connection_is_one_line_at_once(monkeypatch):
    """Ray retries an unreachable head for minutes: a host:port that refuses, or that no name
    resolves, is refused before ray.init is asked."""
    import socket

    import decodekit.cluster as cluster_module

    class NeverAsked:
        def is_initialized(self):
            return False

        def init(self, **kwargs):
            raise AssertionError("ray.init was asked")

    monkeypatch.setattr(cluster_module, "import_ray", NeverAsked)
    with socket.socket() as closed:  # a port nothing listens on: bound, never listening
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
            with pytest.raises(ClusterError, match=f"^could not reach the Ray cluster at '{address}': Connection refused$"):
                with cluster_module.connected(address):
                    pass
    with pytest.raises(ClusterError, match="^could not reach the Ray cluster at 'no-such-host.invalid:6379': "):
        with cluster_module.connected("no-such-host.invalid:6379"):
            pass


# The pool on its own -------------------------------------------------------------------------------


class Doubler:
    """Unit 0 is quick and the rest take ``delay``: when unit 0 returns, the other worker is mid-unit.

    With a ``gate`` folder, each worker leaves a file there when set up, and the slow units wait
    (up to a minute) until ``setups`` workers have: so a replacement is sure to join before the
    survivor could finish the queue alone, however long Ray takes to start it on a busy machine."""

    def __init__(self, delay: float = 0.0, gate: Path | None = None, setups: int = 0):
        self.delay, self.gate, self.setups = delay, gate, setups
        self.deadline = time.monotonic() + 60  # one minute in all per worker, not per unit
        if gate is not None:
            (gate / f"setup-{os.getpid()}").touch()

    def describe(self):
        return {"kind": "doubler"}

    def run(self, unit):
        while unit and self.gate is not None and len(list(self.gate.iterdir())) < self.setups \
                and time.monotonic() < self.deadline:
            time.sleep(0.01)
        time.sleep(self.delay if unit else 0.01)
        return {"value": 2 * unit, "pid": os.getpid()}


class BrokenSetup:
    def __init__(self):
        raise InvalidParameter("model 'nowhere' not found")


class SlowSetup(Doubler):
    def __init__(self, seconds: float):
        time.sleep(seconds)


class BrokenUnit(Doubler):
    def run(self, unit):
        raise InvalidParameter(f"unit {unit} is bad")


def test_the_pool_runs_every_unit_once_on_both_workers(cluster):
    pool = Pool(cluster, functools.partial(Doubler, 0.05), PoolSettings())
    seen = []
    try:
        results = pool.map({k: k for k in range(10)}, lambda key, value: seen.append(key))
    finally:
        pool.close()
    assert sorted(seen) == list(range(10))
    assert {k: v["value"] for k, v in results.items()} == {k: 2 * k for k in range(10)}
    assert len(pool.descriptions) == 2 and len({d["pid"] for d in pool.descriptions}) == 2  # cluster CPUs / 1 thread
    assert sorted(k for d in pool.descriptions for k in d["done"]) == list(range(10)) and all(d["done"] for d in pool.descriptions)
    assert all(d["kind"] == "doubler" and d["threads"] == 1 for d in pool.descriptions)


def test_a_worker_killed_mid_unit_is_replaced_and_its_unit_runs_again(cluster, tmp_path):
    pool = Pool(cluster, functools.partial(Doubler, 0.5, tmp_path, setups=3), PoolSettings(workers=2))
    arrivals: list[int] = []
    killed: list[int] = []

    def arrived(key, value):
        arrivals.append(key)
        if not killed:
            killed.append(kill_a_worker(busy_within=5))

    try:
        results = pool.map({k: k for k in range(8)}, arrived)
    finally:
        pool.close()
    assert sorted(arrivals) == list(range(8))  # every unit once: none lost, none twice
    assert {k: v["value"] for k, v in results.items()} == {k: 2 * k for k in range(8)}
    assert killed[0] not in {v["pid"] for v in results.values()}  # the killed worker's unit ran elsewhere
    assert len(pool.descriptions) == 3 and [d["lost"] for d in pool.descriptions].count(True) == 1
    lost = next(d for d in pool.descriptions if d["lost"])
    assert lost["pid"] == killed[0] and lost["done"] == []  # it was killed in its first slow unit
    assert sorted(k for d in pool.descriptions for k in d["done"]) == list(range(8)) and pool.lost == 1


def test_lost_workers_up_to_the_tolerated_number_do_not_end_the_run(cluster):
    """max_lost is how many lost workers a run tolerates: with 1, one lost worker is replaced and the run ends whole."""
    pool = Pool(cluster, functools.partial(Doubler, 0.2), PoolSettings(workers=1, max_lost=1))
    killed: list[int] = []
    try:
        results = pool.map({k: k for k in range(4)}, lambda key, value: killed or killed.append(kill_a_worker()))
    finally:
        pool.close()
    assert {k: v["value"] for k, v in results.items()} == {k: 2 * k for k in range(4)} and pool.lost == 1


def test_units_are_handed_out_in_the_order_given(cluster):
    """One worker runs the units one at a time, so they arrive in the mapping's order."""
    pool = Pool(cluster, Doubler, PoolSettings(workers=1))
    order = [3, 1, 4, 0, 2]
    arrivals: list[int] = []
    try:
        pool.map({k: k for k in order}, lambda key, value: arrivals.append(key))
    finally:
        pool.close()
    assert arrivals == order


def test_more_lost_workers_than_tolerated_end_the_run_with_one_line(cluster):
    pool = Pool(cluster, functools.partial(Doubler, 0.2), PoolSettings(workers=1, max_lost=0))
    try:
        with pytest.raises(ClusterError, match="1 workers lost, more than the 0 tolerated"):
            pool.map({k: k for k in range(4)}, lambda key, value: kill_a_worker())
    finally:
        pool.close()


def test_an_error_of_the_payload_is_raised_as_itself_not_retried(cluster):
    with pytest.raises(InvalidParameter, match="^model 'nowhere' not found$"):
        Pool(cluster, BrokenSetup, PoolSettings(workers=1))
    pool = Pool(cluster, BrokenUnit, PoolSettings(workers=1))
    try:
        with pytest.raises(InvalidParameter, match="^unit 0 is bad$"):
            pool.map({0: 0}, lambda key, value: None)
        assert pool.lost == 0
    finally:
        pool.close()
    assert workers_gone()  # neither failed setup nor failed unit leaves a worker holding its CPU


def test_workers_that_do_not_fit_the_cluster_are_one_line(cluster):
    for settings, advice in ((PoolSettings(workers=3), "lower --workers"),  # (one thread each: --threads cannot go lower)
                             (PoolSettings(threads=4), "lower --workers or --threads"),
                             (PoolSettings(workers=2, threads=2), "lower --workers or --threads")):
        with pytest.raises(ClusterError, match=f"^the Ray cluster has 2 CPUs: .* do not fit; {advice}$"):
            Pool(cluster, Doubler, settings)


def test_a_worker_that_never_starts_ends_the_run_with_one_line(cluster):
    with pytest.raises(ClusterError, match="no worker started within 1 s"):
        Pool(cluster, functools.partial(SlowSetup, 30), PoolSettings(workers=1, start_timeout_s=1))
    assert workers_gone()  # the pool stopped the worker it gave up on
    deadline = time.monotonic() + 10
    while cluster.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cluster.available_resources().get("CPU") == 2  # and its CPU is free again


def test_the_local_instance_is_a_new_one_even_where_a_cluster_runs(monkeypatch):
    """``--ray`` alone must not join a cluster `ray start` left (ray.init() with no address would)."""
    import decodekit.cluster as cluster_module

    calls = []

    class FakeRay:
        def is_initialized(self):
            return False

        def init(self, **kwargs):
            calls.append(kwargs)

        def shutdown(self):
            calls.append("shutdown")

    monkeypatch.setattr(cluster_module, "import_ray", FakeRay)
    with cluster_module.connected(None):
        pass
    with cluster_module.connected("auto"):
        pass
    assert calls[0]["address"] == "local" and calls[0]["num_cpus"] >= 1 and calls[1] == "shutdown"
    assert calls[2]["address"] == "auto" and "num_cpus" not in calls[2]


def test_pool_settings_are_checked():
    for bad in (PoolSettings(workers=0), PoolSettings(threads=0), PoolSettings(max_lost=-1)):
        with pytest.raises(InvalidParameter):
            bad.validate()



def test_an_ipv6_address_in_brackets_is_tried_without_them():
    """``[::1]:6379`` is how an IPv6 head is written: the brackets are the address's spelling, not the host's name."""
    import socket

    from decodekit.cluster import check_reachable

    try:
        closed = socket.socket(socket.AF_INET6)
        closed.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with closed:
        address = f"[::1]:{closed.getsockname()[1]}"
        with pytest.raises(ClusterError, match=rf"^could not reach the Ray cluster at '{re.escape(address)}': Connection refused$"):
            check_reachable(address)


@pytest.mark.parametrize("answer, joined", [
    (b"HTTP/1.0 400 Bad request\r\n\r\n", False),  # a web server on the port
    (b"", False),  # one that closes at once
    (b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64", True),  # a gRPC server's SETTINGS
])
def test_an_address_where_no_grpc_server_answers_is_refused_at_once(answer, joined):
    """Ray retries another service's port for minutes, printing its own warnings: the address is
    refused in one line unless what listens there answers HTTP/2's preface with a SETTINGS frame."""
    import socket
    import threading

    from decodekit.cluster import check_reachable

    listener = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            received.append(conn.recv(64))
            conn.sendall(answer)

    server = threading.Thread(target=serve)
    server.start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        if joined:
            check_reachable(address)
        else:
            with pytest.raises(ClusterError, match=rf"^'{re.escape(address)}' is not a Ray cluster: "):
                check_reachable(address)
    finally:
        server.join(5)
        listener.close()
    assert received[0].startswith(b"PRI * HTTP/2.0")


def test_an_address_that_does_not_answer_in_time_is_said_so(monkeypatch):
    """A head that never answers (a firewall dropping packets) is told apart from one that refuses."""
    import decodekit.cluster as cluster_module

    def silent(address, timeout):
        raise TimeoutError("timed out")

    monkeypatch.setattr(cluster_module.socket, "create_connection", silent)
    with pytest.raises(ClusterError, match=r"^could not reach the Ray cluster at '10\.0\.0\.1:6379': no answer within 5 s$"):
        cluster_module.check_reachable("10.0.0.1:6379")


def test_a_ray_the_caller_initialised_is_used_as_it_is_and_left_running(monkeypatch):
    """Where the caller (a test, a notebook) has initialised Ray, its cluster is used: no second
    ray.init, and no shutdown at the end of the run."""
    import decodekit.cluster as cluster_module

    calls = []

    class Initialised:
        def is_initialized(self):
            return True

        def init(self, **kwargs):
            calls.append("init")

        def shutdown(self):
            calls.append("shutdown")

    monkeypatch.setattr(cluster_module, "import_ray", Initialised)
    for address in (None, "auto"):
        with cluster_module.connected(address) as ray:
            assert isinstance(ray, Initialised)
    assert calls == []

def test_ray_local_spelled_out_means_a_local_instance():
    """``--ray`` alone, ``--ray ''`` and ``--ray local`` start a private instance (None); anything else is an address."""
    from decodekit.cluster import parse_address

    assert parse_address(None) is None and parse_address("") is None and parse_address("local") is None
    assert parse_address("auto") == "auto" and parse_address("10.0.0.1:6379") == "10.0.0.1:6379"


def test_a_unit_that_ends_every_worker_it_runs_on_stops_the_run_naming_it():
    """One item that crashes its worker (a kernel's fault, memory it cannot have) went back to the
    queue each time, and each worker that took it died, until the run's whole allowance of lost workers
    was spent (12 workers started, each loading the model) and the cluster was blamed. After two, it
    is named; lost workers on other units still count against the allowance as before."""

    class Forever(set):
        def discard(self, unit):  # never cured
            pass

    fake = FakeRay(cpus=4)
    fake.die = Forever({2})
    pool = Pool(fake, Echo, PoolSettings(workers=4))
    with pytest.raises(ClusterError, match=r"^work unit 2 lost 2 workers \(it ends any worker that runs it\)"):
        pool.map({i: i for i in range(6)}, lambda key, value: None)
    assert pool.lost == 2 and len(fake.actors) <= 6
    # a lost worker is killed when it is replaced (in case Ray only lost sight of it: it would hold its
    # CPUs and model, and close() no longer knows it), before the pool waits for its replacement
    kinds = [event[0] for event in fake.events]
    assert "kill" in kinds and kinds.index("kill") < len(kinds) - 1 - kinds[::-1].index("wait")


def test_no_lost_worker_tolerated_is_a_valid_setting():
    """--max-lost 0 means any lost worker ends the run: a setting, not an error (negative ones are refused)."""
    PoolSettings(max_lost=0).validate()
    PoolSettings(workers=1, threads=1).validate()


def test_a_worker_sets_its_thread_count_for_its_payload(monkeypatch):
    """Each worker runs as many threads as CPUs it reserved (--threads), not the machine's: the
    variable torch reads at import, and torch's own count where torch is loaded already."""
    import torch

    from decodekit.cluster import Host

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # restored after the test
    before = torch.get_num_threads()
    try:
        host = Host(3)
        assert os.environ["OMP_NUM_THREADS"] == "3" and torch.get_num_threads() == 3 and host.threads == 3
    finally:
        torch.set_num_threads(before)


# The pool's bookkeeping on a stand-in for Ray (no processes): what it waits for, replaces and stops.


class FakeRay:
    """Enough of Ray for :class:`Pool`: every call runs at once in this process; ``wait`` hands back
    the first ref asked for. ``die`` lists unit keys whose first run loses its worker. Records each
    wait (its timeout and what it waited for) and each kill."""

    class exceptions:
        class RayTaskError(Exception):
            def __init__(self, cause):
                super().__init__(str(cause))
                self.cause = cause

        class RayActorError(Exception):
            pass

        class OutOfMemoryError(Exception):  # Ray's memory monitor killed the worker: not an actor error
            pass

    def __init__(self, cpus: int = 2, die=(), oom=()):
        self.cpus, self.die, self.oom = cpus, set(die), set(oom)
        self.values: dict = {}  # ref -> ("ok", value) or ("err", exception)
        self.kinds: dict = {}  # ref -> "created", "setup" or "run"
        self.actors: list = []
        self.waits: list[tuple] = []
        self.events: list[tuple] = []

    def cluster_resources(self):
        return {"CPU": self.cpus}

    def _ref(self, kind, call, *args):
        ref = object()
        self.kinds[ref] = kind
        try:
            self.values[ref] = ("ok", call(*args))
        except (self.exceptions.RayActorError, self.exceptions.OutOfMemoryError) as err:
            self.values[ref] = ("err", err)
        except Exception as err:  # the payload's own error, as Ray wraps it
            self.values[ref] = ("err", self.exceptions.RayTaskError(err))
        return ref

    def remote(self, cls):
        fake = self

        class Method:
            def __init__(self, kind, call):
                self.kind, self.call = kind, call

            def remote(self, *args):
                return fake._ref(self.kind, self.call, *args)

        class Actor:
            def __init__(self, threads):
                self.threads = threads
                self.host = None
                fake.actors.append(self)
                self.__ray_ready__ = Method("created", lambda: True)
                self.setup = Method("setup", self._setup)
                self.run = Method("run", self._run)

            def _setup(self, make_payload):
                self.host = cls.__new__(cls)  # Host's body without touching this process's threads
                self.host.threads, self.host.payload = self.threads, None
                return self.host.setup(make_payload)

            def _run(self, unit):
                if unit in fake.die:
                    fake.die.discard(unit)
                    raise fake.exceptions.RayActorError("the worker died")
                if unit in fake.oom:
                    fake.oom.discard(unit)
                    raise fake.exceptions.OutOfMemoryError("1 worker(s) were killed due to the node running low on memory.\n...")
                return self.host.run(unit)

        class ActorClass:
            def options(self, **kwargs):
                return self

            def remote(self, threads):
                return Actor(threads)

        return ActorClass()

    def wait(self, refs, num_returns=1, timeout=None):
        self.waits.append((timeout, [self.kinds[r] for r in refs]))
        self.events.append(("wait", num_returns, tuple(refs)))
        return list(refs[:num_returns]), list(refs[num_returns:])

    def get(self, ref):
        status, value = self.values[ref]
        if status == "err":
            raise value
        return value

    def kill(self, actor):
        self.events.append(("kill", actor))


class Echo:
    def describe(self):
        return {"kind": "echo"}

    def run(self, unit):
        if unit == "bad":
            raise InvalidParameter("unit bad is bad")
        return unit


def test_a_pool_places_as_many_workers_as_the_cpus_hold_at_their_thread_count():
    """With no --workers, the pool starts cluster CPUs // --threads workers, each reserving --threads CPUs."""
    fake = FakeRay(cpus=4)
    pool = Pool(fake, Echo, PoolSettings(threads=2))
    assert len(pool.descriptions) == 2 and all(d["threads"] == 2 for d in pool.descriptions)
    assert pool.max_lost == 4  # two per worker by default


def test_the_wait_for_starting_workers_is_bounded_from_the_oldest_start(monkeypatch):
    """start_timeout_s counts from when a worker was asked for: while only setups are in flight, the
    wait ends when the oldest of them runs out of time (here asked at t=0 and t=100, waited at t=200)."""
    import decodekit.cluster as cluster_module

    clock = iter(range(0, 10**6, 100))
    monkeypatch.setattr(cluster_module.time, "monotonic", lambda: next(clock))
    fake = FakeRay()
    Pool(fake, Echo, PoolSettings(workers=2, start_timeout_s=600))
    assert fake.waits[0] == (0 + 600 - 200, ["setup", "setup"])


def test_a_unit_in_flight_is_waited_for_without_the_start_timeout():
    """A unit may take longer than a worker takes to start: once a unit is in flight beside a replacement
    still setting up, the wait is unbounded (the start timeout is for setups alone)."""
    fake = FakeRay(die={0})
    pool = Pool(fake, Echo, PoolSettings(workers=2, start_timeout_s=600))
    arrivals: list = []
    assert pool.map({k: k for k in range(4)}, lambda key, value: arrivals.append(key)) == {k: k for k in range(4)}
    assert sorted(arrivals) == [0, 1, 2, 3] and pool.lost == 1 and len(fake.actors) == 3
    mixed = [timeout for timeout, kinds in fake.waits if "run" in kinds and "setup" in kinds]
    assert mixed and all(timeout is None for timeout in mixed)
    assert all(timeout is not None for timeout, kinds in fake.waits if set(kinds) == {"setup"})


def test_an_error_of_the_payload_stops_every_worker_busy_or_idle():
    """A payload's error ends the run: every worker, the one that raised, those still running a unit and
    the idle ones, is stopped (none left holding its CPUs)."""
    fake = FakeRay(cpus=3)
    pool = Pool(fake, Echo, PoolSettings(workers=3))
    with pytest.raises(InvalidParameter, match="^unit bad is bad$"):
        pool.map({"bad": "bad", 1: 1, 2: 2}, lambda key, value: None)
    killed = {id(e[1]) for e in fake.events if e[0] == "kill"}
    assert killed == {id(a) for a in fake.actors}


def test_workers_still_being_created_are_let_finish_before_they_are_stopped():
    """An actor killed while Ray still creates it can keep its CPU for good: close() first waits (boundedly)
    for every worker still in its setup to exist, and only then kills them."""
    fake = FakeRay(cpus=2)

    class BadSetup(Echo):
        def __init__(self):
            raise InvalidParameter("model 'nowhere' not found")

    with pytest.raises(InvalidParameter, match="^model 'nowhere' not found$"):
        Pool(fake, BadSetup, PoolSettings(workers=2))
    # the first setup's error is seen at the first wait; the second worker was still setting up
    waits_for_creation = [i for i, e in enumerate(fake.events) if e[0] == "wait" and all(fake.kinds[r] == "created" for r in e[2])]
    kills = [i for i, e in enumerate(fake.events) if e[0] == "kill"]
    assert waits_for_creation and len(kills) == 2
    second = fake.actors[1]
    assert waits_for_creation[0] < next(i for i in kills if fake.events[i][1] is second)


class Tagged(Echo):
    """A payload that says which worker's payload ran each unit."""

    def describe(self):
        return {"payload": id(self)}

    def run(self, unit):
        return (unit, id(self))


def test_each_worker_is_credited_with_the_units_it_ran_and_only_the_lost_one_is_marked_lost():
    """A worker's description lists the units its own payload completed (a lost worker's unfinished
    unit is credited to the worker that ran it again), and only the worker that died is marked lost."""
    fake = FakeRay(cpus=2, die={1})
    pool = Pool(fake, Tagged, PoolSettings(workers=2))
    results = pool.map({k: k for k in range(6)}, lambda key, value: None)
    assert sorted(results) == list(range(6)) and pool.lost == 1 and len(pool.descriptions) == 3
    ran_by = {d["payload"]: sorted(k for k, (_, payload) in results.items() if payload == d["payload"])
              for d in pool.descriptions}
    assert [sorted(d["done"]) for d in pool.descriptions] == [ran_by[d["payload"]] for d in pool.descriptions]
    assert sum(bool(d["done"]) for d in pool.descriptions) >= 2  # the work was shared: the check above means something
    assert sorted(k for d in pool.descriptions for k in d["done"]) == list(range(6))
    lost = [d for d in pool.descriptions if d["lost"]]
    assert len(lost) == 1 and 1 not in lost[0]["done"]


def test_a_worker_killed_by_rays_memory_monitor_is_a_lost_worker_replaced_and_its_unit_run_again():
    """Ray reports a worker its memory monitor killed as ``OutOfMemoryError``, not as an actor error: the
    worker is lost all the same, its unit runs again on a replacement, and the run ends with every unit
    once (it ended with Ray's own multi-line error)."""
    fake = FakeRay(cpus=2, oom={1})
    pool = Pool(fake, Echo, PoolSettings(workers=2))
    assert pool.map({k: k for k in range(4)}, lambda key, value: None) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert pool.lost == 1 and len(pool.descriptions) == 3 and [d["lost"] for d in pool.descriptions].count(True) == 1


def test_a_replacements_start_timeout_counts_from_its_own_start(monkeypatch):
    """Once a worker's setup has ended, its start time no longer bounds any wait: a replacement set up
    alone later gets the whole start_timeout_s from when it was asked for (asked at t=200, waited at
    t=300: 500 s left), not what is left of the first worker's (asked at t=0)."""
    import decodekit.cluster as cluster_module

    clock = iter(range(0, 10**6, 100))
    monkeypatch.setattr(cluster_module.time, "monotonic", lambda: next(clock))
    fake = FakeRay(die={0})
    pool = Pool(fake, Echo, PoolSettings(workers=1, start_timeout_s=600))
    assert pool.map({0: 0, 1: 1}, lambda key, value: None) == {0: 0, 1: 1} and pool.lost == 1
    assert [timeout for timeout, kinds in fake.waits if kinds == ["setup"]] == [500, 500]


# bench --ray -------------------------------------------------------------------------------------------


def bench_plan(tmp: Path, out: str, *extra: str):
    qfile = tmp / "q.jsonl"
    if not qfile.exists():
        write_questions(qfile)
    return bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "greedy,pld,suffix", "--baselines", "none",
                                     "--max-new-tokens", "10", "--repeats", "2", "--out", str(tmp / out), *extra))


def outputs(records) -> dict:
    return {(r["method"], r["question_id"], r["repeat"]): r["tokens"] for r in records}


def runs_of(records) -> Counter:
    return Counter((r["method"], r["question_id"], r["repeat"]) for r in records)


@pytest.fixture(scope="module")
def single_machine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-ray")
    return execute(bench_plan(tmp, "local"), TINY(), progress=False), tmp


def test_a_bench_on_ray_gives_the_single_machine_tokens_in_the_same_schema_with_a_worker_killed(
        cluster, single_machine, monkeypatch):
    """One run on the cluster, a worker killed in the middle of a question: every question done once,
    every token sequence the single-machine run gives, in a file of the same schema and order."""
    from decodekit.bench import distributed

    local, tmp = single_machine
    killer = MidUnitKiller()
    killer.start()

    def save_and_trigger(plan, records, notes):
        original(plan, records, notes)
        killer.trigger.set()

    original = distributed.save_checkpoint
    monkeypatch.setattr(distributed, "save_checkpoint", save_and_trigger)
    results = execute_on_ray(bench_plan(tmp, "ray"), None, PoolSettings(), load=TINY, progress=False)
    killer.join(5)
    validate_results(local)
    validate_results(results)
    validate_results(json.loads((tmp / "ray" / "results.json").read_text()))
    assert "machines" not in local
    assert outputs(results["records"]) == outputs(local["records"])
    assert [(r["method"], r["question_id"], r["repeat"], r["position"]) for r in results["records"]] == \
           [(r["method"], r["question_id"], r["repeat"], r["position"]) for r in local["records"]]  # the same order
    assert set(runs_of(results["records"]).values()) == {1} and len(results["records"]) == len(local["records"])
    assert all(r["identical_to_reference"] for r in results["records"])
    assert set(results["summary"]["methods"]) == set(local["summary"]["methods"])
    assert "Workers (Ray)" in (tmp / "ray" / "report.md").read_text()
    assert "outputs: 48 of 48 runs in both files are token-identical" in compare(local, results)
    assert (tmp / "ray" / "speedup.png").stat().st_size > 1000
    lost = [m for m in results["machines"] if m["lost"]]
    # PoolSettings(): as many workers as the cluster's CPUs hold (2). The replacement is started at
    # once, but whether its setup ends before the survivor finishes the queue alone depends on the
    # machine's load; the pool's own test above makes sure it does.
    workers = len(results["machines"])
    assert len(lost) == 1 and lost[0]["pid"] == killer.killed and workers in (2, 3)
    assert all(m["threads"] == m["machine"]["torch_threads"] == 1 for m in results["machines"])  # what each reserved
    ran = [tuple(q) for m in results["machines"] for q in m["questions"]]  # each question on one worker, once
    assert sorted(ran) == sorted((r, q) for (_, q, r) in runs_of(local["records"]) if _ == "greedy")
    assert sum(n.startswith(f"ran on a Ray cluster: {workers} workers (1 lost and replaced)") for n in results["notes"]) == 1
    checkpoint = json.loads((tmp / "ray" / "checkpoint.json").read_text())
    assert runs_of(checkpoint["records"]) == runs_of(local["records"])


def test_a_bench_on_ray_resumes_a_checkpoint_and_runs_only_the_rest(cluster, single_machine):
    local, tmp = single_machine
    one = PoolSettings(workers=1)  # what is resumed does not depend on how many workers run it
    first = bench_plan(tmp, "ray-resume", "--limit", "1", "--categories", "translation,qa")
    execute_on_ray(first, None, one, load=TINY, progress=False)
    resumed = bench_plan(tmp, "ray-resume", "--resume")
    results = execute_on_ray(resumed, None, one, load=TINY, progress=False)
    assert sum(m["units"] for m in results["machines"]) == 2 * (8 - 2)  # the two finished questions are not run again
    assert outputs(results["records"]) == outputs(local["records"])
    assert any(n.startswith("resumed: 4 run(s) of a question") for n in results["notes"])  # 2 questions x 2 repeats
    assert sum(n.startswith("ran on a Ray cluster") for n in results["notes"]) == 1  # not carried over by the resume


def test_ray_flags_are_checked_before_anything_starts(tmp_path, monkeypatch):
    write_questions(tmp_path / "q.jsonl")
    with pytest.raises(InvalidParameter, match="--workers needs --ray"):
        bench_cli.make_plan(parse("--questions", str(tmp_path / "q.jsonl"), "--workers", "2", "--out", str(tmp_path)))
    plan = bench_cli.make_plan(parse("--questions", str(tmp_path / "q.jsonl"), "--ray", "auto", "--workers", "3",
                                     "--out", str(tmp_path)))
    assert plan.command.endswith("--ray auto --workers 3") and "ray" not in plan.resume_key()
    bare = bench_cli.make_plan(parse("--questions", str(tmp_path / "q.jsonl"), "--ray", "--out", str(tmp_path)))
    assert bare.ray == "local" and bare.command.endswith("--ray local")  # alone: a local instance, not a cluster's
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(DecodeKitError, match=r"^--ray needs Ray, which is not installed: pip install 'decodekit\[ray\]'$"):
        bench_cli.make_plan(parse("--questions", str(tmp_path / "q.jsonl"), "--ray", "--out", str(tmp_path)))


class FakePool:
    """Pool's interface without Ray: units dealt round-robin to in-process workers (hand-made descriptions)."""

    def __init__(self, workers, descriptions):
        self.workers, self.descriptions, self.lost = workers, descriptions, 0

    def map(self, units, on_result):
        for i, key in enumerate(units):
            self.descriptions[i % len(self.workers)]["done"].append(key)
            on_result(key, self.workers[i % len(self.workers)].run(units[key]))


def fake_pool(codes, peaks, note):
    from decodekit.bench.results import machine_info
    from decodekit.bench.runner import BenchConfig, BenchSession
    from test_bench import Scripted

    class Worker:
        def __init__(self):
            self.session = BenchSession([Scripted("greedy", []), Scripted("b", [])], lambda messages: [1, 2, 3],
                                        BenchConfig(max_new_tokens=4))

        def run(self, unit):
            return {"records": self.session.run_question(*unit), "notes": [note]}

    workers = [Worker() for _ in codes]
    descriptions = [{"machine": machine_info(model="tiny", dtype="float32"), "contestants": w.session.describe(),
                     "code": code, "peak_rss_mb": peak, "notes": [], "host": "h", "pid": i, "threads": 1,
                     "done": [], "lost": False} for i, (w, code, peak) in enumerate(zip(workers, codes, peaks))]
    return FakePool(workers, descriptions)


def test_a_bench_on_ray_merges_its_workers_figures(tmp_path):
    """Each worker's questions by id, the largest memory peak of any worker, a note once however many
    workers make it, a note when a worker runs other code, and a resumed count."""
    from decodekit.bench import distributed

    qfile = write_questions(tmp_path / "q.jsonl")
    common = ("--questions", str(qfile), "--methods", "greedy", "--baselines", "none", "--max-new-tokens", "4",
              "--out", str(tmp_path / "out"))
    plan = bench_cli.make_plan(parse(*common, "--categories", "qa,rag"))  # question ids 5 and 6, at indices 0 and 1
    pool = fake_pool(["driver", "other"], [{"greedy": 10.0, "b": 30.0}, {"greedy": 20.0, "b": 5.0}], "a worker's note")
    results = distributed._run(plan, pool, "driver", progress=False)
    assert [m["questions"] for m in results["machines"]] == [[[0, 5]], [[0, 6]]]
    assert {n: results["summary"]["methods"][n]["peak_rss_mb"] for n in ("greedy", "b")} == {"greedy": 20.0, "b": 30.0}
    assert results["notes"].count("a worker's note") == 1
    assert json.loads((tmp_path / "out" / "checkpoint.json").read_text())["notes"].count("a worker's note") == 1
    assert any(n.startswith("some workers run other decodekit code than the driver") for n in results["notes"])
    resumed = bench_cli.make_plan(parse(*common, "--categories", "qa,rag,summarization", "--resume"))
    again = distributed._run(resumed, fake_pool(["driver"], [{}], "a worker's note"), "driver", progress=False)
    assert any(n.startswith("resumed: 2 question(s)") for n in again["notes"])
    assert [m["questions"] for m in again["machines"]] == [[[0, 7]]]


def test_a_bench_on_ray_notes_workers_that_kept_other_contestants(tmp_path):
    """When one worker kept fewer contestants after its warm-up than the first, the run says so once;
    when all kept the same, it says nothing."""
    from decodekit.bench import distributed

    qfile = write_questions(tmp_path / "q.jsonl")
    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "greedy", "--baselines", "none",
                                     "--max-new-tokens", "4", "--categories", "qa,rag", "--out", str(tmp_path / "out")))
    note = "workers kept different contestants after their warm-up; ratios use the questions both sides ran"
    same = distributed._run(plan, fake_pool(["driver", "driver"], [{}, {}], "n"), "driver", progress=False)
    assert note not in same["notes"]
    pool = fake_pool(["driver", "driver"], [{}, {}], "n")
    pool.descriptions[1]["contestants"] = pool.descriptions[1]["contestants"][:1]
    differ = distributed._run(plan, pool, "driver", progress=False)
    assert differ["notes"].count(note) == 1


def test_threads_under_ray_are_per_worker_not_checked_against_this_machine(tmp_path):
    """With --ray, --threads is each worker's count on its node, which may have more CPUs than the driver."""
    write_questions(tmp_path / "q.jsonl")
    threads = (os.cpu_count() or 1) + 1
    plan = bench_cli.make_plan(parse("--questions", str(tmp_path / "q.jsonl"), "--ray", "auto", "--threads", str(threads),
                                     "--out", str(tmp_path)))
    assert plan.threads == threads and f"--threads {threads}" in plan.command


# eval --ray --------------------------------------------------------------------------------------------


def test_an_eval_on_ray_gives_the_single_machine_records_even_with_a_worker_killed(cluster):
    task = load_task("capitals")
    config = EvalConfig(method="self-consistency", n=3, limit=8, max_new_tokens=8, seed=5)
    local = evaluate(TINY(), task, config)
    killer = MidUnitKiller()
    killer.start()
    remote = evaluate_on_ray(TINY, task, config, None, PoolSettings(workers=2),
                             lambda done, total, record: killer.trigger.set())
    killer.join(5)

    def without_time(result):
        return [{k: v for k, v in r.items() if k != "time_s"} for r in result["records"]]

    assert without_time(remote) == without_time(local)
    same = ("items", "correct", "accuracy", "ci95", "tokens_spent", "auroc", "budget_curve")
    assert {k: remote[k] for k in same} == {k: local[k] for k in same}
    assert set(remote) - set(local) == {"machines"}
    assert [m["pid"] for m in remote["machines"] if m["lost"]] == [killer.killed]
    assert sorted(i for m in remote["machines"] for i in m["items"]) == list(range(8))
    assert [m["units"] for m in remote["machines"]] == [len(m["items"]) for m in remote["machines"]]  # as the report reads it


def test_an_eval_on_ray_with_a_limit_past_the_last_item_runs_every_item_once(cluster, tmp_path):
    """--limit past the task's end means the whole task, as on one machine."""
    data = tmp_path / "g.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + {i}?", "answer": f"#### {2 * i}"}) + "\n" for i in range(2)))
    task = load_task("gsm8k", str(data))
    config = EvalConfig(limit=5, max_new_tokens=4)
    remote = evaluate_on_ray(TINY, task, config, None, PoolSettings(workers=1))
    local = evaluate(TINY(), task, config)
    assert remote["items"] == local["items"] == 2
    assert [r["output"] for r in remote["records"]] == [r["output"] for r in local["records"]]


def test_an_eval_on_ray_resumed_sends_only_the_items_its_checkpoint_lacks(cluster):
    from decodekit.eval.checkpoint import Progress

    task = load_task("capitals")
    config = EvalConfig(limit=4, max_new_tokens=6)
    local = evaluate(TINY(), task, config)
    saved = []
    resumed = Progress({1: local["records"][1], 3: local["records"][3]}, {1: 1.0, 3: 1.0})
    remote = evaluate_on_ray(TINY, task, config, None, PoolSettings(workers=1), resumed=resumed,
                             checkpoint=lambda progress: saved.append(sorted(progress.records)))
    assert sorted(i for m in remote["machines"] for i in m["items"]) == [0, 2]
    assert saved == [[0, 1, 3], [0, 1, 2, 3]] or saved == [[1, 2, 3], [0, 1, 2, 3]]  # after each item, as it arrives
    assert [r["output"] for r in remote["records"]] == [r["output"] for r in local["records"]]
    assert remote["time_s"] > 2.0  # the checkpoint's time and this run's


def test_eval_ray_cli_writes_the_usual_files(cluster, tmp_path, capsys):
    from decodekit.eval.cli import add_arguments, run
    from decodekit.arguments import ArgumentParser

    parser = ArgumentParser()
    add_arguments(parser)
    # One worker: spreading the items over workers is tested above.
    args = parser.parse_args(["capitals", "--limit", "4", "--max-new-tokens", "6", "--ray", "--workers", "1",
                              "--out", str(tmp_path)])
    assert run(args, model=TINY) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["items"] == 4 and result["model"] == "tiny" and len(result["machines"]) == 1
    assert "Ray workers:" in (tmp_path / "report.md").read_text()
    with pytest.raises(InvalidParameter, match="longctx runs on one machine"):
        run(parser.parse_args(["longctx", "--ray"]))
    with pytest.raises(InvalidParameter, match="needs --ray"):
        run(parser.parse_args(["capitals", "--workers", "2"]))


@pytest.mark.real_model
def test_the_cli_bench_on_ray_matches_one_machine_on_the_embedded_model(cluster, tmp_path, capsys):
    """The whole path a user takes: the CLI, each worker loading the embedded model by name."""
    from decodekit.interfaces.cli import main

    common = ["bench", "--methods", "greedy,pld", "--baselines", "none", "--categories", "qa",
              "--limit", "1", "--max-new-tokens", "24", "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    # One worker: spreading the questions over workers is tested above on the tiny model.
    assert main([*common, "--ray", "--workers", "1", "--out", str(tmp_path / "ray")]) == 0
    one, ray_run = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "ray"))
    validate_results(ray_run)
    assert outputs(ray_run["records"]) == outputs(one["records"]) and len(one["records"]) == 2
    assert "--ray local --workers 1" in ray_run["command"] and len(ray_run["machines"]) == 1
