"""One Engine shared by threads gives every call exactly what it gives alone."""

from __future__ import annotations

import threading

from decodekit.engine import Engine
from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.tiny import tiny_llama

CALLS = [
    ("abcabcabc", {"method": "greedy"}),
    ("hello hello", {"method": "pld", "budget": 4}),
    ("the cat sat", {"method": "sample", "temperature": 0.9, "seed": 3}),
    ("xyzxyz", {"method": "suffix"}),
    ("one two", {"method": "recycling", "budget": 6}),
    ("mnop", {"method": "best-of-n", "n": 3, "temperature": 0.8, "seed": 1}),
]


def make_engine() -> Engine:
    return Engine(LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny"))


def run(engine: Engine, prompt: str, params: dict) -> list[int]:
    return engine.generate(prompt, max_new_tokens=40, chat=False, **params).tokens


def test_mixed_methods_from_threads_match_one_at_a_time():
    # Speculative methods learn across requests (and from timings), but their output is plain
    # decoding's whatever they learnt; seeded methods depend on the seed only. So every call from
    # every thread must equal the same call run alone.
    expected = [run(make_engine(), prompt, params) for prompt, params in CALLS]
    shared = make_engine()
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = [run(shared, *CALLS[i]) for _ in range(3)]
        except BaseException as err:  # reported below, not lost in the thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(CALLS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, outputs in results.items():
        assert all(tokens == expected[i] for tokens in outputs), CALLS[i]


# The kernels' thread count under contention -----------------------------------------------------

import pytest  # noqa: E402
import torch  # noqa: E402

from decodekit.models.threads import FIRST_PROBE, LONGEST_PAUSE, ThreadGovernor  # noqa: E402


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def drive(governor: ThreadGovernor, seconds: dict[int, float], passes: int, key: str = "m") -> list[int]:
    """Run ``passes`` timed one-token passes whose time depends only on the thread count."""
    used = []
    for _ in range(passes):
        n, probing = governor.choose(key, timed=True)
        assert torch.get_num_threads() == n  # torch's count is what the governor chose
        governor.observe(key, n, seconds[n], probing)
        used.append(n)
    return used


def test_the_governor_drops_to_one_thread_when_two_are_slower_and_returns_when_quiet(two_threads):
    governor = ThreadGovernor()
    quiet = drive(governor, {2: 3.0, 1: 5.0}, 200)
    assert quiet[:2] == [2, 1] and quiet[-50:].count(2) >= 49  # tries both, keeps the faster
    assert governor._records["m"].pause > FIRST_PROBE  # one thread kept losing: tried ever more rarely
    shared = drive(governor, {2: 12.0, 1: 6.0}, 100)  # another process took a core
    assert shared.index(1) <= 10 and shared[-50:].count(1) >= 45  # within a few slow passes
    back = drive(governor, {2: 3.0, 1: 5.0}, LONGEST_PAUSE + 2)
    assert back[-1] == 2 and back.count(2) > LONGEST_PAUSE // 2  # one quiet try is enough


def test_each_model_has_its_own_estimates(two_threads):
    """A small draft model's passes are cheap at any count: they must not decide for the target."""
    governor = ThreadGovernor()
    drive(governor, {2: 12.0, 1: 6.0}, 60, key="target")
    drive(governor, {2: 0.5, 1: 0.9}, 60, key="draft")
    assert governor.choose("target", timed=False)[0] == 1 and governor.choose("draft", timed=False)[0] == 2


def test_untimed_passes_never_probe_and_a_count_set_by_the_user_is_respected(two_threads):
    governor = ThreadGovernor()
    assert [governor.choose("m", timed=False) for _ in range(100)] == [(2, False)] * 100
    torch.set_num_threads(1)
    assert governor.choose("m", timed=True)[0] == 1 and governor.most == 1


def test_hold_sets_all_threads_at_once_and_nests(two_threads):
    governor = ThreadGovernor()
    drive(governor, {2: 12.0, 1: 6.0}, 40)  # now on one thread
    assert torch.get_num_threads() == 1 and governor.full_count() == 2
    with governor.hold():
        assert torch.get_num_threads() == 2  # before any pass: a measurement may not run one
        with governor.hold():
            assert [governor.choose("m", timed=True) for _ in range(40)] == [(2, False)] * 40
        assert governor.held == 2
    assert governor.held is None


def test_a_switched_off_governor_leaves_torchs_count_alone(two_threads):
    governor = ThreadGovernor(enabled=False)
    assert [governor.choose("m", timed=True)[0] for _ in range(30)] == [2] * 30


def test_the_thread_count_never_changes_a_token(two_threads):
    """What the governor may switch between passes: one thread or two, every method's output the same."""
    outputs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        engine = make_engine()
        outputs.append([run(engine, prompt, params) for prompt, params in CALLS])
    assert outputs[0] == outputs[1]


def test_the_governor_times_plain_steps_only_each_cache_policy_apart(monkeypatch):
    """It compares one pass kind under each thread count: a one-token draft that attends to a window
    of the cache, or skips layers, costs a fraction of a plain step, and timed as one it would make
    whichever count it ran under look faster (one thread, at a long context, for kvdraft)."""
    import contextlib

    import torch

    from decodekit.models import native

    seen: list[tuple[object, bool]] = []

    class Recorder:
        @contextlib.contextmanager
        def governed(self, key, timed):
            seen.append((key, timed))
            yield 1

    monkeypatch.setattr(native, "GOVERNOR", Recorder())
    backend = tiny_llama(seed=0, hidden_size=64)
    backend.prefill(list(range(1, 40)))
    backend.step(torch.tensor([5]))
    backend.append_windowed(torch.tensor([[6]]), 2, 8)
    backend.append(torch.tensor([[7]]), skip_layers=frozenset({1}))
    backend.verify_tree(torch.tensor([8, 9]), [-1, 0])
    int8 = backend.with_kv_cache("int8")
    int8.step(torch.tensor([5]))
    assert [timed for _, timed in seen] == [False, True, False, False, False, True]
    assert seen[1][0] == ("tiny-llama", "exact", "torch.float32", "full")
    assert seen[5][0] == ("tiny-llama", "exact", "torch.float32", "int8")
    from decodekit.models import kernels

    if kernels.integer_block_matmul("q4_1") is not None:  # (a CPU with the integer kernel) the other numerics: its own times
        fast = tiny_llama(seed=0, hidden_size=64, numerics="fast", gguf_blocks=True)
        fast.step(torch.tensor([5]))
        assert seen[-1] == (("tiny-llama", "fast", "torch.float32", "full"), True)


def test_busy_elsewhere_is_the_cores_busy_time_less_this_processs_own():
    """Per window: what the cores did (a 10 ms tick at a time) less this process's own CPU time, in cores."""
    from decodekit.machine import BusyElsewhere

    clock, machine, own = [0.0], [(0.0, 0.0)], [0.0]
    busy = BusyElsewhere(window_s=0.1, times=lambda: machine[0], own=lambda: own[0], clock=lambda: clock[0])
    busy.cpus = 2
    assert busy() is None  # no window has passed
    clock[0], machine[0], own[0] = 0.05, (0.1, 0.1), 0.05
    assert busy() is None  # nor yet
    clock[0], machine[0], own[0] = 0.2, (0.3, 0.4), 0.1  # 0.3 busy of 0.4 CPU-s (2 cores x 0.2 s); 0.1 ours
    assert busy() == pytest.approx(1.0)  # (0.3 - 0.1) CPU-s over 0.2 s
    clock[0], machine[0], own[0] = 0.25, (0.35, 0.5), 0.15
    assert busy() == pytest.approx(1.0)  # within the next window: the last figure
    clock[0], machine[0], own[0] = 0.4, (0.55, 0.8), 0.35  # all of the busy time ours
    assert busy() == pytest.approx(0.0)
    gone = BusyElsewhere(times=lambda: None)  # no /proc/stat
    clock[0] = 10.0
    assert gone() is None


def test_the_governor_leaves_the_cores_other_processes_keep_busy_without_a_try(two_threads, monkeypatch):
    """Where another process keeps a core busy, every pass (untimed ones too: the server's) runs on
    one thread with no try of two, whatever the timings say; once the cores are free again the next
    timed pass tries the other count."""
    from decodekit.models import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    others = [0.0]
    governor = ThreadGovernor(busy_elsewhere=lambda: others[0])
    quiet = drive(governor, {2: 3.0, 1: 5.0}, 100)
    assert quiet[-50:].count(2) >= 49
    others[0] = 0.9  # a busy loop on the other core
    assert drive(governor, {2: 3.0, 1: 5.0}, 600) == [1] * 600  # never a try of two, which stalls for a slice a region
    assert [governor.choose("m", timed=False) for _ in range(5)] == [(1, False)] * 5
    others[0] = 0.1
    assert drive(governor, {2: 3.0, 1: 5.0}, 20) == [1] + [2] * 19  # the first pass tries the other count
    unknown = ThreadGovernor(busy_elsewhere=lambda: None)  # no figure: the timings decide, as before
    assert drive(unknown, {2: 12.0, 1: 6.0}, 100)[-50:].count(1) >= 45


def test_a_faster_timing_replaces_the_estimate_and_a_slower_one_moves_it_a_fifth_of_the_way():
    """A pass is never faster than the machine allows: a faster time is the new estimate at once, a slower
    one (load, or a longer context) moves it by SLOWER_WEIGHT of the difference."""
    from decodekit.models.threads import SLOWER_WEIGHT

    governor = ThreadGovernor()
    governor.observe("m", 2, 10.0)
    governor.observe("m", 2, 20.0)
    assert governor._records["m"].estimate[2] == pytest.approx(10.0 + SLOWER_WEIGHT * 10.0)  # 12.0
    governor.observe("m", 2, 5.0)
    assert governor._records["m"].estimate[2] == 5.0


def test_tries_of_a_losing_count_come_ever_more_rarely_up_to_the_longest_pause(two_threads):
    """Each lost try doubles the pause before the next one (16 passes up to LONGEST_PAUSE, then no longer):
    the passes between tries of one thread are 64, 128, 256, 512, 512, ... once both counts are measured."""
    used = drive(ThreadGovernor(), {2: 3.0, 1: 5.0}, 4000)
    tries = [i for i, n in enumerate(used) if n == 1]
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    # the first try measures one thread (pass 2); the next comes when the pass count since the last
    # choice reaches the doubled pause of 32; every later gap is the pause, doubled after each loss
    assert tries[:2] == [1, 2 * FIRST_PROBE - 1]
    assert gaps[1:] == [64, 128, 256, LONGEST_PAUSE] + [LONGEST_PAUSE] * (len(gaps) - 5)


def test_the_cores_left_are_the_free_ones_to_the_nearest_core_from_half_a_busy_core(monkeypatch):
    """Half a core kept busy elsewhere (BUSY_ELSEWHERE) already leaves it to the other process; the count is
    the cores the others leave free, rounded to the nearest whole core (4 - 1.4 = 2.6: 3 threads)."""
    from decodekit.models import threads

    before = torch.get_num_threads()
    try:
        for cores, others, expected in [(3, 0.5, 2), (4, 0.5, 3), (4, 1.4, 3), (4, 1.6, 2)]:
            monkeypatch.setattr(threads, "usable_cores", lambda cores=cores: cores)
            torch.set_num_threads(cores)
            governor = ThreadGovernor(busy_elsewhere=lambda others=others: others)
            assert governor.choose("m", timed=False) == (expected, False), (cores, others)
            assert governor.choose("m", timed=True) == (expected, False), (cores, others)  # no try either
    finally:
        torch.set_num_threads(before)


def test_the_cpu_times_count_busy_ticks_of_this_processs_cores_only(monkeypatch):
    """/proc/stat's per-CPU lines (not the summary line) of the CPUs asked for: busy is user, nice,
    system, irq, softirq and steal (a niced process still stalls ours, and decodekit run under nice books
    its own time as nice), not idle and iowait; both in seconds."""
    import io
    import os

    from decodekit import machine

    stat = ("cpu  100 100 100 100 100 100 100 100 0 0\n"
            "cpu0 1 2 3 4 5 6 7 8 0 0\n"
            "cpu1 10 20 30 40 50 60 70 80 0 0\n"
            "cpu2 1000 1000 1000 1000 1000 1000 1000 1000 0 0\n"
            "intr 5\n")
    monkeypatch.setattr(machine, "open", lambda path, *a, **k: io.StringIO(stat), raising=False)
    tick = os.sysconf("SC_CLK_TCK")
    busy, total = machine._cpu_times({0, 1})
    assert busy == pytest.approx((1 + 2 + 3 + 6 + 7 + 8 + 10 + 20 + 30 + 60 + 70 + 80) / tick)
    assert total == pytest.approx((36 + 360) / tick)


def test_a_count_set_by_someone_else_starts_the_learning_over(two_threads):
    """When torch's count changes behind the governor's back, that count becomes ``most`` and what was
    learnt under the old one starts over: its timings say nothing about the new count."""
    governor = ThreadGovernor()
    drive(governor, {2: 12.0, 1: 6.0}, 40)  # learnt: one thread is faster
    assert governor.choose("m", timed=False)[0] == 1
    torch.set_num_threads(2)  # the user, not the governor
    assert governor.choose("m", timed=False) == (2, False) and governor._records["m"].estimate == {}


def test_the_cores_left_free_never_exceed_the_full_count_nor_fall_below_one(monkeypatch, two_threads):
    """Beside a busy process the governor takes the cores the others leave free, but never more than
    ``most`` (the count it would use on a quiet machine) and never fewer than one."""
    from decodekit.models import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    assert ThreadGovernor(busy_elsewhere=lambda: 0.6).choose("m", timed=False) == (2, False)  # 3.4 free, most 2
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    assert ThreadGovernor(busy_elsewhere=lambda: 1.9).choose("m", timed=False) == (1, False)  # 0.1 free: still one
    assert torch.get_num_threads() == 1


def test_after_a_switch_the_count_just_left_is_tried_again_soon(two_threads):
    """The pause between tries is short again after a switch (FIRST_PROBE passes), however long it had
    grown while the other count kept losing: a burst of load may already be over."""
    governor = ThreadGovernor()
    drive(governor, {2: 3.0, 1: 5.0}, 3000)
    assert governor._records["m"].pause == LONGEST_PAUSE
    loaded = drive(governor, {2: 12.0, 1: 6.0}, 60)  # two's estimate climbs past one's: a switch, no try
    switch = loaded.index(1)
    assert 2 in loaded[switch:] and loaded[switch:].index(2) <= FIRST_PROBE


def test_passes_under_hold_are_not_timed(two_threads):
    """``hold`` is for measurements: the passes inside run on all threads and their times teach the
    governor nothing (a measurement's passes are not a decode's)."""
    governor = ThreadGovernor()
    with governor.hold():
        for _ in range(3):
            with governor.governed("m", timed=True) as n:
                assert n == 2
    assert governor._records.get("m") is None or governor._records["m"].estimate == {}


def test_the_full_count_before_any_pass_is_torchs(two_threads):
    """What a measurement is filed under is the quiet machine's count, torch's own even before the
    governor has chosen for a single pass."""
    assert ThreadGovernor().full_count() == 2


def test_once_the_cores_are_free_again_every_models_next_timed_pass_tries_the_other_count(two_threads, monkeypatch):
    """Leaving a crowded machine, each model (not only the one whose pass noticed first) tries the count
    it did not use: the timings it has are from before the crowd."""
    from decodekit.models import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    others = [0.0]
    governor = ThreadGovernor(busy_elsewhere=lambda: others[0])
    for key in ("target", "draft"):
        assert drive(governor, {2: 3.0, 1: 5.0}, 100, key=key)[-50:].count(2) >= 49
    others[0] = 0.9
    drive(governor, {2: 3.0, 1: 5.0}, 10, key="target")
    others[0] = 0.0
    assert drive(governor, {2: 3.0, 1: 5.0}, 5, key="target") == [1, 2, 2, 2, 2]
    assert drive(governor, {2: 3.0, 1: 5.0}, 5, key="draft") == [1, 2, 2, 2, 2]


def test_a_try_that_ties_is_not_a_loss_the_pause_is_short_again(two_threads):
    """The pause doubles only while the other count keeps losing: a try that times the same as the
    leader (the machine's load changed, one thread caught up) makes the pause FIRST_PROBE again, so
    the counts keep being compared every FIRST_PROBE passes while they are this close."""
    governor = ThreadGovernor()
    drive(governor, {2: 3.0, 1: 5.0}, 200)
    assert governor._records["m"].pause > FIRST_PROBE  # one thread lost its tries
    used = drive(governor, {2: 3.0, 1: 3.0}, 6 * LONGEST_PAUSE)
    tries = [i for i, n in enumerate(used) if n == 1]
    assert governor._records["m"].pause == FIRST_PROBE
    assert [b - a for a, b in zip(tries, tries[1:])] == [FIRST_PROBE] * (len(tries) - 1)  # a tie each time


def test_a_one_thread_process_never_tries_another_count():
    """With torch on one thread there is no other count: no pass is reported as a try, timed or not."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        governor = ThreadGovernor()
        assert [governor.choose("m", timed=True) for _ in range(100)] == [(1, False)] * 100
        assert [governor.choose("m", timed=False) for _ in range(5)] == [(1, False)] * 5
    finally:
        torch.set_num_threads(before)


def test_the_pauses_and_the_slower_weight_are_the_documented_figures(two_threads):
    """The module's documentation promises tries of a losing count 16 passes apart, doubling up to 512,
    and a slower timing moving an estimate a fifth of the way: the figures, not only their names."""
    used = drive(ThreadGovernor(), {2: 3.0, 1: 5.0}, 2000)
    tries = [i for i, n in enumerate(used) if n == 1]
    assert [b - a for a, b in zip(tries, tries[1:])][:6] == [30, 64, 128, 256, 512, 512]
    governor = ThreadGovernor()
    governor.observe("m", 2, 10.0)
    governor.observe("m", 2, 20.0)
    assert governor._records["m"].estimate[2] == pytest.approx(12.0)


# What the machine gives this process -------------------------------------------------------------


def test_usable_cores_are_the_process_affinity_not_the_machines_count(monkeypatch):
    """A process pinned to some cores (taskset, a container's cpuset) may run on those only."""
    from decodekit import machine

    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {1, 3}, raising=False)
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 8)
    assert machine.usable_cores() == 2


def test_available_memory_is_memavailable_in_bytes_and_none_without_proc_meminfo(monkeypatch):
    """MemAvailable (what a new allocation can get without swapping, page cache included), not MemFree;
    /proc/meminfo counts in KiB; no /proc/meminfo (another system) is None, not an error."""
    import io

    from decodekit import machine

    meminfo = "MemTotal:       16000000 kB\nMemFree:          500000 kB\nMemAvailable:    8000000 kB\n"
    monkeypatch.setattr(machine, "open", lambda path, *a, **k: io.StringIO(meminfo), raising=False)
    assert machine.available_memory() == 8000000 * 1024

    def missing(path, *a, **k):
        raise FileNotFoundError(path)

    monkeypatch.setattr(machine, "open", missing, raising=False)
    assert machine.available_memory() is None
    assert machine._cpu_times({0}) is None  # nor /proc/stat: no figure rather than a made-up one


def test_busy_elsewhere_samples_once_a_whole_window_has_passed(monkeypatch):
    """A window of at least ``window_s``: exactly ``window_s`` after the last sample is a window."""
    from decodekit.machine import BusyElsewhere

    clock, machine = [0.0], [(0.0, 0.0)]
    busy = BusyElsewhere(window_s=0.25, times=lambda: machine[0], own=lambda: 0.0, clock=lambda: clock[0])
    busy.cpus = 2
    clock[0], machine[0] = 0.25, (0.25, 0.5)  # one of the two cores busy throughout
    assert busy() == pytest.approx(1.0)


def test_one_failed_read_of_the_cpu_times_does_not_freeze_the_busy_count():
    """A read of /proc/stat that fails once (no file handle left, say) keeps the last figure for that
    call and reads again at the next: it used to become the window's start, after which the count
    never moved again (a busy figure frozen above half a core kept the governor on fewer threads for
    the rest of the process)."""
    from decodekit.machine import BusyElsewhere

    clock, machine = [0.0], [(0.0, 0.0)]
    busy = BusyElsewhere(window_s=0.1, times=lambda: machine[0], own=lambda: 0.0, clock=lambda: clock[0])
    busy.cpus = 2
    clock[0], machine[0] = 0.2, (0.2, 0.4)  # one core busy
    assert busy() == pytest.approx(1.0)
    clock[0], machine[0] = 0.4, None  # the read fails
    assert busy() == pytest.approx(1.0)
    clock[0], machine[0] = 0.6, (0.2, 0.8)  # idle since: measured from the last good sample
    assert busy() == 0.0


def test_busy_elsewhere_is_never_negative_counts_own_time_since_the_window_and_survives_an_empty_window():
    """This process's CPU time counts from the window's start (it may have run long before); its own
    time can exceed the cores' busy ticks (the kernel counts them apart): that is no core busy, never a
    negative count; and a window in which the kernel counted no tick keeps the last figure."""
    from decodekit.machine import BusyElsewhere

    clock, machine, own = [0.0], [(0.0, 0.0)], [5.0]  # 5 CPU-s of ours before the first window
    busy = BusyElsewhere(window_s=0.1, times=lambda: machine[0], own=lambda: own[0], clock=lambda: clock[0])
    busy.cpus = 2
    clock[0], machine[0], own[0] = 0.2, (0.3, 0.4), 5.1
    assert busy() == pytest.approx(1.0)  # (0.3 - 0.1) CPU-s over 0.2 s
    clock[0], machine[0], own[0] = 0.4, (0.4, 0.8), 5.4  # ours 0.3 CPU-s, the cores' ticks 0.1
    assert busy() == 0.0
    clock[0], machine[0], own[0] = 0.6, (0.5, 1.2), 5.4
    assert busy() == pytest.approx(0.5)
    clock[0] = 0.8  # /proc/stat did not move (no tick counted): no division by zero
    assert busy() == pytest.approx(0.5)


def test_busy_elsewhere_by_default_reads_this_processs_cores_and_its_user_and_system_time(monkeypatch):
    """Without injected readings: /proc/stat's lines of the CPUs in this process's affinity, as many
    cores as those, and this process's own user plus system time (os.times)."""
    from decodekit import machine

    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {1, 2}, raising=False)
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 8)
    asked, readings = [], iter([(0.0, 0.0), (1.0, 2.0)])  # 1 busy CPU-s of 2 (2 cores x 1 s)

    def cpu_times(cpus):
        asked.append(set(cpus))
        return next(readings)

    monkeypatch.setattr(machine, "_cpu_times", cpu_times)
    own = iter([(0.1, 0.1, 9.0, 9.0, 0.0), (0.3, 0.3, 9.0, 9.0, 0.0)])  # 0.4 CPU-s of ours, half system
    monkeypatch.setattr(machine.os, "times", lambda: next(own))
    clock = [0.0]
    busy = machine.BusyElsewhere(window_s=0.1, clock=lambda: clock[0])
    assert busy.cpus == 2
    clock[0] = 1.0
    assert busy() == pytest.approx(0.6)  # (1.0 - 0.4) CPU-s x 2 cores over 2 CPU-s
    assert asked == [{1, 2}, {1, 2}]


def test_a_pass_on_another_thread_does_not_pin_a_thread_to_the_count_the_governor_tried(two_threads):
    """Torch's count is per thread: a request thread the governor tried on one thread, beside another
    request thread running on two, must not take its own one thread for a count someone set, keep it as
    ``most`` and stay on it on a quiet machine where two threads are faster."""
    governor = ThreadGovernor()
    go, ran = threading.Event(), threading.Event()

    def other_request() -> None:  # started before any pass: torch's count of two
        go.wait()
        governor.choose("m", timed=False)
        ran.set()

    other = threading.Thread(target=other_request)
    other.start()
    assert drive(governor, {2: 3.0, 1: 5.0}, 2) == [2, 1]  # the second pass tries one thread
    go.set()
    ran.wait(10)
    other.join()
    assert governor.most == 2 and drive(governor, {2: 3.0, 1: 5.0}, 30)[-20:].count(2) >= 18


def test_the_thread_governor_counts_the_passes_by_their_thread_count():
    from decodekit.models.threads import ThreadGovernor

    governor = ThreadGovernor(busy_elsewhere=lambda: None)
    for _ in range(3):
        with governor.governed("m", timed=False) as threads:
            pass
    assert governor.passes == {threads: 3}
