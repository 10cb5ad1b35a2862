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
