"""Continuous batching of forward passes (models/batching.py): requests decoding on their own
clones, as members on the pass thread or in threads of their own, share passes, and each gets
exactly the tokens it gets alone."""

from __future__ import annotations

import contextlib
import functools
import threading

import pytest
import torch

from decodekit.engine import Engine
from decodekit.models import CharTokenizer, LoadedModel, kernels
from decodekit.models.batching import PREFILL_CHUNK, PassBatcher, single_threaded
from decodekit.models.tiny import tiny_gemma3, tiny_llama

NUMERICS = ["exact"] + (["fast"] if kernels.integer_block_matmul("q4_1") is not None else [])
CASES = [("hello world hello world", "greedy", {}), ("abcabcabcabc" * 6, "pld", {"budget": 4}),
         ("Q: 1+1? A: 2. Q:", "sample", {"temperature": 0.8, "seed": 3}), ("x y z " * 20, "recycling", {"budget": 4}),
         ("the cat sat", "lookahead", {"temperature": 0.7, "seed": 1})]


def base(numerics: str):
    # head size 16: the one-call layer path batching needs
    return tiny_llama(seed=0, hidden_size=64, max_position=1024, numerics=numerics, gguf_blocks=True)


def generate(backend, case, **kw):
    prompt, method, options = case
    engine = Engine(LoadedModel(backend, CharTokenizer(96), "tiny"))
    return engine.generate(prompt, method=method, max_new_tokens=30, chat=False, **options, **kw).tokens


def concurrently(model, batcher: PassBatcher, cases) -> list:
    got = [None] * len(cases)
    together = threading.Barrier(len(cases))  # every request is a member before any reads its prompt

    def work(i: int) -> None:
        single_threaded()
        backend = model.clone()
        backend.batcher = batcher
        with batcher.member():
            together.wait()
            got[i] = generate(backend, cases[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    return got, threads


def member_generate(model, batcher: PassBatcher, case) -> list[int]:
    backend = model.clone()
    backend.batcher = batcher
    return generate(backend, case)


def as_members(model, batcher: PassBatcher, cases) -> list:
    """The cases decoded as members of ``batcher`` on this thread (as the server runs requests)."""
    return batcher.run_here([functools.partial(member_generate, model, batcher, case) for case in cases])


def assert_batched_as_alone(model, cases, shared: bool = True) -> None:
    """The cases run concurrently on clones of ``model``, as threads and as members, give each case
    the tokens it gets alone, in passes that were shared (unless ``shared`` is False: a policy
    whose passes never batch)."""
    alone = [generate(model.clone(), case) for case in cases]
    batcher = PassBatcher()
    got, threads = concurrently(model, batcher, cases)
    for t in threads:
        t.join()
    assert got == alone
    assert batcher.rows > batcher.passes or not shared
    batcher = PassBatcher(own_thread=False)
    assert as_members(model, batcher, cases) == alone
    assert batcher.rows > batcher.passes or not shared


@pytest.mark.parametrize("numerics", NUMERICS)
def test_each_request_gets_its_own_tokens_in_a_shared_batch(numerics):
    assert_batched_as_alone(base(numerics), CASES)


def test_a_served_pass_that_skips_layers_or_asks_for_hidden_states_gets_what_it_gets_alone():
    """The batcher runs every layer and returns no hidden states: a served clone's pass that skips
    layers (a self-speculation draft) or asks for hidden states runs on its own, with the logits
    and hidden states it gets alone, as does a last-only prompt pass through the batcher."""
    model = tiny_llama(seed=0, hidden_size=64, max_position=1024, num_layers=3)
    if model._stack is None:
        pytest.skip("kernels unavailable on this machine")
    prompt = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(5))
    step, pair = torch.tensor([[6]]), torch.tensor([[7, 8]])
    alone, served = model.clone(), model.clone()
    batcher = PassBatcher()
    served.batcher = batcher
    try:
        with batcher.member():
            got = [served.append(prompt, last_only=True), served.append(step, skip_layers=frozenset({1})),
                   served.append(pair, hidden_layers=(1,))]
    finally:
        batcher.close()
    want = [alone.append(prompt, last_only=True), alone.append(step, skip_layers=frozenset({1})),
            alone.append(pair, hidden_layers=(1,))]
    for g, w in zip(got, want):
        assert torch.equal(g.logits, w.logits)
    assert torch.equal(got[2].hidden[1], want[2].hidden[1])


def test_searches_and_self_truncated_drafts_get_their_own_tokens_in_a_shared_batch():
    """A search's passes over several rows and a self-truncated draft's passes (fewer layers than the
    batched passes run) never join a batch: each request gets the tokens it gets alone beside the
    batched ones."""
    cases = [("hello world", "beam", {"n": 3}), ("abcabcabc", "draft", {"draft_model": "self-truncated:1"})]
    assert_batched_as_alone(base("exact"), CASES[:2] + cases)


def test_a_served_search_takes_turns_with_the_other_requests_passes():
    """A search's passes over several rows never batch. Run at once, they held the pass thread, and
    every other request with it, until the search ended; each now takes a turn after the others'
    passes: the plain request's steps run between the search's, and each gets the tokens it gets alone."""
    model = base("exact")
    cases = [("hello world", "beam", {"n": 3}), ("abcabcabc", "greedy", {})]
    alone = [generate(model.clone(), case) for case in cases]
    batcher = PassBatcher(own_thread=False)
    order: list[str] = []
    execute = batcher._execute

    def logged(batch) -> None:
        order.append("search" if batch[0].work is not None else "batch")
        execute(batch)

    batcher._execute = logged
    assert as_members(model, batcher, cases) == alone
    turns = [i for i, kind in enumerate(order) if kind == "search"]
    assert len(turns) > 10 and all(order[i + 1] == "batch" for i in turns[:10])  # the others' steps between them
    # alone, a search's passes run at once: no turn to wait for
    batcher, order[:] = PassBatcher(own_thread=False), []
    batcher._execute = logged
    assert as_members(model, batcher, cases[:1]) == alone[:1] and "search" not in order


@pytest.mark.parametrize("numerics", NUMERICS)
def test_gemma3_requests_get_their_own_tokens_in_a_shared_batch(numerics):
    """Gemma 3's sliding-window layers in a batch: each sequence's window is its own."""
    assert_batched_as_alone(tiny_gemma3(seed=2, sliding_window=8, numerics=numerics), CASES)


def test_constrained_requests_with_forced_text_get_their_own_tokens_in_a_shared_batch():
    """Structured output in a batch: each request's mask and its forced text (verified as a free draft
    by the speculative ones) are its own."""
    pytest.importorskip("llguidance")
    fixed = {"constraint": {"regex": r"ab[0-9]cdefghij[0-9]{1,8}"}}
    cases = [("hello", "greedy", fixed), ("abab ab1cdefghij", "pld", {**fixed, "budget": 4}),
             ("xyz", "sample", {**fixed, "temperature": 0.8, "seed": 2}),
             ("q: ab", "suffix", {**fixed, "temperature": 0.8, "seed": 4})]
    assert_batched_as_alone(base(NUMERICS[-1]), cases)


@pytest.mark.parametrize("cache", ["int8", "int4:group=8,residual=64", "sink:4,window:24,every:4", "snapkv:budget=40,window=8"])
def test_a_compressed_cache_gives_the_same_tokens_alone_and_batched(cache):
    """The int8, int4 and evicting caches under batching: each request keeps its own policy's entries, and
    its tokens do not depend on the batch."""
    cases = [c for c in CASES if c[1] != "lookahead"]  # lookahead verifies windows of several branches
    assert_batched_as_alone(base("exact").with_kv_cache(cache), cases)


@pytest.mark.parametrize("cache", ["h2o:budget=40,window=8", "snapkv:budget=60,window=40"])
def test_a_policy_that_observes_a_long_prompt_reads_it_as_alone_when_batched(cache):
    """H2O evicts by the attention of every pass, SnapKV by its window's: a prompt longer than a
    served chunk is read in the passes it gets alone (it was read 32 tokens a pass while others ran)."""
    long = "the cat sat on the mat and the dog sat on the log; " * 3
    cases = [(long, "sample", {"temperature": 0.8, "seed": 1}), ("hello", "greedy", {}), (long[::-1], "greedy", {}),
             ("abc " * 20, "pld", {"budget": 3})]
    assert_batched_as_alone(base("exact").with_kv_cache(cache), cases, shared=not cache.startswith("h2o"))


def test_passes_can_run_on_the_callers_thread():
    """serve(): the main thread runs every pass (as `decodekit serve` does) until told to stop."""
    model = base(NUMERICS[-1])
    alone = [generate(model.clone(), case) for case in CASES[:3]]
    batcher, stop = PassBatcher(own_thread=False), threading.Event()
    got, threads = concurrently(model, batcher, CASES[:3])
    threading.Thread(target=lambda: ([t.join() for t in threads], stop.set(), batcher.stop_waiting())).start()
    batcher.serve(stop)
    assert got == alone and batcher.passes > 0


def test_members_share_every_pass_and_their_errors_reach_their_futures():
    """Members run on the pass thread between their passes, so every batch holds a pass of each
    member still decoding (none waits for a straggler); one member's error is its own future's,
    and the others finish."""
    model = base(NUMERICS[-1])
    batcher = PassBatcher(own_thread=False)
    sizes: list[int] = []
    execute = batcher._execute
    batcher._execute = lambda batch: (sizes.append(len(batch)), execute(batch))
    cases = [("hello world hello world", "greedy", {}), ("the cat sat", "greedy", {})]
    assert as_members(model, batcher, cases) == [generate(model.clone(), case) for case in cases]
    assert sizes[0] == 2 and sizes == sorted(sizes, reverse=True)  # both in every batch until one is done
    # members run in inference mode, as the loop does (their thread's state is the same at every
    # switch), and the serving thread's own state is what it was
    assert PassBatcher(own_thread=False).run_here([torch.is_inference_mode_enabled]) == [True]
    assert not torch.is_inference_mode_enabled()

    def failing():
        raise ValueError("a member's own error")

    futures = [batcher.start(failing), batcher.start(functools.partial(member_generate, model, batcher, cases[1]))]
    until = threading.Event()
    futures[1].add_done_callback(lambda _: until.set())
    batcher.serve(until)
    assert isinstance(futures[0].exception(), ValueError) and futures[1].result() == generate(model.clone(), cases[1])
    assert batcher.active == 0
    with pytest.raises(ValueError, match="a member's own error"):  # run_here raises it
        batcher.run_here([functools.partial(member_generate, model, batcher, cases[0]), failing])
    assert batcher.run_here([]) == []
    closed = PassBatcher()
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):  # its thread would never run the member
        closed.start(failing)


def test_a_long_prompt_arrives_in_chunks_and_errors_reach_the_request():
    """Beside another request, a prompt is read PREFILL_CHUNK tokens a pass (the other's steps
    get through between them); alone, in the batcher's largest passes."""
    model = base(NUMERICS[-1])
    tokens = torch.randint(0, 96, (1, 3 * PREFILL_CHUNK + 5), generator=torch.Generator().manual_seed(0))
    logits = {}
    for others, passes in ((1, 4), (0, 2)):
        backend = model.clone()
        backend.batcher = PassBatcher(max_rows=2 * PREFILL_CHUNK, wait_s=0.0)
        with contextlib.ExitStack() as members:
            for _ in range(1 + others):
                members.enter_context(backend.batcher.member())
            logits[others] = backend.append(tokens).logits
        assert backend.batcher.passes == passes and backend.length == tokens.shape[1]
        assert logits[others].shape[1] == tokens.shape[1]
    assert torch.equal(logits[0], logits[1])  # rows are computed independently: any chunking gives the same bits
    backend = model.clone()
    backend.batcher = PassBatcher()
    with backend.batcher.member(), pytest.raises(ValueError, match="exceeds the model's context"):
        backend.append(torch.zeros(1, 2000, dtype=torch.long))


@pytest.mark.parametrize("numerics", NUMERICS)
def test_prefill_is_the_same_alone_and_served(numerics):
    """A prompt is always read in chunks by the same kernels, so its logits are the same bits alone
    (chunks of 64) and served beside another request (chunks of 32); in the exact numerics a prompt
    read alone went through torch in one pass, and its logits differed in their last bits."""
    model = base(numerics)
    tokens = torch.randint(0, 96, (1, 300), generator=torch.Generator().manual_seed(1))
    alone = model.clone().append(tokens).logits
    served = model.clone()
    served.batcher = PassBatcher(wait_s=0.0)
    with served.batcher.member(), served.batcher.member():
        assert torch.equal(served.append(tokens).logits, alone)
    assert served.batcher.rows == 300 and served.batcher.passes == 10


@pytest.mark.parametrize("numerics", NUMERICS)
def test_a_kept_prefix_gives_the_logits_of_a_fresh_prefill(numerics):
    """Passes being row-independent (served or alone, either numerics), prefill keeps the part of
    the cache a new prompt shares with ``kept_ids`` and reads the rest: the same bits as reading it all."""
    model = base(numerics)
    backend = model.clone()
    backend.batcher = PassBatcher()
    first = torch.randint(1, 96, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    second = first[:70] + [5, 6, 7]
    with backend.batcher.member():
        backend.prefill(first)
        backend.kept_ids = first
        assert backend.shared_prefix(second) == 70
        reused = backend.prefill(second)
        backend.reset()
        assert backend.kept_ids is None and backend.shared_prefix(second) == 0
        assert torch.equal(reused, backend.prefill(second))
    alone = model.clone()  # alone too, now that a prompt read alone takes the kernels in exact as well
    alone.prefill(first)
    alone.kept_ids = first
    assert alone.shared_prefix(second) == 70
    reused = alone.prefill(second)
    alone.reset()
    assert torch.equal(reused, alone.prefill(second))


def test_the_same_prompt_again_reads_its_last_token_for_its_logits():
    """A prompt equal to ``kept_ids`` takes all but its last token from the cache: the last is read
    again, for the logits the request starts from (none would be left to read otherwise)."""
    backend = base("exact").clone()
    prompt = torch.randint(1, 96, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    backend.prefill(prompt)
    backend.kept_ids = prompt
    assert backend.shared_prefix(prompt) == len(prompt) - 1
    reused = backend.prefill(prompt)
    backend.reset()
    assert torch.equal(reused, backend.prefill(prompt))


@pytest.mark.parametrize("cache", ["int4:group=8,residual=64", "int2:group=8,residual=64", "sink:4,window:24,every:4",
                                   "h2o:budget=40,window=8"])
def test_a_cache_without_its_prompts_float_entries_takes_no_prefix(cache):
    """KIVI's quantised tokens and an evicting cache's dropped ones cannot be rolled back to (nor
    read as a fresh prefill reads them): a prompt that starts like ``kept_ids`` is read whole."""
    backend = base("exact").with_kv_cache(cache)
    first = torch.randint(1, 96, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    second = first[:150] + [5, 6, 7]
    backend.prefill(first)
    backend.kept_ids = first
    assert not backend.reuses_prefix() and backend.shared_prefix(second) == 0
    reused = backend.prefill(second)
    backend.reset()
    assert torch.equal(reused, backend.prefill(second))


@pytest.mark.parametrize("numerics", NUMERICS)
def test_trained_drafters_read_their_features_from_a_shared_batch(numerics):
    """EAGLE, Medusa and Hydra read each pass's features; served, the batch hands each sequence its own."""
    from tests.conftest import required_options

    model = base(numerics)
    cases = [("abcabcabcabc" * 4, method, {"budget": 4, **required_options(method, model)})
             for method in ("eagle", "medusa", "hydra")]
    assert_batched_as_alone(model, cases + CASES[:2])


def test_a_served_pass_returns_the_features_of_a_pass_alone():
    model = base("exact")
    alone = model.clone()
    alone.prefill([5, 6, 7, 8])
    served, batcher = model.clone(), PassBatcher()
    served.batcher = batcher
    with batcher.member():
        served.prefill([5, 6, 7, 8])
        assert batcher.passes == 1
    assert served.last_features.shape == (1, 4, model.info.hidden_size)
    assert torch.equal(served.last_features, alone.last_features)


def waiting_pass(rows: int, model: object):
    from decodekit.models.batching import _Pass

    return _Pass(None, torch.zeros(rows, dtype=torch.long), torch.arange(rows), None, 0, False, model)


def test_a_batch_waits_for_every_active_sequence_and_keeps_to_its_rows_and_model():
    """What _ready takes off the queue: nothing while an active sequence has no pass in and the
    wait is not over; then the oldest passes of the oldest pass's model, never past max_rows
    (a pass is never split, so one larger than max_rows runs alone)."""
    llama, gemma = object(), object()
    batcher = PassBatcher(max_rows=64, wait_s=3600.0)
    batcher._active = 4
    with batcher._cond:
        batcher._waiting = [waiting_pass(30, llama), waiting_pass(1, gemma), waiting_pass(30, llama)]
        assert batcher._ready() == []  # the fourth sequence is still choosing its tokens
        batcher._waiting.append(waiting_pass(10, llama))
        first, second, third, fourth = batcher._waiting
        assert batcher._ready() == [first, third]  # 60 rows; the 10 more would pass 64
        assert batcher._waiting == [second, fourth]
        assert batcher._ready() == []  # two of four sequences have a pass in
        batcher.wait_s = 0.0  # the wait is over
        assert batcher._ready() == [second]  # now the oldest: its model's passes only
        assert batcher._ready() == [fourth]
        batcher._waiting = [waiting_pass(70, llama), waiting_pass(1, llama)]
        assert [len(p.tokens) for p in batcher._ready()] == [70]


def test_a_later_pass_never_jumps_one_that_does_not_fit():
    """Batches take passes oldest first: the first that would pass ``max_rows`` ends the batch,
    so a later, smaller pass does not run before it (which could hold a large pass back for ever)."""
    model = object()
    batcher = PassBatcher(max_rows=64, wait_s=0.0)
    with batcher._cond:
        batcher._waiting = [waiting_pass(30, model), waiting_pass(40, model), waiting_pass(2, model)]
        first, second, third = batcher._waiting
        assert batcher._ready() == [first]
        assert batcher._ready() == [second, third]


def test_a_batch_runs_once_its_rows_reach_max_rows_and_waits_from_the_last_batchs_end():
    """Passes that fill exactly ``max_rows`` make a batch at once (none could join it); a pass that
    arrived while a batch was running waits ``wait_s`` from that batch's end, not from its arrival
    (the batch's sequences are coming back with their next passes)."""
    import time

    model = object()
    batcher = PassBatcher(max_rows=64, wait_s=3600.0)
    batcher._active = 3
    with batcher._cond:
        batcher._waiting = [waiting_pass(32, model), waiting_pass(32, model)]
        assert len(batcher._ready()) == 2  # 64 rows: full, though a third sequence has no pass in
        batcher.wait_s = 5.0
        late = waiting_pass(1, model)
        late.arrived = time.perf_counter() - 10.0  # waited 10 s, but a batch ended just now
        batcher._last_end = time.perf_counter()
        batcher._waiting = [late]
        assert batcher._ready() == []
        batcher._last_end -= 10.0  # that batch ended 10 s ago: the wait is over
        assert batcher._ready() == [late]


class StubBackend:
    """Runs a batch by returning empty outputs, or by raising ``error``."""

    def __init__(self, error: BaseException | None = None):
        self.error = error

    def forward_batch(self, passes):
        if self.error is not None:
            raise self.error
        return [(torch.zeros(len(p.tokens), 1), torch.zeros(len(p.tokens), 1)) for p in passes]


def stub_pass(rows: int, backend: StubBackend):
    from decodekit.models.batching import _Pass

    return _Pass(backend, torch.zeros(rows, dtype=torch.long), torch.arange(rows), None, 0, False, None)


def test_a_failed_batch_hands_its_error_to_every_sequence_in_it():
    """Each request waiting on the batch hears of the error, not only the first (the others would
    find no output and fail with an unrelated assertion)."""
    failing = StubBackend(ValueError("the kernels failed"))
    batch = [stub_pass(1, failing), stub_pass(3, StubBackend()), stub_pass(2, StubBackend())]
    PassBatcher()._execute(batch)
    for job in batch:
        assert job.done.is_set() and job.output is None and job.error is failing.error


def test_a_pass_whose_batch_fails_raises_the_batchs_error_in_its_request():
    """A request decoding on a thread of its own or as a member hears of its batch's error as that
    error (not as a missing output)."""
    def failing(passes):
        raise RuntimeError("the batch failed")

    for own_thread in (True, False):
        backend = base("exact").clone()
        backend.batcher = PassBatcher(own_thread=own_thread)
        backend.forward_batch = failing  # (the batch runs on its first pass's backend)
        step = functools.partial(backend.append, torch.tensor([[1, 2]]))
        with pytest.raises(RuntimeError, match="the batch failed"):
            if own_thread:
                with backend.batcher.member():
                    step()
            else:
                backend.batcher.run_here([step])
        backend.batcher.close()


def test_the_pass_that_completes_a_batch_wakes_the_pass_thread():
    """A batch runs as soon as every active sequence has a pass in: the pass that completes it
    wakes the pass thread, which otherwise sleeps until ``wait_s`` (an hour here) is over."""
    batcher = PassBatcher(wait_s=3600.0)
    batcher._active = 2
    backends = [StubBackend(), StubBackend()]
    results = []

    def request(backend: StubBackend) -> None:
        backend.batch_key = None
        results.append(batcher.run(backend, torch.zeros(1, dtype=torch.long), torch.arange(1), None, 0, False))

    threads = [threading.Thread(target=request, args=(b,), daemon=True) for b in backends]
    threads[0].start()
    while not batcher._waiting:  # the first pass is in: the pass thread starts its wait
        threading.Event().wait(0.01)
    threading.Event().wait(0.2)  # (the pass thread now sleeps in its wait)
    threads[1].start()
    for t in threads:
        t.join(timeout=5)
    assert len(results) == 2 and batcher.passes == 1
    batcher._active = 0
    batcher.close()


def test_others_are_the_sequences_of_the_last_batch_only():
    """What a speculation budget weighs its rows against is the last batch, not every sequence
    seen so far: one that left no longer counts."""
    me, gone = StubBackend(), StubBackend()
    batcher = PassBatcher()
    batcher._execute([stub_pass(1, me), stub_pass(5, gone)])
    assert batcher.others(me) == (1, 5)
    batcher._execute([stub_pass(2, me)])
    assert batcher.others(me) == (0, 0)
    assert batcher.others(gone) == (1, 2)


def test_a_closed_batchers_thread_runs_the_passes_already_waiting():
    """Closing ends the batcher's own thread only once no request is left whose passes it would
    run: a pass already waiting still runs (its request would otherwise wait for ever)."""
    batcher = PassBatcher(wait_s=0.0)
    job = stub_pass(1, StubBackend())
    batcher._waiting = [job]
    closed = threading.Event()
    closed.set()
    batcher._loop(closed)
    assert job.done.is_set() and job.output is not None and batcher._waiting == []


def test_a_closed_batcher_ends_its_thread_once_no_request_is_left():
    """Its own thread ran for ever (a scheduler closed, or training's batcher per wave of answers,
    left one behind each time); a request still decoding when it is closed keeps it until it ends."""
    model = base("exact")

    def passes_thread() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "decodekit-passes"]

    before = len(passes_thread())
    backend, batcher = model.clone(), PassBatcher()
    backend.batcher = batcher
    with batcher.member():
        backend.prefill([1, 2, 3])
        batcher.close()  # a request still in: its passes are still run
        backend.step(torch.tensor([4]))
        assert len(passes_thread()) == before + 1
    batcher._thread.join(timeout=10)
    assert len(passes_thread()) == before


def test_a_batch_counts_one_pass_and_every_row_it_carried():
    """The metrics (``decodekit:batched_passes``, ``decodekit:batched_rows``): one pass per batch, and
    the rows of all its sequences' passes, not the number of sequences."""
    batcher = PassBatcher()
    batcher._execute([stub_pass(1, StubBackend()), stub_pass(5, StubBackend())])
    batcher._execute([stub_pass(3, StubBackend())])
    assert (batcher.passes, batcher.rows) == (2, 9)


def test_a_request_is_woken_only_once_its_output_is_in():
    """The request thread reads its pass's output as soon as ``done`` is set: it must be set after the
    output (or the error) is stored, for every pass of the batch."""
    batch = [stub_pass(1, StubBackend()), stub_pass(2, StubBackend())]
    seen = []

    class Recording(threading.Event):
        def __init__(self, job):
            super().__init__()
            self.job = job

        def set(self):
            seen.append(self.job.output is not None or self.job.error is not None)
            super().set()

    for job in batch:
        job.done = Recording(job)
    PassBatcher()._execute(batch)
    assert seen and all(seen)
    assert all(job.output is not None and job.error is None for job in batch)


def test_a_request_that_leaves_lets_the_passes_waiting_for_it_run_at_once():
    """A batch waits for every active sequence's pass; a sequence that leaves instead wakes the pass
    thread, so the others' passes run now, not after ``wait_s`` (an hour here)."""
    batcher = PassBatcher(wait_s=3600.0)
    backend = StubBackend()
    backend.batch_key = None
    results, leave, inside = [], threading.Event(), threading.Event()

    def leaver() -> None:
        with batcher.member():
            inside.set()
            leave.wait()

    def request() -> None:
        with batcher.member():
            results.append(batcher.run(backend, torch.zeros(1, dtype=torch.long), torch.arange(1), None, 0, False))

    threads = [threading.Thread(target=leaver, daemon=True), threading.Thread(target=request, daemon=True)]
    threads[0].start()
    inside.wait(5)
    threads[1].start()
    while not batcher._waiting:  # the pass is in: the pass thread waits for the leaver's
        threading.Event().wait(0.01)
    threading.Event().wait(0.2)  # (the pass thread now sleeps in its wait)
    leave.set()
    for t in threads:
        t.join(timeout=5)
    assert len(results) == 1 and batcher.passes == 1
    batcher.close()


def test_serve_runs_the_passes_until_its_event_is_set():
    """serve() keeps running passes on the calling thread while ``until`` is unset (a request's pass
    sent after it started still runs), and returns once it is set."""
    batcher, until = PassBatcher(own_thread=False, wait_s=0.0), threading.Event()
    server = threading.Thread(target=batcher.serve, args=(until,), daemon=True)
    server.start()
    backend, results = StubBackend(), []
    backend.batch_key = None

    def request() -> None:
        with batcher.member():
            results.append(batcher.run(backend, torch.zeros(2, dtype=torch.long), torch.arange(2), None, 0, False))

    client = threading.Thread(target=request, daemon=True)
    client.start()
    client.join(timeout=5)
    assert len(results) == 1 and batcher.passes == 1
    until.set()
    batcher.stop_waiting()
    server.join(timeout=5)
    assert not server.is_alive()


def test_serve_is_refused_for_a_batcher_with_a_thread_of_its_own():
    """A batcher runs its passes on one thread: its own, or the caller of serve(), never both; and
    run_here refuses before it starts any work (none is left running on a call that failed)."""
    until = threading.Event()
    until.set()
    with pytest.raises(RuntimeError, match="thread of its own"):
        PassBatcher().serve(until)
    batcher, ran = PassBatcher(), []
    with pytest.raises(RuntimeError, match="thread of its own"):
        batcher.run_here([lambda: ran.append(True)])
    assert batcher.active == 0 and batcher._thread is None and not ran


def test_an_interrupt_in_one_member_leaves_the_pass_loop_at_once():
    """Ctrl-C while a member chooses its tokens (train-drafter's answers run as members) leaves
    run_here at once, not after every other member has decoded to its end."""
    batcher, backend = PassBatcher(own_thread=False, wait_s=0.0), StubBackend()
    backend.batch_key = None

    def passes(n: int, interrupted: bool = False) -> None:
        for _ in range(n):
            batcher.run(backend, torch.zeros(1, dtype=torch.long), torch.arange(1), None, 0, False)
        if interrupted:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        batcher.run_here([functools.partial(passes, 2, interrupted=True), functools.partial(passes, 1000)])
    assert batcher.passes == 2


def test_closing_with_a_request_still_in_leaves_its_thread_running_without_waiting():
    """close() joins the batcher's own thread only once no request is left; with one still decoding the
    thread keeps running its passes, and the caller (often that request) is not held up."""
    batcher, backend, joined = PassBatcher(wait_s=0.0), StubBackend(), []
    backend.batch_key = None
    with batcher.member():
        batcher.run(backend, torch.zeros(1, dtype=torch.long), torch.arange(1), None, 0, False)  # starts the thread
        thread = batcher._thread
        join = thread.join
        thread.join = lambda timeout=None: joined.append(timeout)
        batcher.close()
        assert joined == [] and thread.is_alive()
        batcher.run(backend, torch.zeros(1, dtype=torch.long), torch.arange(1), None, 0, False)  # still served
    batcher.close()
    assert len(joined) == 1
    join(timeout=5)
    assert not thread.is_alive()
    # a pass after that is refused: no thread is left to run it, and it would wait for ever
    outcome = []

    def late_request() -> None:
        try:
            batcher.run(backend, torch.zeros(1, dtype=torch.long), torch.arange(1), None, 0, False)
        except RuntimeError as err:
            outcome.append(err)

    late = threading.Thread(target=late_request, daemon=True)
    late.start()
    late.join(timeout=5)
    assert len(outcome) == 1 and "closed" in str(outcome[0])


def test_a_failed_turn_raises_in_its_member():
    batcher = PassBatcher(own_thread=False)

    def boom():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        batcher.run_here([lambda: batcher.take_turn(None, 1, boom), lambda: None])


@pytest.fixture
def slow_idle(monkeypatch):
    """An idle pass thread that would sleep 30 s unless woken: a missed wake-up is plain to see."""
    from decodekit.models import batching

    monkeypatch.setattr(batching, "IDLE_WAIT_S", 30.0)


def test_a_member_started_on_an_idle_pass_thread_begins_at_once(slow_idle):
    import time

    batcher = PassBatcher()
    try:
        batcher.start(lambda: None).result(timeout=60)
        time.sleep(0.05)  # the pass thread now sleeps in its idle wait
        began = time.perf_counter()
        batcher.start(lambda: None).result(timeout=60)
        assert time.perf_counter() - began < 10
    finally:
        batcher.close()


def test_closing_an_idle_batcher_ends_its_thread_at_once(slow_idle):
    import time

    batcher = PassBatcher()
    batcher.start(lambda: None).result(timeout=60)
    time.sleep(0.05)
    began = time.perf_counter()
    batcher.close()
    assert not batcher._thread.is_alive() and time.perf_counter() - began < 10



def test_a_served_search_turn_counts_its_rows():
    """A search's turn is a pass of all its rows: the batcher counts them (its rows, and what the other
    requests see of the last batch), as it counts every batched pass's."""
    model = base("exact")
    cases = [("hello world", "beam", {"n": 3}), ("abcabcabc", "greedy", {})]
    batcher = PassBatcher(own_thread=False)
    turns = []
    execute = batcher._execute

    def logged(batch) -> None:
        before = batcher.rows
        execute(batch)
        if batch[0].work is not None:
            turns.append((len(batch[0].tokens), batcher.rows - before, sum(batcher._last_batch.values())))

    batcher._execute = logged
    as_members(model, batcher, cases)
    assert len(turns) > 10
    assert all(rows >= 2 and counted == rows and last == rows for rows, counted, last in turns)
