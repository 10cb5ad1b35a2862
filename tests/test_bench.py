"""Tests for decodekit.bench: questions, interleaving, records and summary schema, exactness,
report writers, --compare, baselines on a tiny model, and bad input."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest

from decodekit.bench import cli as bench_cli
from decodekit.bench.baselines import HFGenerate, build_baselines
from decodekit.bench.contestants import WARMUP_PROMPT, Contestant, MethodContestant, RunResult
from decodekit.bench.execution import execute
from decodekit.bench.plot import plot_speedup
from decodekit.bench.questions import balanced, category_group, load_questions, resolve_question_file
from decodekit.bench.report import compare, markdown_report, terminal_report, write_report
from decodekit.bench.results import STAT_KEYS, build_results, load_results, summarize, validate_results
from decodekit.bench.runner import BenchConfig, run_bench, schedule
from decodekit.engine import Engine
from decodekit.errors import DecodeKitError, InvalidParameter, UnknownMethod
from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.tiny import tiny_hf_model, tiny_llama

CATEGORIES = ["writing", "math", "coding", "translation", "translation", "qa", "rag", "summarization"]


def write_questions(path: Path, categories=CATEGORIES, turns: int = 1) -> Path:
    lines = [
        {"question_id": i, "category": c, "turns": [f"Q{i} {c}: say more {t}" for t in range(turns)]}
        for i, c in enumerate(categories)
    ]
    path.write_text("\n".join(json.dumps(q) for q in lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    # scale 2: peaked distributions, so greedy rarely meets a near-tie between implementations.
    return LoadedModel(tiny_llama(seed=0, scale=2.0), CharTokenizer(), "tiny")


@pytest.fixture(scope="module")
def hf_tiny():
    """The same weights as ``tiny`` as a transformers model (built once: slow under load)."""
    return tiny_hf_model(seed=0, scale=2.0)


@pytest.fixture
def qfile(tmp_path: Path) -> Path:
    return write_questions(tmp_path / "q.jsonl")


class Scripted(Contestant):
    """A fake contestant: fixed tokens, fixed timings, and a log of the calls it received."""

    kind, family, lossless = "decodekit", "test", True

    def __init__(self, name: str, log: list, tokens=(5, 6, 7), decode_s: float = 0.01):
        self.name, self.log, self.tokens, self.decode_s = name, log, list(tokens), decode_s

    def fresh(self):
        self.log.append((self.name, "fresh"))

    def run(self, prompt_ids, max_new_tokens):
        self.log.append((self.name, list(prompt_ids)))
        tokens = self.tokens[:max_new_tokens]
        return RunResult(tokens, "x" * len(tokens), 0.002, self.decode_s, "length", forward_passes=len(tokens))


class Perturbed(MethodContestant):
    """Greedy, but appends a token on odd question prompts: deliberately not identical there."""

    def __init__(self, engine: Engine, name: str, odd_prompts: set[tuple[int, ...]]):
        super().__init__(engine, "greedy", name=name)
        self.odd = odd_prompts

    def run(self, prompt_ids, max_new_tokens):
        result = super().run(prompt_ids, max_new_tokens)
        if tuple(prompt_ids) in self.odd:
            result.tokens = result.tokens + [1]
        return result


def prompt_fn(model: LoadedModel):
    return model.prompt_ids


# --------------------------------------------------------------------------- questions


def test_questions_group_mt_bench_and_balance_per_group(qfile: Path):
    questions = load_questions(qfile, limit=2)
    groups = [q.group for q in questions]
    assert category_group("writing") == "mt_bench" and category_group("rag") == "rag"
    # mt_bench has 3 sub-categories; limit 2 takes one from each of the first two, round-robin.
    assert [q.category for q in questions if q.group == "mt_bench"] == ["writing", "math"]
    assert groups.count("translation") == 2 and groups.count("qa") == 1
    assert len(load_questions(qfile, categories=["mt_bench"])) == 3
    assert [q.category for q in load_questions(qfile, categories=["coding", "rag"])] == ["coding", "rag"]


def test_balanced_round_robin_over_subcategories(qfile: Path):
    questions = load_questions(qfile)
    picked = balanced([q for q in questions if q.group == "mt_bench"], 3)
    assert sorted(q.category for q in picked) == ["coding", "math", "writing"]


def test_question_file_resolution_and_errors(tmp_path: Path, monkeypatch):
    with pytest.raises(InvalidParameter, match="not found"):
        resolve_question_file(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "qa"}\n')
    with pytest.raises(InvalidParameter, match="bad.jsonl:1"):
        load_questions(bad)
    bad.write_text("not json\n")
    with pytest.raises(InvalidParameter, match="not valid JSON"):
        load_questions(bad)
    with pytest.raises(InvalidParameter, match="unknown category"):
        load_questions(write_questions(tmp_path / "q.jsonl"), categories=["poetry"])
    # A relative path is tried against the current directory first.
    monkeypatch.chdir(tmp_path)
    assert resolve_question_file("q.jsonl") == (tmp_path / "q.jsonl").resolve()


def test_a_question_file_may_be_named_from_home_and_a_folder_is_not_one(tmp_path: Path, monkeypatch):
    """--questions ~/q.jsonl is the file in the home folder; a folder is refused in one line, not
    read as a file."""
    monkeypatch.setenv("HOME", str(tmp_path))
    write_questions(tmp_path / "q.jsonl")
    assert resolve_question_file("~/q.jsonl") == (tmp_path / "q.jsonl").resolve()
    assert len(load_questions("~/q.jsonl")) == len(CATEGORIES)
    with pytest.raises(InvalidParameter, match="is a folder: give a file"):
        resolve_question_file(tmp_path)
    with pytest.raises(InvalidParameter, match="not found"):  # ~user of no user: a path, not a RuntimeError
        resolve_question_file("~no-such-user-of-decodekit/q.jsonl")


@pytest.mark.parametrize("limit", [0, -1])
def test_a_limit_below_one_is_refused_not_an_empty_benchmark(qfile: Path, limit):
    with pytest.raises(InvalidParameter, match=f"--limit must be an integer >= 1, got {limit}"):
        load_questions(qfile, limit=limit)


# --------------------------------------------------------------------------- interleaving


def test_schedule_rotates_and_runs_every_method_once():
    names = ["a", "b", "c"]
    slots = list(schedule(names, n_questions=4, repeats=2))
    assert len(slots) == 8
    assert [(r, q) for r, q, _ in slots] == [(r, q) for r in range(2) for q in range(4)]
    for _, _, order in slots:
        assert sorted(order) == names
    firsts = [order[0] for _, _, order in slots]
    assert firsts == ["a", "b", "c", "a", "b", "c", "a", "b"]  # rotation continues across repeats
    assert all(slots[i][2] != slots[i + 1][2] for i in range(len(slots) - 1))


def test_a_question_gets_a_different_order_in_every_repeat():
    """With as many questions as contestants, rotating per question alone would give each question
    the same order in every repeat (one contestant always first after a given other)."""
    names = ["a", "b", "c"]
    slots = list(schedule(names, n_questions=3, repeats=3))
    for q in range(3):
        firsts = [order[0] for r, qi, order in slots if qi == q]
        assert sorted(firsts) == names


def test_a_contestant_failing_to_start_a_repeat_is_noted_and_the_bench_goes_on(tiny: LoadedModel, qfile: Path):
    class Brittle(Scripted):
        def fresh(self):
            raise RuntimeError("no memory for a clone")

    log: list = []
    run = run_bench([Scripted("greedy", log), Brittle("b", log)], load_questions(qfile, limit=1), prompt_fn(tiny),
                    BenchConfig(max_new_tokens=2, repeats=2), progress=False)
    assert any("b failed in a repeat's warm-up: RuntimeError: no memory for a clone" in n for n in run.notes)
    assert {r["repeat"] for r in run.records if r["method"] == "greedy"} == {0, 1}


def test_timed_runs_start_with_collected_garbage_and_no_collection_during_them(tiny: LoadedModel, qfile: Path):
    import gc

    import weakref

    seen: list[bool] = []
    left: list[weakref.ref] = []  # a cycle each run leaves behind
    collected: list[bool] = []

    class Cycle:
        pass

    class Probe(Scripted):
        def run(self, prompt_ids, max_new_tokens):
            seen.append(gc.isenabled())
            collected.extend(ref() is None for ref in left)
            cycle = Cycle()
            cycle.me = cycle
            left.append(weakref.ref(cycle))
            return super().run(prompt_ids, max_new_tokens)

    def bench() -> None:
        run_bench([Probe("greedy", [])], load_questions(qfile, limit=2), prompt_fn(tiny), BenchConfig(max_new_tokens=2),
                  progress=False)

    gc.unfreeze()  # (the suite's own freeze: tests/conftest.py)
    bench()
    assert seen[0] is True and seen[1:] and not any(seen[1:])  # the warm-up is untimed; timed runs: off
    assert collected and all(collected)  # what earlier runs left was collected before each timed run
    assert gc.isenabled() and gc.get_freeze_count() == 0  # what the bench froze is collectable again
    gc.freeze()
    callers = gc.get_freeze_count()
    bench()
    assert gc.get_freeze_count() >= callers > 0  # a caller that froze its own objects finds them frozen still


def test_runner_follows_the_schedule_after_one_warmup_each(tiny: LoadedModel, qfile: Path):
    log: list = []
    contestants = [Scripted(n, log) for n in ("greedy", "b", "c")]
    questions = load_questions(qfile, limit=1)
    run = run_bench(contestants, questions, prompt_fn(tiny), BenchConfig(max_new_tokens=4, repeats=2), progress=False)
    warmup_ids = tiny.prompt_ids(WARMUP_PROMPT)
    names = ("greedy", "b", "c")
    assert log[:3] == [(n, warmup_ids) for n in names]
    # the second repeat starts as the first did: every contestant forgets and is warmed up again
    restart = [entry for n in names for entry in ((n, "fresh"), (n, warmup_ids))]
    per_repeat = len(questions) * 3
    assert log[3 + per_repeat: 3 + per_repeat + 6] == restart
    timed = [name for name, _ in log[3: 3 + per_repeat] + log[9 + per_repeat:]]
    expected = [name for _, _, order in schedule(["greedy", "b", "c"], len(questions), 2) for name in order]
    assert timed == expected
    assert [r["method"] for r in run.records] == expected
    assert [r["position"] for r in run.records] == [0, 1, 2] * (len(expected) // 3)


def test_a_fresh_method_contestant_forgets_what_it_learnt_but_keeps_the_model(tiny: LoadedModel):
    contestant = MethodContestant(Engine(LoadedModel(tiny.backend.clone(), tiny.tokenizer, "tiny")), "suffix",
                                  {"corpus": True, "cost_table": {1: 1.0, 64: 1.0}})
    ids = tiny.prompt_ids("abcabcabc")
    first = contestant.run(ids, 12)
    learnt = contestant.engine.model.backend
    assert {"suffix.corpus", "speculative.records"} <= set(learnt.__dict__["_memory"])
    contestant.fresh()
    backend = contestant.engine.model.backend
    assert backend is not learnt and not {"suffix.corpus", "speculative.records"} & set(backend.__dict__.get("_memory", {}))
    assert contestant.run(ids, 12).tokens == first.tokens  # same weights, same output


def test_all_turns_feeds_each_contestant_its_own_answers(tiny: LoadedModel, tmp_path: Path):
    questions = load_questions(write_questions(tmp_path / "q.jsonl", ["qa"], turns=2))
    log: list = []
    run = run_bench([Scripted("greedy", log, tokens=(40, 41))], questions, prompt_fn(tiny),
                    BenchConfig(max_new_tokens=2, all_turns=True), progress=False)
    first, second = log[1][1], log[2][1]
    answer = CharTokenizer().encode("xx")  # Scripted's text for two tokens
    assert second[: len(first)] == first and answer[0] in second[len(first):]
    assert run.records[0]["turns"] == 2 and run.records[0]["new_tokens"] == 4


def test_without_all_turns_a_record_counts_only_the_first_turn_it_ran(tiny: LoadedModel, tmp_path: Path):
    """By default only a question's first turn is fed: its record says one turn ran, not the file's two."""
    questions = load_questions(write_questions(tmp_path / "q.jsonl", ["qa"], turns=2))
    run = run_bench([Scripted("greedy", [], tokens=(40, 41))], questions, prompt_fn(tiny),
                    BenchConfig(max_new_tokens=2), progress=False)
    assert run.records[0]["turns"] == 1 and run.records[0]["texts"] == ["xx"] and run.records[0]["new_tokens"] == 2


def test_the_reference_failing_its_warm_up_ends_the_bench(tiny: LoadedModel, qfile: Path):
    """Every figure is relative to the reference: another contestant failing its warm-up is skipped,
    the reference failing it is an error, not a bench with no speedups."""
    class Broken(Scripted):
        def run(self, prompt_ids, max_new_tokens):
            raise RuntimeError("cannot start")

    with pytest.raises(RuntimeError, match="cannot start"):
        run_bench([Broken("greedy", []), Scripted("b", [])], load_questions(qfile, limit=1), prompt_fn(tiny),
                  BenchConfig(max_new_tokens=2), progress=False)


# --------------------------------------------------------------------------- records, summary, exactness

RECORD_TYPES = {
    "method": str, "kind": str, "family": str, "question_id": int, "category": str, "group": str, "repeat": int,
    "position": int, "turns": int, "prompt_tokens": int, "new_tokens": int, "prefill_s": float, "decode_s": float,
    "forward_passes": int, "decode_tps": float, "e2e_tps": float, "finish_reason": str, "identical_to_reference": bool,
    "text_match": bool, "text_prefix_share": float, "texts": list, "tokens": list, "extra": dict,
}


def exactness_run(tiny: LoadedModel, qfile: Path):
    engine = Engine(tiny)
    questions = load_questions(qfile, categories=["translation"])  # two questions
    odd = {tuple(tiny.prompt_ids(questions[1].turns[0]))}
    contestants = [MethodContestant(engine, "greedy"), Perturbed(engine, "greedy-again", set()), Perturbed(engine, "fake", odd)]
    return run_bench(contestants, questions, prompt_fn(tiny), BenchConfig(max_new_tokens=6), progress=False)


def test_records_have_the_documented_schema(tiny: LoadedModel, qfile: Path):
    run = exactness_run(tiny, qfile)
    assert len(run.records) == 3 * 2
    for rec in run.records:
        for key, kind in RECORD_TYPES.items():
            assert isinstance(rec[key], kind), (key, rec[key])
        assert rec["error"] is None and rec["lossless"] is True
        assert rec["decode_tps"] == pytest.approx(rec["new_tokens"] / rec["decode_s"])
        assert rec["e2e_tps"] == pytest.approx(rec["new_tokens"] / (rec["prefill_s"] + rec["decode_s"]))
    assert set(run.peak_rss_mb) == {"greedy", "greedy-again", "fake"}
    assert all(v > 0 for v in run.peak_rss_mb.values())


def test_exactness_statistic(tiny: LoadedModel, qfile: Path):
    run = exactness_run(tiny, qfile)
    summary = summarize(run.records, run.contestants, run.peak_rss_mb)
    overall = {name: info["categories"]["overall"] for name, info in summary["methods"].items()}
    assert overall["greedy"]["exact_share"] == 1.0
    assert overall["greedy-again"]["exact_share"] == 1.0
    assert overall["fake"]["exact_share"] == 0.5  # identical on one question of two
    assert overall["greedy"]["speedup"] == pytest.approx(1.0)
    notes = build_results(run, command="", config={}, machine={})["notes"]
    assert len(notes) == 1 and notes[0].startswith("fake is lossless but matched greedy on 50%")


def test_summary_schema_and_aggregates(tiny: LoadedModel, qfile: Path):
    log: list = []
    contestants = [Scripted("greedy", log, decode_s=0.02), Scripted("fast", log, decode_s=0.01)]
    questions = load_questions(qfile, limit=1)
    run = run_bench(contestants, questions, prompt_fn(tiny), BenchConfig(max_new_tokens=3), progress=False)
    summary = summarize(run.records, run.contestants, run.peak_rss_mb)
    assert summary["categories"] == ["mt_bench", "translation", "qa", "rag", "summarization", "overall"]
    assert summary["reference"] == "greedy" and summary["hf_reference"] is None
    for info in summary["methods"].values():
        assert {"kind", "family", "lossless", "token_exact", "peak_rss_mb", "categories"} <= info.keys()
        for stats in info["categories"].values():
            assert tuple(stats) == STAT_KEYS
    fast = summary["methods"]["fast"]["categories"]["overall"]
    assert fast["questions"] == 5 and fast["new_tokens"] == 15
    assert fast["decode_tps"] == pytest.approx(15 / 0.05)
    assert fast["speedup"] == pytest.approx(2.0)  # same tokens in half the decode time
    assert fast["e2e_speedup"] == pytest.approx((15 / 0.06) / (15 / 0.11))
    assert fast["passes_per_token"] == pytest.approx(1.0)


def test_speedup_is_taken_on_the_questions_the_reference_also_finished():
    def rec(method, qid, decode_s, new_tokens, error=None):
        return {"method": method, "question_id": qid, "group": "qa", "error": error, "prefill_s": 0.5,
                "decode_s": decode_s, "new_tokens": new_tokens, "forward_passes": new_tokens, "mean_accepted": None,
                "identical_to_reference": None, "text_match": None, "text_prefix_share": None}

    records = [rec("greedy", 1, d, 10) for d in (1.0, 1.2, 0.9)]  # median decode 1.0 s
    records += [rec("greedy", 2, 0.0, 0, error="boom")]  # the reference never finished question 2
    records += [rec("fast", 1, d, 10) for d in (0.5, 0.4, 0.6)]  # median 0.5 s
    records += [rec("fast", 2, 0.5, 30)]
    contestants = [{"name": n, "kind": "method", "family": n, "lossless": True, "token_exact": True}
                   for n in ("greedy", "fast")]
    fast = summarize(records, contestants, {})["methods"]["fast"]["categories"]
    for cat in ("qa", "overall"):
        stats = fast[cat]
        assert stats["questions"] == 2 and stats["new_tokens"] == 40
        assert stats["decode_tps"] == pytest.approx(40 / 1.0)  # its own throughput: every question it finished
        # against greedy on question 1 alone: 10 tokens in 0.5 s vs in 1.0 s; with prefill 1.0 s vs 1.5 s
        assert stats["speedup"] == pytest.approx(2.0)
        assert stats["e2e_speedup"] == pytest.approx(1.5)
        assert stats["speedup_vs_hf"] is None

def test_per_question_counts_are_observed_values_and_unknown_when_a_repeat_lacks_one():
    """Over repeats, a count is the lower median (one of the observed integers, not 10.5 tokens),
    and a count one repeat did not report is unknown, not the median of the others; times take the
    plain median."""
    from decodekit.bench.results import per_question

    def rec(new_tokens, passes, decode_s):
        return {"method": "m", "question_id": 1, "group": "qa", "error": None, "prefill_s": 0.1,
                "decode_s": decode_s, "mean_accepted": None, "new_tokens": new_tokens, "forward_passes": passes}

    row = per_question([rec(10, 8, 1.0), rec(11, None, 2.0)])["m"][1]
    assert row["new_tokens"] == 10 and row["forward_passes"] is None and row["decode_s"] == 1.5
    assert per_question([rec(11, 9, 1.0), rec(10, 8, 2.0)])["m"][1]["forward_passes"] == 8


def test_only_lossless_methods_are_flagged_for_outputs_other_than_greedys():
    """A lossy method (beam search, a sampler) is expected to differ from greedy: no note; a lossless
    one that differs is a bug or a near-tie, and is noted."""
    from decodekit.bench.results import exactness_notes

    def method(lossless):
        return {"lossless": lossless, "categories": {"overall": {"exact_share": 0.5}}}

    notes = exactness_notes({"reference": "greedy", "methods": {"spec": method(True), "beam": method(False)}})
    assert len(notes) == 1 and notes[0].startswith("spec is lossless but matched greedy on 50%")


def test_the_prefix_share_is_a_share_of_the_reference_text():
    """text_prefix_share: how much of greedy's text a method reproduces from the start."""
    from decodekit.bench.runner import common_prefix_share

    assert common_prefix_share("abc", "abcdef") == 0.5  # half of the reference, though all of the output
    assert common_prefix_share("abcdef", "abc") == 1.0
    assert common_prefix_share("abx", "abcd") == 0.5


def test_an_empty_reference_is_reproduced_only_by_an_empty_output():
    """Where greedy said nothing, an output that says nothing is all of it; one that says something is not greedy's."""
    from decodekit.bench.runner import common_prefix_share

    assert common_prefix_share("", "") == 1.0
    assert common_prefix_share("abc", "") == 0.0


def test_a_record_has_no_pass_count_when_one_of_its_turns_has_none():
    """A record's figures are sums over its turns: a turn whose passes are unknown leaves the sum unknown."""
    from decodekit.bench.questions import Question
    from decodekit.bench.runner import make_record

    question = Question(1, "qa", ("a", "b"))
    known, unknown = (RunResult([1, 2], "xy", 0.1, 0.2, "length", forward_passes=p) for p in (2, None))
    assert make_record(Scripted("m", []), question, 0, 0, [(3, known), (5, known)])["forward_passes"] == 4
    assert make_record(Scripted("m", []), question, 0, 0, [(3, known), (5, unknown)])["forward_passes"] is None


def test_failing_method_is_recorded_and_others_continue(tiny: LoadedModel, qfile: Path):
    class Flaky(Scripted):
        def run(self, prompt_ids, max_new_tokens):
            if len(self.log) > 2:  # fine in warm-up, then fails
                raise RuntimeError("boom")
            return super().run(prompt_ids, max_new_tokens)

    log: list = []
    run = run_bench([Scripted("greedy", []), Flaky("flaky", log)], load_questions(qfile, limit=1), prompt_fn(tiny),
                    BenchConfig(max_new_tokens=3), progress=False)
    errors = [r for r in run.records if r["error"]]
    assert errors and all(r["method"] == "flaky" and "boom" in r["error"] for r in errors)
    assert any("flaky failed" in n for n in run.notes)
    summary = summarize(run.records, run.contestants, run.peak_rss_mb)
    assert summary["methods"]["flaky"]["categories"]["overall"]["errors"] == len(errors)


# --------------------------------------------------------------------------- baselines


def test_hf_baseline_matches_native_greedy_on_same_weights(tiny: LoadedModel, hf_tiny):
    hf = HFGenerate(hf_tiny, tiny.tokenizer.eos_token_ids, tiny.tokenizer.decode)
    engine = Engine(tiny)
    for prompt in ("Hello there, how are you?", "Translate: Guten Tag"):
        ids = tiny.prompt_ids(prompt)
        ours = engine.generate(ids, method="greedy", max_new_tokens=12)
        theirs = hf.run(ids, 12)
        assert theirs.tokens == ours.tokens and theirs.finish_reason == ours.finish_reason
        assert theirs.prefill_s > 0 and theirs.decode_s >= 0
        assert theirs.forward_passes == ours.stats.forward_passes


def test_only_what_decodes_greedily_is_held_to_the_greedy_reference(tiny: LoadedModel, hf_tiny):
    """A lossless method that samples keeps plain sampling's tokens, not greedy's, and transformers'
    float32 tokens are not the fast numerics' 8-bit ones: neither is flagged as "a bug" for differing."""
    engine = Engine(tiny)
    assert MethodContestant(engine, "pld").lossless and not MethodContestant(engine, "sample").lossless
    assert not MethodContestant(engine, "pld", {"temperature": 0.7}).lossless
    for numerics, exact in (("exact", True), ("fast", False)):
        (hf,), _ = build_baselines(["hf"], tiny, model=None, dtype="float32", threads=1, hf_model=hf_tiny,
                                   numerics=numerics)
        assert hf.token_exact is exact


def test_only_the_hf_pld_baseline_looks_up_the_prompt_and_both_are_token_exact_only_in_exact(tiny: LoadedModel, hf_tiny):
    """``hf`` is plain ``generate()``, ``hf-pld`` the same with prompt lookup (10 tokens); both decode
    in transformers' float32, so their tokens are held one to one against ``exact`` greedy only."""
    for numerics, exact in (("exact", True), ("fast", False)):
        built, notes = build_baselines(["hf", "hf-pld"], tiny, model=None, dtype="float32", threads=1,
                                       hf_model=hf_tiny, numerics=numerics)
        assert [b.name for b in built] == ["hf", "hf-pld"] and notes == []
        plain, pld = built
        assert plain.prompt_lookup is None and "prompt_lookup_num_tokens" not in plain.generate_kwargs(8)
        assert pld.prompt_lookup == 10 and pld.generate_kwargs(8)["prompt_lookup_num_tokens"] == 10
        assert plain.token_exact is exact and pld.token_exact is exact


def test_hf_prompt_lookup_baseline_is_greedy(tiny: LoadedModel, hf_tiny):
    model = hf_tiny
    plain = HFGenerate(model, tiny.tokenizer.eos_token_ids, tiny.tokenizer.decode)
    pld = HFGenerate(model, tiny.tokenizer.eos_token_ids, tiny.tokenizer.decode, name="hf-pld", prompt_lookup=10)
    ids = tiny.prompt_ids("abc abc abc abc abc abc")
    assert pld.run(ids, 10).tokens == plain.run(ids, 10).tokens


def test_llamacpp_missing_is_a_note_not_an_error(tiny: LoadedModel, monkeypatch):
    monkeypatch.setattr("decodekit.bench.baselines.llamacpp_available", lambda: False)
    built, notes = build_baselines(["llamacpp"], tiny, model=None, dtype="float32", threads=1)
    assert built == [] and "llama-cpp-python is not installed" in notes[0]
    with pytest.raises(UnknownMethod, match="unknown baseline"):
        build_baselines(["vllm"], tiny, model=None, dtype="float32", threads=1)


# --------------------------------------------------------------------------- CLI plan, outputs, compare


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bad_input_raises_decodekit_errors(qfile: Path, tmp_path: Path):
    with pytest.raises(UnknownMethod):
        bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "greedy,no-such-method"))
    with pytest.raises(UnknownMethod):
        bench_cli.make_plan(parse("--questions", str(qfile), "--baselines", "hf,tgi"))
    with pytest.raises(DecodeKitError, match="not found"):
        bench_cli.make_plan(parse("--questions", str(tmp_path / "none.jsonl")))
    with pytest.raises(InvalidParameter, match="max-new-tokens"):
        bench_cli.make_plan(parse("--questions", str(qfile), "--max-new-tokens", "0"))
    with pytest.raises(InvalidParameter, match="not in --methods"):
        bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "greedy", "--opt", "pld.max_ngram=3"))
    with pytest.raises(InvalidParameter, match=r"^--opt pld.max_ngram=\.\.\. is given twice; give one$"):
        bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "pld", "--opt", "pld.max_ngram=3",
                                  "--opt", "pld.max_ngram=4"))
    with pytest.raises(InvalidParameter, match="draft_model"):  # named, but cannot be built: not a skip note later
        bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "greedy,draft"))
    with pytest.raises(InvalidParameter, match="not found"):
        load_results(tmp_path / "nothing.json")
    (tmp_path / "other.json").write_text('{"a": 1}')
    with pytest.raises(InvalidParameter, match="not a decodekit bench"):
        load_results(tmp_path / "other.json")


def test_cli_prints_one_line_error(capsys, tmp_path: Path):
    from decodekit.interfaces.cli import main

    assert main(["bench", "--questions", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("decodekit: error:") and "\n" not in err


def test_quick_skips_unregistered_defaults_with_a_note(qfile: Path, monkeypatch):
    monkeypatch.setattr(bench_cli, "QUICK_METHODS", ("greedy", "not-yet-registered"))
    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--quick"))
    assert plan.methods == ["greedy"] and plan.max_new_tokens == 64 and plan.limit == 1
    assert plan.baselines == ["hf"] and any("not-yet-registered" in n for n in plan.notes)
    assert "--max-new-tokens 64" in plan.command


def test_plan_always_includes_greedy_and_picks_up_registered_methods(qfile: Path, monkeypatch):
    from decodekit.engine import registry
    from decodekit.engine.core import PlainDecoding, StepDecoder

    monkeypatch.setitem(registry._METHODS, "fake-spec", registry.MethodSpec(
        "fake-spec", lambda **o: StepDecoder(PlainDecoding()), "test", lossless=True, family="speculative"))
    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--baselines", "none"))
    assert plan.methods[0] == "greedy" and "fake-spec" in plan.methods and plan.baselines == []
    # a method that does not build without options of the user's is left out, with a note, so that the
    # command recorded for the run runs again (naming draft without its draft_model is refused)
    assert "draft" not in plan.methods and any(n.startswith("draft: left out") for n in plan.notes)
    assert bench_cli.make_plan(parse(*shlex.split(plan.command)[2:])).methods == plan.methods
    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "fake-spec", "--opt", "fake-spec.k=2"))
    assert plan.methods == ["greedy", "fake-spec"] and plan.options == {"fake-spec": {"k": 2}}


def test_a_json_object_option_is_recorded_as_json_and_read_back(qfile: Path):
    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "pld", "--opt",
                                     'pld.cost_table={"1": 0.01, "8": 0.02}'))
    again = bench_cli.make_plan(parse(*shlex.split(plan.command)[2:]))
    assert again.options == plan.options == {"pld": {"cost_table": {"1": 0.01, "8": 0.02}}}


def test_a_question_category_named_like_the_reports_total_is_refused(tmp_path: Path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "overall", "turns": ["hi"]}) + "\n")
    with pytest.raises(InvalidParameter, match="reserved"):
        load_questions(path)


def test_a_category_with_a_pipe_or_a_line_break_keeps_the_reports_tables_whole(tiny: LoadedModel, tmp_path: Path):
    """A category is the question file's text: in report.md its pipes are escaped and its line
    breaks made spaces, so each table row keeps its columns and each heading its line."""
    qfile = write_questions(tmp_path / "q.jsonl", categories=["a|b", "two\nlines"])
    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "greedy", "--baselines", "none",
                                     "--max-new-tokens", "2", "--out", str(tmp_path / "out"), "--no-progress"))
    execute(plan, tiny, progress=False)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "### a|b (1 question)" in report and "### two lines (1 question)" in report
    for table in report.split("\n\n"):
        rows = [line for line in table.splitlines() if line.startswith("|")]
        if rows:  # every row of a table has its header's cells (escaped pipes are no cell ends)
            assert len({len(re.split(r"(?<!\\)\|", row)) for row in rows}) == 1, table
    assert "a\\|b" in report


def test_more_new_tokens_than_the_context_holds_is_one_error_not_every_question_failed(tiny: LoadedModel, qfile: Path,
                                                                                     tmp_path: Path):
    context = tiny.backend.info.max_length
    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "greedy", "--baselines", "none",
                                     "--limit", "1", "--categories", "qa", "--no-progress"))
    shortest = min(len(tiny.prompt_ids([{"role": "user", "content": q.turns[0]}])) for q in plan.questions)
    for max_new, refused in ((context, "no prompt fits"), (context - shortest + 1, "no question's prompt fits"),
                             (context - shortest, None)):
        plan = bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "greedy", "--baselines", "none",
                                         "--max-new-tokens", str(max_new), "--limit", "1", "--categories", "qa",
                                         "--out", str(tmp_path / str(max_new)), "--no-progress"))
        if refused:
            with pytest.raises(InvalidParameter, match=f"^--max-new-tokens {max_new}: {refused} beside that many new "
                                                       f"tokens in the model's context of {context}"):
                execute(plan, tiny, progress=False)
            assert not (tmp_path / str(max_new)).exists()
        else:
            assert execute(plan, tiny, progress=False)["records"]


def test_the_numerics_is_part_of_the_plan_its_command_and_its_resume_key(qfile: Path):
    exact = bench_cli.make_plan(parse("--questions", str(qfile), "--baselines", "none"))
    fast = bench_cli.make_plan(parse("--questions", str(qfile), "--baselines", "none", "--numerics", "fast"))
    assert (exact.numerics, fast.numerics) == ("exact", "fast")
    assert "--numerics fast" in fast.command and fast.config()["numerics"] == "fast"
    assert exact.resume_key() != fast.resume_key()  # a run in one numerics never resumes the other


@pytest.fixture(scope="module")
def executed(tiny: LoadedModel, hf_tiny, tmp_path_factory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("bench")
    qfile = write_questions(tmp / "q.jsonl")
    out = tmp / "out"
    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "greedy", "--baselines", "hf",
                                     "--max-new-tokens", "6", "--limit", "1", "--out", str(out)))
    results = execute(plan, tiny, hf_model=hf_tiny, progress=False)
    return results, out


def test_speculative_contestants_get_their_cost_table_before_the_warm_up(tiny: LoadedModel, tmp_path: Path, monkeypatch):
    """Measuring the verify costs belongs to set-up: neither a warm-up nor a timed question pays for it."""
    from decodekit.bench import runner

    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))
    checked = []

    def warm_up(contestants, *args, **kwargs):
        for c in contestants:
            if c.family == "speculative":
                c.engine.model.backend.memory("speculative.cost_table", lambda: pytest.fail("not prepared"))
                checked.append(c.name)
        return original(contestants, *args, **kwargs)

    original = runner.warm_up
    monkeypatch.setattr(runner, "warm_up", warm_up)
    qfile = write_questions(tmp_path / "q.jsonl", ["qa"])
    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "greedy,pld,recycling", "--baselines",
                                     "none", "--max-new-tokens", "4", "--out", str(tmp_path / "out")))
    execute(plan, tiny, progress=False)
    assert checked == ["pld", "recycling"]


def test_execute_writes_results_report_and_png(executed):
    results, out = executed
    loaded = load_results(out / "results.json")
    validate_results(loaded)  # the JSON Schema a run on Ray is checked against too
    assert loaded["summary"] == json.loads(json.dumps(results["summary"]))
    assert {"cpu", "torch_threads", "dtype", "model"} <= loaded["machine"].keys()
    assert sum(loaded["machine"]["passes_by_threads"].values()) > 0  # the run's own passes, by thread count
    assert loaded["summary"]["hf_reference"] == "hf"
    assert loaded["summary"]["methods"]["hf"]["categories"]["overall"]["speedup_vs_hf"] == pytest.approx(1.0)
    report = (out / "report.md").read_text()
    assert loaded["command"] in report and "## Machine" in report
    for cat in loaded["summary"]["categories"]:
        assert cat in report
    assert "| method | tok/s |" in report and "| hf (baseline) |" in report
    png = (out / "speedup.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(out / "speedup.png")
    assert image.shape[0] > 100 and image.shape[1] > 100
    table = terminal_report(results)
    assert "greedy" in table and "hf (baseline)" in table and "mt_bench" in table
    stamp = loaded["machine"]["decodekit"]
    assert f"decodekit {stamp}" in report and f"exact numerics; decodekit {stamp}" in table  # which code, which numerics


def test_plot_and_report_on_a_summary_with_many_methods(executed, tmp_path: Path):
    results, _ = executed
    summary = json.loads(json.dumps(results["summary"]))
    for i in range(6):  # more methods than fit value labels comfortably
        summary["methods"][f"m{i}"] = summary["methods"]["hf"] | {"kind": "decodekit"}
    from PIL import Image

    path = plot_speedup(summary, tmp_path / "many.png")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 0 and image.size[1] > 0
    text = markdown_report(results | {"summary": summary}, image=None)
    assert "| m5 |" in text and "speedup.png" not in text
    assert write_report(results, tmp_path / "r.md").read_text().count("### ") == len(summary["categories"]) - 1


def test_compare_prints_changes(executed, tmp_path: Path, capsys):
    results, out = executed
    b = json.loads(json.dumps(results))
    stats = b["summary"]["methods"]["greedy"]["categories"]["overall"]
    stats["decode_tps"] *= 1.5
    b["summary"]["methods"]["hf"]["categories"]["overall"]["speedup"] = 0.5
    text = compare(json.loads(json.dumps(results)), b)
    greedy_row = next(line for line in text.splitlines() if line.startswith("greedy") and "overall" in line)
    assert "+50.0%" in greedy_row
    hf_row = next(line for line in text.splitlines() if line.startswith("hf ") and "overall" in line)
    old = results["summary"]["methods"]["hf"]["categories"]["overall"]["speedup"]
    assert f"{0.5 - old:+.2f}" in hf_row
    assert "different CPUs" not in text  # both ran here
    b["machine"]["cpu"] = "another CPU"
    assert f"note: different CPUs ({results['machine']['cpu']} vs another CPU)" in compare(results, b)
    assert "different settings" not in compare(results, b)
    b["config"]["max_new_tokens"], b["config"]["questions"] = 99, "other.jsonl"  # other questions under the same ids
    assert (f"note: different settings (questions {results['config']['questions']!r} vs 'other.jsonl'; max_new_tokens "
            f"{results['config']['max_new_tokens']} vs 99)") in compare(results, b)
    path_b = tmp_path / "b.json"
    path_b.write_text(json.dumps(b))
    assert bench_cli.run(parse("--compare", str(out / "results.json"), str(path_b))) == 0
    assert "+50.0%" in capsys.readouterr().out
    for flag in (("--methods", "nope"), ("--limit", "-5"), ("--quick",)):  # it runs nothing: never ignored
        with pytest.raises(InvalidParameter, match=f"^--compare reads two results files and runs nothing; {flag[0]} "):
            bench_cli.run(parse("--compare", str(out / "results.json"), str(path_b), *flag))
    # a damaged or edited file: one line, not a KeyError (or a TypeError on categories that are no list)
    for damage in ({"records": "x"}, {"summary": {}}, {"summary": {**b["summary"], "categories": 5}}):
        (tmp_path / "bad.json").write_text(json.dumps({**b, **damage}))
        with pytest.raises(InvalidParameter, match=r"bad\.json: results\.json does not follow"):
            bench_cli.run(parse("--compare", str(out / "results.json"), str(tmp_path / "bad.json")))


def test_build_results_keeps_records_and_notes(tiny: LoadedModel, qfile: Path):
    run = run_bench([Scripted("greedy", [])], load_questions(qfile, limit=1), prompt_fn(tiny),
                    BenchConfig(max_new_tokens=2), progress=False)
    results = build_results(run, command="decodekit bench", config={"reference": "greedy"}, machine={}, notes=["n1"])
    assert results["schema"] == "decodekit-bench/1" and results["notes"][0] == "n1"
    assert len(results["records"]) == len(run.records)
    # a note the run makes again (a resumed run's warm-up) beside the one its checkpoint kept: said once
    run.notes.append("n1")
    assert build_results(run, command="", config={}, machine={}, notes=["n1"])["notes"].count("n1") == 1


@pytest.mark.real_model
def test_hf_baseline_matches_decodekit_greedy_on_the_real_model(real_model):
    from decodekit.bench.baselines import load_hf_model

    model = real_model
    hf = HFGenerate(load_hf_model(None, "float32"), model.tokenizer.eos_token_ids, model.tokenizer.decode)
    ids = model.prompt_ids("What is the capital of France?")
    ours = Engine(model).generate(ids, method="greedy", max_new_tokens=12)
    assert hf.run(ids, 12).tokens == ours.tokens


@pytest.mark.real_model
def test_llamacpp_baseline_on_the_embedded_gguf(real_model):
    pytest.importorskip("llama_cpp")
    from decodekit.bench.baselines import LlamaCpp
    from decodekit.models.loading import model_gguf

    model = real_model
    baseline = LlamaCpp(model_gguf(None), model.tokenizer.eos_token_ids, n_threads=2)
    ids = model.prompt_ids("Name three colours.")
    first, again = baseline.run(ids, 8), baseline.run(ids, 8)
    assert first.tokens == again.tokens  # greedy and no state carried between calls
    assert len(first.tokens) == 8 and first.finish_reason == "length" and first.forward_passes == 7
    assert first.text and first.prefill_s > 0 and first.decode_s > 0


def test_progress_falls_back_to_a_stderr_line_without_tqdm(tiny: LoadedModel, qfile: Path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    run_bench([Scripted("greedy", [])], load_questions(qfile, limit=1), prompt_fn(tiny), BenchConfig(max_new_tokens=2))
    err = capsys.readouterr().err
    assert "bench 5/5 greedy" in err and err.endswith("\n")


# --------------------------------------------------------------------------- checkpoint and resume


def test_an_interrupted_run_resumes_without_rerunning_finished_questions(tiny: LoadedModel, qfile: Path):
    questions = load_questions(qfile, limit=1)
    saved: list[list[dict]] = []
    log: list = []
    names = ("greedy", "b", "c")
    config = BenchConfig(max_new_tokens=4)
    full = run_bench([Scripted(n, log) for n in names], questions, prompt_fn(tiny), config, progress=False,
                     checkpoint=lambda records: saved.append(list(records)))
    assert [len(s) for s in saved] == [3 * (i + 1) for i in range(len(questions))]  # after every question
    interrupted = saved[1]  # the run stopped after its second question
    log.clear()
    resumed = run_bench([Scripted(n, log) for n in names], questions, prompt_fn(tiny), config, progress=False,
                        previous=interrupted)
    assert resumed.resumed == 2
    assert len(log) == 3 + 3 * (len(questions) - 2)  # warm-ups, then only the unfinished questions
    assert sorted((r["question_id"], r["method"]) for r in resumed.records) == sorted(
        (r["question_id"], r["method"]) for r in full.records)
    # a question missing one contestant's record is run again, for every contestant
    partial = [r for r in interrupted if not (r["question_id"] == questions[1].question_id and r["method"] == "c")]
    assert run_bench([Scripted(n, []) for n in names], questions, prompt_fn(tiny), config, progress=False,
                     previous=partial).resumed == 1


def test_a_resumed_run_takes_only_the_repeats_it_runs(tiny: LoadedModel, qfile: Path):
    """Records of a repeat this run does not have are neither counted as resumed nor reported."""
    question = load_questions(qfile)[:1]
    names = ("greedy", "b")
    twice = run_bench([Scripted(n, []) for n in names], question, prompt_fn(tiny), BenchConfig(max_new_tokens=4, repeats=2),
                      progress=False)
    once = run_bench([Scripted(n, []) for n in names], question, prompt_fn(tiny), BenchConfig(max_new_tokens=4),
                     progress=False, previous=twice.records)
    assert once.resumed == 1 and [r["repeat"] for r in once.records] == [0, 0]


def test_resume_grows_the_question_set_and_refuses_other_settings_or_code(tiny: LoadedModel, qfile: Path, tmp_path: Path,
                                                                          monkeypatch):
    out = tmp_path / "out"
    common = ("--questions", str(qfile), "--methods", "greedy", "--baselines", "none", "--max-new-tokens", "4",
              "--out", str(out), "--no-progress")
    with pytest.raises(InvalidParameter, match="no checkpoint.json"):
        bench_cli.make_plan(parse(*common, "--resume"))
    first = execute(bench_cli.make_plan(parse(*common, "--categories", "qa,rag")), tiny, progress=False)
    assert {r["category"] for r in first["records"]} == {"qa", "rag"}
    grown = execute(bench_cli.make_plan(parse(*common, "--resume")), tiny, progress=False)
    assert len({r["question_id"] for r in grown["records"]}) == len(CATEGORIES)
    assert any(note.startswith("resumed: 2 question(s)") for note in grown["notes"])
    kept = {r["question_id"]: r["decode_s"] for r in first["records"]}
    assert all(r["decode_s"] == kept[r["question_id"]] for r in grown["records"] if r["question_id"] in kept)
    # a resumed run that asks fewer questions reports those, and keeps the others in the checkpoint
    narrow = execute(bench_cli.make_plan(parse(*common, "--categories", "qa", "--resume")), tiny, progress=False)
    assert {r["category"] for r in narrow["records"]} == {"qa"}
    regrown = execute(bench_cli.make_plan(parse(*common, "--resume")), tiny, progress=False)
    assert any(note.startswith(f"resumed: {len(CATEGORIES)} question(s)") for note in regrown["notes"])
    assert sorted((r["question_id"], r["decode_s"]) for r in regrown["records"]) == sorted(
        (r["question_id"], r["decode_s"]) for r in grown["records"])
    with pytest.raises(InvalidParameter, match="other settings .*max_new_tokens"):
        bench_cli.make_plan(parse(*common[:-5], "--max-new-tokens", "8", "--out", str(out), "--resume"))
    monkeypatch.setattr("decodekit.bench.checkpoint.code_version", lambda: "0.0.0+other")
    with pytest.raises(InvalidParameter, match="cannot be mixed"):
        bench_cli.make_plan(parse(*common, "--resume"))


def test_a_resumed_run_says_a_note_it_makes_again_once(tiny: LoadedModel, qfile: Path, tmp_path: Path, monkeypatch):
    """A baseline that cannot run is noted by the first run (saved in the checkpoint) and again by the
    resumed one: its report says it once."""
    monkeypatch.setattr("decodekit.bench.baselines.llamacpp_available", lambda: False)
    common = ("--questions", str(qfile), "--methods", "greedy", "--baselines", "llamacpp", "--max-new-tokens", "4",
              "--out", str(tmp_path / "out"), "--no-progress")
    first = bench_cli.make_plan(parse(*common, "--categories", "qa"))
    first.notes.append("a note of the plan")  # (as --quick's notes of methods it leaves out)
    execute(first, tiny, progress=False)
    again = bench_cli.make_plan(parse(*common, "--resume"))
    again.notes.append("a note of the plan")
    resumed = execute(again, tiny, progress=False)
    assert sum("llama-cpp-python is not installed" in note for note in resumed["notes"]) == 1
    assert resumed["notes"].count("a note of the plan") == 1


def test_resume_refuses_a_changed_question_file_and_an_edited_checkpoint(tiny: LoadedModel, qfile: Path, tmp_path: Path):
    """Same path, other questions: refused, not answered from the old ones. A checkpoint record edited
    after it was written (a token, a timing, a duplicate) is refused, not carried into the report."""
    out = tmp_path / "out"
    common = ("--questions", str(qfile), "--methods", "greedy", "--baselines", "none", "--max-new-tokens", "4",
              "--out", str(out), "--no-progress")
    execute(bench_cli.make_plan(parse(*common, "--categories", "qa")), tiny, progress=False)
    bench_cli.make_plan(parse(*common, "--resume"))  # unchanged: resumes
    original = qfile.read_text()
    qfile.write_text(original.replace("say more", "say less"))
    with pytest.raises(InvalidParameter, match=r"^--resume: the question file .* has changed since .*checkpoint.json was written"):
        bench_cli.make_plan(parse(*common, "--resume"))
    qfile.write_text(original)
    checkpoint = out / "checkpoint.json"
    saved = checkpoint.read_text()
    for edit in (lambda doc: doc["records"][0]["tokens"][0].__setitem__(0, 1),
                 lambda doc: doc["records"][0].__setitem__("decode_s", -1.0),
                 lambda doc: doc["records"].append(doc["records"][0]),
                 lambda doc: doc["notes"].append("an edit")):
        doc = json.loads(saved)
        edit(doc)
        checkpoint.write_text(json.dumps(doc))
        with pytest.raises(InvalidParameter, match="has been changed since decodekit wrote it"):
            bench_cli.make_plan(parse(*common, "--resume"))
    # edited with its digest computed again: each field of its type, or the record is refused
    from decodekit.bench.checkpoint import HEADER, digest

    for field, value in (("new_tokens", "abc"), ("decode_s", -1.0), ("prefill_s", None), ("forward_passes", 2.5),
                         ("mean_accepted", "x"), ("turns", True)):
        doc = json.loads(saved)
        doc["records"][0][field] = value
        doc["digest"] = digest({k: v for k, v in doc.items() if k not in HEADER})
        checkpoint.write_text(json.dumps(doc))
        with pytest.raises(InvalidParameter, match="record 0 is malformed"):
            bench_cli.make_plan(parse(*common, "--resume"))
    checkpoint.write_text(saved)
    bench_cli.make_plan(parse(*common, "--resume"))


@pytest.mark.parametrize("qid", [None, 1.5, True, [1], {"a": 1}, ""])
def test_a_question_id_that_is_not_an_integer_or_a_string_is_refused(tmp_path: Path, qid):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question_id": qid, "category": "qa", "turns": ["a"]}) + "\n")
    with pytest.raises(InvalidParameter, match=r":1: question_id must be an integer or a non-empty string"):
        load_questions(path)


def test_default_question_file_ships_inside_the_package():
    path = resolve_question_file(None)
    assert "decodekit" in path.parts and path.parent.name == "specbench"
    assert (path.parent / "LICENSE").is_file()
    questions = load_questions()
    assert len(questions) == 240
    assert {q.group for q in questions} == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}


def test_compare_counts_the_runs_whose_tokens_match(tiny: LoadedModel, qfile: Path):
    from decodekit.bench.report import same_outputs

    a = run_bench([MethodContestant(Engine(tiny), "greedy")], load_questions(qfile), prompt_fn(tiny),
                  BenchConfig(max_new_tokens=4), progress=False).records
    b = json.loads(json.dumps(a))
    assert same_outputs(a, b) == f"outputs: {len(a)} of {len(a)} runs in both files are token-identical"
    b[1]["tokens"][0][-1] += 1
    assert same_outputs(a, b[1:]) == f"outputs: {len(a) - 2} of {len(a) - 1} runs in both files are token-identical (differ: greedy)"
    # runs are matched by repeat too: two repeats of one question are two runs
    again = [{**r, "repeat": 1, "tokens": [[9]]} for r in a]
    assert same_outputs(a + again, a + again) == f"outputs: {2 * len(a)} of {2 * len(a)} runs in both files are token-identical"


def test_results_that_break_the_schema_are_one_line(executed):
    results, _ = executed
    broken = json.loads(json.dumps(results))
    broken["records"][0]["tokens"] = "abc"
    with pytest.raises(InvalidParameter, match=r"^results.json does not follow decodekit-bench/1 at records/0/tokens: "):
        validate_results(broken)
    del broken["summary"]
    with pytest.raises(InvalidParameter, match="'summary' is a required property"):
        validate_results(broken)
    # figures a run never writes (an edited file): a negative rate, NaN, infinity; --compare printed them
    method = next(iter(results["summary"]["methods"]))
    for bad, message in ((-50.0, "less than the minimum of 0"), (float("nan"), "not a finite number"),
                         (float("inf"), "not a finite number")):
        edited = json.loads(json.dumps(results))
        edited["summary"]["methods"][method]["categories"]["overall"]["decode_tps"] = bad
        with pytest.raises(InvalidParameter, match=f"at summary/methods/{method}/categories/overall/decode_tps: .*{message}"):
            validate_results(edited)
    validate_results(json.loads(json.dumps(results)))


def test_a_line_of_json_nested_thousands_deep_is_one_line(tmp_path: Path):
    """json's reader recurses: a question file's, a results file's or a checkpoint's [[[[... was a
    RecursionError's traceback."""
    from decodekit.bench.results import read_document

    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "\n")
    with pytest.raises(InvalidParameter, match="deep.jsonl:1: JSON nested too deeply"):
        load_questions(deep)
    deep.write_text('{"schema": ' + "[" * 100_000)
    with pytest.raises(InvalidParameter, match="not a results file \\(JSON nested too deeply\\)"):
        read_document(deep, "x", "results file")


def test_a_question_file_with_a_repeated_id_is_refused(tmp_path: Path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "category": "qa", "turns": ["a"]}\n{"question_id": 1, "category": "rag", "turns": ["b"]}\n')
    with pytest.raises(InvalidParameter, match="question_id 1 appears twice"):
        load_questions(path)
    # 1 and "1" print alike in a report and its notes: one id there, so refused too
    path.write_text('{"question_id": 1, "category": "qa", "turns": ["a"]}\n{"question_id": "1", "category": "rag", "turns": ["b"]}\n')
    with pytest.raises(InvalidParameter, match="question_id 1 appears twice"):
        load_questions(path)


def test_a_decodekit_contestant_reads_its_whole_prompt_as_the_baselines_do(monkeypatch):
    """The engine keeps its cache for a next prompt that extends the last (a chat's next turn); in the
    bench every contestant reads each prompt whole, or decodekit's prefill would be timed on less."""
    backend = tiny_llama(seed=0, hidden_size=64, gguf_blocks=True)  # row-independent kernels: prefixes are reused
    contestant = MethodContestant(Engine(LoadedModel(backend, CharTokenizer(), "tiny")), "greedy")
    first = contestant.run([5, 6, 7, 8], 6)
    taken = []
    shared_prefix = backend.shared_prefix
    monkeypatch.setattr(backend, "shared_prefix", lambda ids: taken.append(shared_prefix(ids)) or taken[-1])
    contestant.run([5, 6, 7, 8, *first.tokens, 9, 10], 6)  # the next turn of the same conversation
    assert taken and set(taken) == {0}


# --------------------------------------------------------------------------- figures by hand


def hand_record(method, qid, group="qa", *, decode_s=1.0, prefill_s=0.5, new_tokens=10, passes=None, accepted=None,
                identical=None, error=None, repeat=0):
    """A record with only the fields the summary reads, figures chosen by the test."""
    return {"method": method, "question_id": qid, "group": group, "repeat": repeat, "error": error,
            "prefill_s": prefill_s, "decode_s": decode_s, "new_tokens": new_tokens,
            "forward_passes": new_tokens if passes is None else passes, "mean_accepted": accepted,
            "identical_to_reference": identical, "text_match": identical, "text_prefix_share": None}


def hand_contestants(*names):
    return [{"name": n, "kind": "decodekit", "family": "test", "lossless": True, "token_exact": True} for n in names]


def test_the_reference_throughput_is_taken_on_the_questions_the_method_finished():
    """A speedup compares both sides on the same questions: those the reference finished and the
    method did not are left out of the reference's side too."""
    records = [hand_record("greedy", 1, decode_s=1.0), hand_record("greedy", 2, decode_s=3.0, new_tokens=10),
               hand_record("fast", 1, decode_s=0.5), hand_record("fast", 2, decode_s=0.0, new_tokens=0, error="boom")]
    stats = summarize(records, hand_contestants("greedy", "fast"), {})["methods"]["fast"]["categories"]["overall"]
    assert stats["speedup"] == pytest.approx(2.0)  # 10 tokens in 0.5 s against 10 tokens in 1.0 s
    assert stats["e2e_speedup"] == pytest.approx(1.5 / 1.0)  # 10/1.0 against 10/1.5


def test_accepted_per_verification_is_over_every_verification_and_passes_per_token_a_ratio():
    """accepted/verify is Spec-Bench's mean accepted tokens: over every verification of the questions,
    so a question verified 100 times weighs 100 times one verified once (a file without counts: the
    mean over questions, not a median); passes/token is decode passes over new tokens (below 1 when
    a pass yields several tokens)."""
    records = [hand_record("greedy", q) for q in (1, 2, 3)]
    spec = [hand_record("spec", q, new_tokens=10, passes=p, accepted=a) for q, p, a in ((1, 2, 1.0), (2, 4, 2.0), (3, 9, 6.0))]
    stats = summarize(records + spec, hand_contestants("greedy", "spec"), {})["methods"]["spec"]["categories"]["overall"]
    assert stats["mean_accepted"] == pytest.approx(3.0)  # (1 + 2 + 6) / 3; the median would be 2
    assert stats["passes_per_token"] == pytest.approx(15 / 30)
    for record, verifications in zip(spec, (1, 100, 1)):
        record["verifications"] = verifications
    stats = summarize(records + spec, hand_contestants("greedy", "spec"), {})["methods"]["spec"]["categories"]["overall"]
    assert stats["mean_accepted"] == pytest.approx((1.0 + 200.0 + 6.0) / 102)
    for record in spec:  # a method that verified nothing (its figure 1.0 each time): that figure, not unknown
        record["verifications"], record["mean_accepted"] = 0, 1.0
    stats = summarize(records + spec, hand_contestants("greedy", "spec"), {})["methods"]["spec"]["categories"]["overall"]
    assert stats["mean_accepted"] == 1.0


def test_accepted_per_verification_pools_the_repeats_of_a_question():
    """A question's repeats are pooled over their verifications as the questions are: one repeat's
    acceptance is never paired with another's count (a repeat of 3.0 over 10 verifications and one of
    1.0 over none was a row of 2.0 over 0, left out of the figure)."""
    records = [hand_record("greedy", q, repeat=r) for q in (1, 2) for r in (0, 1)]
    spec = [hand_record("spec", 1, accepted=3.0, repeat=0), hand_record("spec", 1, accepted=1.0, repeat=1),
            hand_record("spec", 2, accepted=1.5, repeat=0), hand_record("spec", 2, accepted=1.5, repeat=1)]
    for record, verifications in zip(spec, (10, 0, 4, 4)):
        record["verifications"] = verifications
    stats = summarize(records + spec, hand_contestants("greedy", "spec"), {})["methods"]["spec"]["categories"]["overall"]
    assert stats["mean_accepted"] == pytest.approx((3.0 * 10 + 1.5 * 8) / 18)


def test_passes_per_token_is_unknown_when_a_question_has_no_pass_count():
    """passes/token needs the passes of every question counted: one unknown count leaves it unknown (not a crash)."""
    records = [hand_record("greedy", q) for q in (1, 2)]
    records += [hand_record("m", 1, passes=5), {**hand_record("m", 2), "forward_passes": None}]
    cats = summarize(records, hand_contestants("greedy", "m"), {})["methods"]
    assert cats["m"]["categories"]["overall"]["passes_per_token"] is None
    assert cats["greedy"]["categories"]["overall"]["passes_per_token"] == pytest.approx(1.0)


def test_a_categorys_shares_and_errors_count_only_that_categorys_runs():
    """Each category's exact share and error count come from its own records; a run with no
    verdict (the reference failed there) is left out of the share, not counted as a mismatch."""
    records = [hand_record("greedy", 1, "qa"), hand_record("greedy", 2, "qa", error="boom"), hand_record("greedy", 3, "rag"),
               hand_record("greedy", 4, "rag")]
    records += [hand_record("m", 1, "qa", identical=True), hand_record("m", 2, "qa", identical=None),
                hand_record("m", 3, "rag", identical=False), hand_record("m", 4, "rag", error="boom")]
    cats = summarize(records, hand_contestants("greedy", "m"), {})["methods"]["m"]["categories"]
    assert cats["qa"]["exact_share"] == 1.0 and cats["qa"]["errors"] == 0
    assert cats["rag"]["exact_share"] == 0.0 and cats["rag"]["errors"] == 1
    assert cats["overall"]["exact_share"] == 0.5 and cats["overall"]["errors"] == 1
    assert cats["qa"]["text_match_share"] == 1.0


# --------------------------------------------------------------------------- code stamp and machine


def test_the_code_stamp_covers_the_kernels_and_the_file_names(tmp_path: Path, monkeypatch):
    """Two runs with the same stamp ran the same code: a C kernel or header is code too, and the
    same contents under other names (a module moved) is other code."""
    import decodekit
    from decodekit.bench.results import code_version

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("A = 1\n")
    (package / "kernel.c").write_text("int f(void) { return 1; }\n")
    (package / "kernel.h").write_text("int f(void);\n")
    (package / "notes.txt").write_text("not code\n")
    monkeypatch.setattr(decodekit, "__file__", str(package / "__init__.py"))

    def stamp() -> str:
        return code_version.__wrapped__()

    first = stamp()
    assert first.startswith(f"{decodekit.__version__}+") and stamp() == first
    (package / "notes.txt").write_text("still not code\n")
    assert stamp() == first
    for name in ("kernel.c", "kernel.h"):
        saved = (package / name).read_text()
        (package / name).write_text(saved + "/* changed */\n")
        assert stamp() != first, name
        (package / name).write_text(saved)
    assert stamp() == first
    (package / "kernel.c").rename(package / "k.c")  # same contents, same order, another name
    assert stamp() != first


def test_the_machine_records_the_numerics_it_ran_in():
    """results.json says which numerics ran: a fast-numerics run is not reported as exact."""
    from decodekit.bench.results import machine_info

    machine = machine_info(model="tiny", dtype="float32", numerics="fast")
    assert machine["numerics"] == "fast" and machine["dtype"] == "float32" and machine["model"] == "tiny"


def test_memory_is_reported_in_gib_from_meminfo_kib(monkeypatch):
    """/proc/meminfo gives kB (KiB): 16777216 kB is 16 GiB."""
    from decodekit.bench import results

    read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "MemFree: 1 kB\nMemTotal:       16777216 kB\n"
                        if str(self) == "/proc/meminfo" else read_text(self, *a, **k))
    assert results.memory_gb() == 16.0


# --------------------------------------------------------------------------- report tables by hand


def hand_summary() -> dict:
    def stats(**given):
        return {key: None for key in STAT_KEYS} | given

    return {"reference": "greedy", "hf_reference": None, "aggregate": "agg", "categories": ["qa", "overall"],
            "methods": {
                "greedy": {"kind": "decodekit", "family": "plain", "lossless": True, "token_exact": True, "peak_rss_mb": 100.0,
                           "categories": {c: stats(decode_tps=10.0, speedup=1.0, e2e_speedup=1.0, questions=2)
                                          for c in ("qa", "overall")}},
                "spec": {"kind": "decodekit", "family": "speculative", "lossless": True, "token_exact": True,
                         "peak_rss_mb": 120.0,
                         "categories": {c: stats(decode_tps=30.0, e2e_tps=20.0, speedup=3.25, e2e_speedup=2.5,
                                                 mean_accepted=4.5, passes_per_token=0.25, exact_share=0.5,
                                                 text_match_share=0.75, questions=2) for c in ("qa", "overall")}},
            }}


def hand_results(**given) -> dict:
    """A results document around :func:`hand_summary` (what the report writers read)."""
    return {"summary": hand_summary(), "command": "c", "created": "t", "notes": [], "records": [],
            "machine": {"cpu": "cpu", "usable_cores": 1, "logical_cores": 1, "memory_gb": 1.0,
                        "torch": "t", "torch_threads": 1, "transformers": "t", "llama_cpp": None,
                        "model": "tiny", "dtype": "float32", "platform": "p", "python": "3"},
            "config": {"questions": "q.jsonl", "limit": None, "categories": [], "all_turns": False,
                       "max_new_tokens": 4, "repeats": 1, "methods": ["greedy", "spec"], "baselines": []}} | given


def test_the_report_says_what_share_of_the_passes_ran_on_fewer_threads(monkeypatch):
    """torch's count at the end of a run is the thread governor's last choice: the report gives the
    machine's count, and the share of passes the governor ran on fewer where it did (a busy machine)."""
    from decodekit.bench.report import machine_lines
    from decodekit.bench.results import machine_info
    from decodekit.models.threads import GOVERNOR

    machine = hand_results()["machine"] | {"torch_threads": 2}
    assert "with 2 threads;" in machine_lines(machine | {"passes_by_threads": {"2": 10}})[1]
    assert "with 2 threads (25% of decodekit's passes on fewer: the machine was busy);" in \
        machine_lines(machine | {"passes_by_threads": {"1": 5, "2": 15}})[1]
    assert "with 2 threads;" in machine_lines(machine)[1]  # (a file written before the count was kept)
    monkeypatch.setattr(GOVERNOR, "full_count", lambda: 7)  # (torch's count now may be a busy pass's 1)
    info = machine_info(model="m", dtype="float32")
    assert info["torch_threads"] == 7
    assert info["passes_by_threads"] == {str(n): c for n, c in sorted(GOVERNOR.passes.items())}
    assert machine_info(model="m", dtype="float32", passes={2: 3})["passes_by_threads"] == {"2": 3}


def table_row(table: str, name: str, markdown: bool = False) -> dict[str, str]:
    """A rendered table's row for one method, keyed by header."""
    lines = table.splitlines()
    if markdown:
        cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
        header, rows = cells[0], cells[2:]
    else:
        import re

        header = re.split(r"\s{2,}", lines[0].strip())
        rows = [re.split(r"\s{2,}", line.strip()) for line in lines[2:]]
    return next(dict(zip(header, row)) for row in rows if row[0] == name)


def test_the_method_table_shows_each_figure_under_its_own_header():
    """speedup is decode-only, e2e speedup includes prefill, accepted/verify is tokens per
    verification, exact and text match are percentages."""
    from decodekit.bench.report import method_table

    row = table_row(method_table(hand_summary(), "overall", markdown=True), "spec", markdown=True)
    assert row["tok/s"] == "30.0" and row["e2e tok/s"] == "20.0"
    assert row["speedup"] == "3.25x" and row["e2e speedup"] == "2.50x" and row["vs HF"] == "-"
    assert row["accepted/verify"] == "4.50" and row["passes/token"] == "0.25"
    assert row["exact"] == "50%" and row["text match"] == "75%" and row["questions"] == "2"


def test_the_speedup_matrices_leave_out_the_reference_and_show_their_own_figure():
    """The reference is 1.00x by definition: its row is left out; the end-to-end section shows
    the end-to-end speedup, not the decode-only one."""
    from decodekit.bench.report import matrix

    table = matrix(hand_summary(), "speedup", lambda v: f"{v:.2f}x")
    assert "spec" in table and "greedy" not in table
    report = markdown_report(hand_results(), image=None)
    e2e = report.split("## End-to-end speedup")[1].split("## Per category")[0]
    assert table_row(e2e.strip().split("\n", 1)[1].strip(), "spec", markdown=True)["overall"] == "2.50x"
    decode = report.split("## Decode-only speedup")[1].split("## End-to-end")[0]
    assert table_row(decode.strip().split("\n", 1)[1].strip(), "spec", markdown=True)["overall"] == "3.25x"
    assert "first turn only" in report and "### qa (2 questions)" in report


def test_a_category_of_one_question_is_headed_in_the_singular():
    """A category heading counts its questions in plain English: "1 question", not "1 questions"."""
    summary = hand_summary()
    summary["methods"]["greedy"]["categories"]["qa"]["questions"] = 1
    report = markdown_report(hand_results(summary=summary), image=None)
    assert "### qa (1 question)\n" in report and "(1 questions)" not in report


def test_the_overall_tables_show_each_methods_peak_memory():
    """The terminal and markdown overall tables carry the peak-RSS column, each method its own figure."""
    terminal = terminal_report(hand_results())
    overall = terminal.split("the reference):\n", 1)[1].split("\n\n", 1)[0]
    assert table_row(overall, "spec")["peak RSS MB"] == "120" and table_row(overall, "greedy")["peak RSS MB"] == "100"
    report = markdown_report(hand_results(), image=None)
    overall = report.split("## Overall\n\n", 1)[1].split("\n\n", 1)[0]
    assert table_row(overall, "spec", markdown=True)["peak RSS MB"] == "120"


def test_the_reports_carry_the_runs_notes():
    """Skipped methods, failures and exactness caveats are part of the result: both reports say them."""
    notes = ["spec failed on question 3: RuntimeError: boom", "llamacpp baseline skipped"]
    report = markdown_report(hand_results(notes=notes), image=None)
    assert "## Notes" in report and all(f"- {n}" in report for n in notes)
    assert all(f"note: {n}" in terminal_report(hand_results(notes=notes)) for n in notes)


def test_a_markdown_table_has_one_alignment_cell_per_column():
    """GitHub renders a table only when its delimiter row has as many cells as its header."""
    from decodekit.bench.report import render

    lines = render(["method", "a", "b"], [["x", "1", "2"]], markdown=True).splitlines()
    assert lines[1] == "|:---|---:|---:|"
    assert all(len(line.strip("|").split("|")) == 3 for line in lines)


def test_the_workers_section_marks_only_the_lost_worker():
    """A worker lost mid-run is named as lost (its question ran again elsewhere); the others are not."""
    from decodekit.bench.report import worker_lines

    machines = [{"host": host, "pid": pid, "threads": 1, "units": 2, "lost": lost, "machine": {"cpu": "cpu"}}
                for host, pid, lost in (("a", 1, False), ("b", 2, True))]
    lines = worker_lines(machines)
    kept = next(line for line in lines if line.startswith("- a pid 1"))
    lost = next(line for line in lines if line.startswith("- b pid 2"))
    assert "lost mid-run" not in kept and "lost mid-run" in lost
    assert worker_lines(None) == [] and worker_lines([]) == []


def test_compare_leaves_out_a_method_only_the_second_run_has():
    """--compare diffs what both runs measured: a method new in B has no A figure to compare with."""
    b = hand_results()
    b["summary"]["methods"]["new"] = b["summary"]["methods"]["spec"]
    text = compare(hand_results(), b)
    assert not any(line.startswith("new ") for line in text.splitlines())
    assert any(line.startswith("spec ") for line in text.splitlines())


def test_compare_says_when_the_runs_asked_other_questions_or_measured_other_methods():
    """Another --limit, --categories, --all-turns or --opt makes other questions or other outputs
    (an "overall" row over other questions, outputs that differ for that alone): said in a note, as
    is a method or category only one run has. The default model named or left out is the same."""
    base = hand_results()
    for key, value in (("limit", 2), ("categories", ["qa"]), ("all_turns", True), ("options", {"pld.k": 2})):
        other = hand_results(config={**base["config"], key: value})
        (note,) = [line for line in compare(base, other).splitlines() if line.startswith("note: different settings")]
        assert note.startswith(f"note: different settings ({key} ")
    from decodekit.arguments import DEFAULT_MODEL

    named = hand_results(config={**base["config"], "model": DEFAULT_MODEL})
    assert "note:" not in compare(base, named)
    b = hand_results()
    b["summary"]["methods"]["new"] = b["summary"]["methods"].pop("spec")
    text = compare(base, b).splitlines()
    assert "note: methods only in A: spec" in text and "note: methods only in B: new" in text


def test_a_resumed_runs_note_counts_questions_once_per_repeat():
    from decodekit.bench.execution import resumed_note

    assert resumed_note(2, 1).startswith("resumed: 2 question(s) taken")
    assert resumed_note(4, 2).startswith("resumed: 4 run(s) of a question (each question once per repeat) taken")


def test_a_change_from_zero_tokens_per_second_has_no_relative_size():
    """A relative change is undefined from zero: shown as "-" rather than dividing by it."""
    from decodekit.bench.report import change

    assert change(0.0, 5.0) == ["0.0", "5.0", "-"]
    assert change(4.0, 5.0) == ["4.0", "5.0", "+25.0%"]


def test_compare_counts_only_runs_that_produced_outputs_in_both_files():
    """A run that failed in one file has no tokens to compare: it is not counted as a differing run."""
    from decodekit.bench.report import same_outputs

    ok = {"method": "m", "question_id": 1, "repeat": 0, "error": None, "tokens": [[1, 2]]}
    failed = {**ok, "error": "boom", "tokens": []}
    assert same_outputs([ok], [failed]) == "outputs: 0 of 0 runs in both files are token-identical"


# --------------------------------------------------------------------------- question selection, records


def test_a_limit_takes_each_categorys_first_questions_in_file_order(tmp_path: Path):
    """--limit keeps the first questions of a category as the file lists them (the Spec-Bench order),
    round-robin over MT-Bench's sub-categories."""
    path = write_questions(tmp_path / "q.jsonl", ["qa", "qa", "qa", "writing", "writing", "math"])
    assert [q.question_id for q in load_questions(path, limit=2)] == [0, 1, 3, 5]
    assert [q.question_id for q in load_questions(path, limit=1, categories=["writing"])] == [3]


def test_a_multi_turn_record_sums_its_prompts_and_ends_with_its_last_turns_finish():
    """A record's figures are over all its turns: the prompt tokens of every turn, and the way
    the conversation ended (its last turn)."""
    from decodekit.bench.questions import Question
    from decodekit.bench.runner import make_record

    question = Question(1, "qa", ("a", "b"))
    first = RunResult([1, 2], "xy", 0.1, 0.2, "eos", forward_passes=2)
    last = RunResult([3], "z", 0.1, 0.2, "length", forward_passes=1)
    record = make_record(Scripted("m", []), question, 0, 0, [(3, first), (8, last)])
    assert record["prompt_tokens"] == 11 and record["new_tokens"] == 3 and record["turns"] == 2
    assert record["finish_reason"] == "length" and record["texts"] == ["xy", "z"]


def test_a_question_the_reference_failed_gets_no_exactness_verdict():
    """Exactness is against greedy's output: where greedy failed there is nothing to compare with."""
    from decodekit.bench.runner import compare_to_reference

    ok = {"method": "m", "error": None, "texts": ["abc"], "tokens": [[1, 2, 3]],
          "identical_to_reference": None, "text_match": None, "text_prefix_share": None}
    failed = {**ok, "method": "greedy", "error": "boom", "texts": [], "tokens": []}
    compare_to_reference([failed, ok], "greedy", {"greedy": True, "m": True})
    assert ok["identical_to_reference"] is None and ok["text_match"] is None and ok["text_prefix_share"] is None


def test_a_run_that_failed_gets_no_exactness_verdict():
    """A failed run produced no output: it is neither a match nor a mismatch of greedy's."""
    from decodekit.bench.runner import compare_to_reference

    ref = {"method": "greedy", "error": None, "texts": ["abc"], "tokens": [[1, 2, 3]],
           "identical_to_reference": None, "text_match": None, "text_prefix_share": None}
    failed = {**ref, "method": "m", "error": "boom", "texts": [], "tokens": []}
    compare_to_reference([ref, failed], "greedy", {"greedy": True, "m": True})
    assert failed["identical_to_reference"] is None and failed["text_match"] is None and failed["text_prefix_share"] is None
    assert ref["identical_to_reference"] is True


def test_a_contestant_that_is_not_token_exact_gets_only_a_text_verdict(tiny: LoadedModel, qfile: Path):
    """Token ids are compared one to one only for contestants that declare them comparable
    (token_exact); a lossless one that does not (hf against fast numerics) is compared as text."""
    class Loose(Scripted):
        token_exact = False

    run = run_bench([Scripted("greedy", []), Loose("loose", [])], load_questions(qfile, limit=1)[:1], prompt_fn(tiny),
                    BenchConfig(max_new_tokens=3), progress=False)
    loose = next(r for r in run.records if r["method"] == "loose")
    greedy = next(r for r in run.records if r["method"] == "greedy")
    assert loose["identical_to_reference"] is None and loose["text_match"] is True
    assert greedy["identical_to_reference"] is True


def test_a_records_accepted_per_verification_is_the_mean_over_its_turns():
    """A record's figures cover every turn that ran: accepted/verify is the mean of the turns that report it."""
    from decodekit.bench.questions import Question
    from decodekit.bench.runner import make_record

    turns = [(3, RunResult([1], "a", 0.1, 0.2, "length", forward_passes=1, mean_accepted=a)) for a in (2.0, None, 4.0)]
    assert make_record(Scripted("m", []), Question(1, "qa", ("a", "b", "c")), 0, 0, turns)["mean_accepted"] == 3.0
    # where the turns count their verifications, over all of them: 2 tokens in each of 10, 4 in each of 30
    counted = [(3, RunResult([1], "a", 0.1, 0.2, "length", mean_accepted=a, extra={"verifications": n}))
               for a, n in ((2.0, 10), (4.0, 30))]
    record = make_record(Scripted("m", []), Question(1, "qa", ("a", "b")), 0, 0, counted)
    assert (record["mean_accepted"], record["verifications"]) == (pytest.approx(140 / 40), 40)


def test_the_warm_up_stays_within_the_token_budget(tiny: LoadedModel, qfile: Path):
    """A warm-up generates at most --max-new-tokens (it is a short untimed run, never a longer one)."""
    budgets: list[int] = []

    class Budgeted(Scripted):
        def run(self, prompt_ids, max_new_tokens):
            budgets.append(max_new_tokens)
            return super().run(prompt_ids, max_new_tokens)

    run_bench([Budgeted("greedy", [])], load_questions(qfile, limit=1)[:1], prompt_fn(tiny),
              BenchConfig(max_new_tokens=3, warmup_tokens=32, repeats=2), progress=False)
    assert budgets and max(budgets) == 3


def test_a_resumed_runs_progress_counts_only_the_runs_left(tiny: LoadedModel, qfile: Path, monkeypatch, capsys):
    """The progress total is what this run will do: the resumed questions are not waited for."""
    import sys

    monkeypatch.setitem(sys.modules, "tqdm", None)
    questions = load_questions(qfile, limit=1)[:2]
    first = run_bench([Scripted("greedy", [])], questions, prompt_fn(tiny), BenchConfig(max_new_tokens=2), progress=False)
    capsys.readouterr()
    run_bench([Scripted("greedy", [])], questions, prompt_fn(tiny), BenchConfig(max_new_tokens=2),
              previous=first.records[:1])
    err = capsys.readouterr().err
    assert "bench 1/1 greedy" in err and "/2" not in err


# --------------------------------------------------------------------------- contestants and baselines


def test_a_baseline_is_cut_before_its_first_eos():
    """Every contestant reports the tokens it produced without the EOS, like decodekit's loop."""
    from decodekit.bench.contestants import cut_at_eos

    assert cut_at_eos([4, 5, 2, 6], frozenset({2}), 8) == ([4, 5], "eos")
    assert cut_at_eos([4, 5, 6], frozenset({2}), 2) == ([4, 5], "length")


def test_a_methods_figures_keep_only_finite_json_scalars():
    """A NaN or an infinity is not JSON: it is recorded as unknown."""
    from decodekit.bench.contestants import json_safe

    assert json_safe({"a": 1.5, "b": float("nan"), "c": float("inf"), "d": True, "e": [1], "f": "x"}) == {
        "a": 1.5, "b": None, "c": None, "d": True, "f": "x"}


def test_a_generation_with_no_new_token_is_all_prefill(monkeypatch):
    """Prefill runs from the start to the first new token; without one, all the time was prefill."""
    from decodekit.bench import contestants

    clock = iter([10.0, 13.0])
    monkeypatch.setattr(contestants.time, "perf_counter", lambda: next(clock))
    assert contestants.Stopwatch().split() == (3.0, 0.0)


def test_the_hf_streamer_stamps_the_first_new_token_not_the_prompt():
    """transformers puts the prompt into the streamer first: that is not the first new token."""
    from decodekit.bench.baselines import _FirstTokenStreamer
    from decodekit.bench.contestants import Stopwatch

    watch = Stopwatch()
    streamer = _FirstTokenStreamer(watch)
    streamer.put(None)
    assert watch.first is None
    streamer.put(None)
    assert watch.first is not None


# --------------------------------------------------------------------------- command line


def test_the_recorded_command_reproduces_the_plan(qfile: Path, tmp_path: Path):
    """results.json's command spells out every setting: run again, it makes the same plan."""
    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "greedy,pld,greedy", "--baselines", "none",
                                     "--limit", "1", "--categories", "mt_bench,qa", "--all-turns", "--repeats", "2",
                                     "--max-new-tokens", "5", "--out", str(tmp_path / "out")))
    assert plan.methods == ["greedy", "pld"]
    again = bench_cli.make_plan(parse(*shlex.split(plan.command)[2:]))
    assert again.config() == plan.config() and again.command == plan.command
    assert [q.question_id for q in again.questions] == [q.question_id for q in plan.questions]


# --------------------------------------------------------------------------- the chart's data


def plotted_bars(summary: dict, tmp_path: Path, monkeypatch, **kwargs) -> dict[str, list[tuple[float, float]]]:
    """(x, height) of each labelled bar series plot_speedup draws."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    drawn: dict[str, list[tuple[float, float]]] = {}
    bar = Axes.bar

    def spy(self, x, height, *args, label=None, **kw):
        drawn[label] = list(zip(x, height))
        return bar(self, x, height, *args, label=label, **kw)

    monkeypatch.setattr(Axes, "bar", spy)
    plot_speedup(summary, tmp_path / "chart.png", **kwargs)
    return drawn


def test_the_chart_has_a_bar_per_method_and_category_over_its_category(tmp_path: Path, monkeypatch):
    """Every method but the reference gets one bar per category it has a figure for, within that
    category's slot (x = category index +- 0.4); the key picks the figure."""
    summary = hand_summary()
    summary["methods"]["base"] = {**summary["methods"]["spec"], "kind": "baseline",
                                  "categories": {"qa": {**summary["methods"]["spec"]["categories"]["qa"], "speedup": None},
                                                 "overall": {**summary["methods"]["spec"]["categories"]["overall"], "speedup": 0.5}}}
    drawn = plotted_bars(summary, tmp_path, monkeypatch)
    assert set(drawn) == {"spec", "base (baseline)"}
    assert [h for _, h in drawn["spec"]] == [3.25, 3.25] and [h for _, h in drawn["base (baseline)"]] == [0.5]
    assert all(c - 0.4 < x < c + 0.4 for c, (x, _) in enumerate(drawn["spec"]))
    assert 0.6 < drawn["base (baseline)"][0][0] < 1.4  # overall only: no bar for the missing qa figure
    assert drawn["spec"][0][0] < 0 < drawn["base (baseline)"][0][0] - 1  # side by side, in method order
    e2e = plotted_bars(summary, tmp_path, monkeypatch, key="e2e_speedup")
    assert [h for _, h in e2e["spec"]] == [2.5, 2.5]


# --------------------------------------------------------------------------- plan, contestants and resume (hunt)


def test_the_resume_key_holds_the_threads_but_not_the_question_selection(qfile: Path):
    """Timings taken with other torch threads cannot be mixed; a grown --limit or --categories may resume."""
    common = ("--questions", str(qfile), "--methods", "greedy", "--baselines", "none")
    plain = bench_cli.make_plan(parse(*common))
    assert bench_cli.make_plan(parse(*common, "--threads", "1")).resume_key() != plain.resume_key()
    assert bench_cli.make_plan(parse(*common, "--limit", "1", "--categories", "qa")).resume_key() == plain.resume_key()


def test_the_bench_config_carries_the_plans_token_budget_repeats_and_turns(qfile: Path):
    """The runner gets what the command asked for: every turn, every repeat, the token budget."""
    from decodekit.bench.execution import bench_config

    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "greedy", "--baselines", "none",
                                     "--all-turns", "--repeats", "3", "--max-new-tokens", "5"))
    assert bench_config(plan) == BenchConfig(max_new_tokens=5, repeats=3, all_turns=True, reference="greedy")


def test_each_method_gets_its_own_backend_clone_and_the_plans_threads(tiny: LoadedModel, qfile: Path, monkeypatch):
    """As if each method ran in its own process (Spec-Bench): no method drafts from another's cache or memory;
    --threads sets torch's thread count before anything runs."""
    import torch

    from decodekit.bench.execution import build_contestants

    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "greedy,pld,suffix", "--baselines", "none",
                                     "--threads", "1"))
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    calls: list[int] = []
    contestants, notes = build_contestants(plan, tiny)
    assert calls == [1] and notes == [] and torch.get_num_threads() == threads
    backends = [c.engine.model.backend for c in contestants]
    assert [c.name for c in contestants] == ["greedy", "pld", "suffix"]
    assert len({id(b) for b in backends}) == 3 and all(b is not tiny.backend for b in backends)


def test_a_resumed_run_keeps_the_notes_of_the_run_it_continues(tiny: LoadedModel, qfile: Path, tmp_path: Path, monkeypatch):
    """A question that failed before is not run again: its note comes from the checkpoint, as do the plan's."""
    from decodekit.bench import execution

    class FailsOnQa(Scripted):
        decode = staticmethod(tiny.tokenizer.decode)

        def run(self, prompt_ids, max_new_tokens):
            if " qa: " in self.decode(prompt_ids):
                raise RuntimeError("out of memory")
            return super().run(prompt_ids, max_new_tokens)

    monkeypatch.setattr(execution, "build_contestants", lambda plan, model, hf_model=None: (
        [Scripted("greedy", []), FailsOnQa("b", [])], []))
    common = ("--questions", str(qfile), "--methods", "greedy", "--baselines", "none", "--max-new-tokens", "4",
              "--out", str(tmp_path / "out"))
    first = bench_cli.make_plan(parse(*common, "--categories", "qa"))
    first.notes.append("a note of the first plan")
    before = execute(first, tiny, progress=False)
    failed = [n for n in before["notes"] if n.startswith("b failed on question 5")]
    assert len(failed) == 1
    resumed = execute(bench_cli.make_plan(parse(*common, "--categories", "qa,rag", "--resume")), tiny, progress=False)
    assert "a note of the first plan" in resumed["notes"] and failed[0] in resumed["notes"]


@pytest.mark.parametrize("raw, message", [
    ({"question_id": 1, "category": "qa", "turns": ["a", ""]}, "turns must be a non-empty list of strings that are not blank"),
    ({"question_id": 1, "category": "qa", "turns": [" \n\t"]}, "turns must be a non-empty list of strings that are not blank"),
    ({"question_id": 1, "category": "", "turns": ["a"]}, "category must be a non-empty string"),
])
def test_a_question_with_an_empty_turn_or_category_is_refused(tmp_path: Path, raw, message):
    """Spec-Bench's format: every turn a user message, every question in a named category."""
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(raw) + "\n")
    with pytest.raises(InvalidParameter, match=f":1: {message}"):
        load_questions(path)


def test_a_question_file_without_questions_is_refused(tmp_path: Path):
    """A benchmark over no question would report nothing: refused before the model loads."""
    path = tmp_path / "q.jsonl"
    path.write_text("\n")
    with pytest.raises(InvalidParameter, match="no questions"):
        load_questions(path)


def test_threads_up_to_this_machines_cpus_are_accepted(qfile: Path):
    """Only more threads than CPUs is refused: as many as there are is the usual setting."""
    import os

    cpus = os.cpu_count() or 1
    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--baselines", "none", "--threads", str(cpus)))
    assert plan.threads == cpus
    with pytest.raises(InvalidParameter, match="more than this machine's"):
        bench_cli.make_plan(parse("--questions", str(qfile), "--baselines", "none", "--threads", str(cpus + 1)))


def test_a_baseline_named_twice_runs_once(qfile: Path):
    """Contestant names are unique: a repeated baseline is one contestant, as a repeated method is."""
    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "greedy", "--baselines", "hf,hf-pld,hf"))
    assert plan.baselines == ["hf", "hf-pld"] and "--baselines hf,hf-pld " in plan.command


def test_the_default_methods_are_greedy_and_the_speculative_ones(qfile: Path):
    """Without --methods: the reference and every speculative method, not the sampling or search ones."""
    from decodekit.engine import method_spec

    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--baselines", "none"))
    assert plan.methods[0] == "greedy" and len(plan.methods) > 1
    assert all(method_spec(m).family == "speculative" for m in plan.methods[1:])


def test_an_unknown_method_option_is_refused_before_the_model_loads(qfile: Path):
    """Also for a default method (not named with --methods): one line now, not an error after loading."""
    with pytest.raises(InvalidParameter, match="has no option 'no_such_option'"):
        bench_cli.make_plan(parse("--questions", str(qfile), "--baselines", "none", "--opt", "pld.no_such_option=3"))


def test_the_recorded_command_keeps_the_model_and_the_threads(qfile: Path, tmp_path: Path):
    """The command spells out every setting, the model and torch's thread count included."""
    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "greedy", "--baselines", "none",
                                     "--model", "some-model", "--threads", "1", "--out", str(tmp_path / "out")))
    again = bench_cli.make_plan(parse(*shlex.split(plan.command)[2:]))
    assert (again.model, again.threads) == ("some-model", 1) and again.resume_key() == plan.resume_key()


def test_a_methods_figures_keep_their_unknown_values():
    """A figure a method reports as None is recorded as unknown, not dropped."""
    from decodekit.bench.contestants import json_safe

    assert json_safe({"a": None, "b": 2}) == {"a": None, "b": 2}


def test_prefill_ends_at_the_first_new_token_not_the_last(monkeypatch):
    """Prefill is the time to the first streamed token; later tokens are decode time."""
    from decodekit.bench import contestants

    clock = iter([10.0, 11.0, 15.0, 20.0])
    monkeypatch.setattr(contestants.time, "perf_counter", lambda: next(clock))
    watch = contestants.Stopwatch()
    watch.first_token()
    watch.first_token()
    assert watch.split() == (1.0, 4.0)


class FakeHF:
    """transformers' generate() as the baseline sees it: the prompt streamed first, then each new token
    after one forward pass (the first of them the prefill), the EOS token kept in the output."""

    def __init__(self, new_tokens):
        self.new, self.hooks = list(new_tokens), []

    def eval(self):
        return self

    def register_forward_hook(self, fn):
        self.hooks.append(fn)
        return argparse.Namespace(remove=lambda: self.hooks.remove(fn))

    def generate(self, input_ids, streamer, max_new_tokens, eos_token_id, **kwargs):
        import torch

        streamer.put(input_ids)
        new = self.new[:max_new_tokens]
        stop = next((i for i, t in enumerate(new) if t in eos_token_id), None)
        new = new if stop is None else new[:stop + 1]  # generate() stops after the EOS it produced
        for token in new:
            for hook in list(self.hooks):
                hook(self, (), None)
            streamer.put(torch.tensor([token]))
        return torch.cat([input_ids, torch.tensor([new])], dim=1)


def test_the_hf_baseline_stops_at_its_eos_and_counts_its_passes_after_the_prefill():
    """Like decodekit's loop: the tokens before the first EOS, finish "eos", and decode-time passes only."""
    hf = HFGenerate(FakeHF([4, 5, 2, 6]), frozenset({2}), lambda tokens: "".join(map(str, tokens)))
    result = hf.run([1, 3], 8)
    assert (result.tokens, result.text, result.finish_reason, result.forward_passes) == ([4, 5], "45", "eos", 2)
    again = hf.run([1, 3], 2)
    assert (again.tokens, again.finish_reason, again.forward_passes) == ([4, 5], "length", 1)


class FakeLlama:
    """llama-cpp-python's ``Llama`` as the baseline uses it: streams a scripted token sequence."""

    script: list[int] = []

    def __init__(self, model_path, **kwargs):
        self.resets = 0

    def token_eos(self):
        return 99

    def reset(self):
        self.resets += 1

    def generate(self, tokens, **kwargs):
        yield from self.script

    def detokenize(self, tokens):
        return "".join(map(str, tokens)).encode()


@pytest.mark.parametrize("script, budget, expected", [
    ([4, 5, 6, 7, 8], 3, ([4, 5, 6], "length", 2)),  # stops at the budget
    ([4, 5, 2, 6], 8, ([4, 5], "eos", 2)),  # decodekit's tokenizer's EOS, left out
    ([4, 5, 99, 6], 8, ([4, 5], "eos", 2)),  # llama.cpp's own EOS too
])
def test_the_llamacpp_baseline_stops_at_its_budget_or_eos(monkeypatch, tmp_path: Path, script, budget, expected):
    """Like decodekit's loop: at most max_new_tokens, the tokens before the first EOS (either
    tokenizer's), and decode-time passes only (the first token comes from the prefill)."""
    import sys
    import types

    from decodekit.bench.baselines import LlamaCpp

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    monkeypatch.setattr(FakeLlama, "script", script)
    baseline = LlamaCpp(tmp_path / "m.gguf", frozenset({2}), n_threads=1)
    result = baseline.run([1, 3], budget)
    assert (result.tokens, result.finish_reason, result.forward_passes) == expected
    assert result.text == "".join(map(str, expected[0])) and baseline.llm.resets == 1


def test_the_llamacpp_baseline_runs_on_the_threads_given_for_its_prefill_too(monkeypatch, tmp_path: Path, tiny):
    """--threads bounds llama.cpp's prefill (its batch threads) as well as its decode: left unset,
    llama-cpp-python takes every core of the machine for the prefill, unlike the other contestants."""
    import sys
    import types

    from decodekit.bench import baselines

    made = []

    class Recorded(FakeLlama):
        def __init__(self, model_path, **kwargs):
            super().__init__(model_path)
            made.append(kwargs)

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Recorded))
    monkeypatch.setattr(baselines, "llamacpp_available", lambda: True)
    monkeypatch.setattr(baselines, "model_gguf", lambda model: tmp_path / "m.gguf")
    built, notes = build_baselines(["llamacpp"], tiny, model=None, dtype="float32", threads=3)
    assert [b.name for b in built] == ["llamacpp"] and "n_threads=3" in notes[0]
    assert made[0].get("n_threads") == 3 and made[0].get("n_threads_batch") == 3


def test_the_hf_baselines_quiet_transformers_only_while_they_run():
    from transformers.utils import logging

    from decodekit.bench.baselines import quiet_transformers

    before = logging.get_verbosity()
    logging.set_verbosity_info()
    try:
        with quiet_transformers():
            assert logging.get_verbosity() == logging.ERROR
        assert logging.get_verbosity() == logging.INFO
    finally:
        logging.set_verbosity(before)


def test_the_llamacpp_baseline_on_a_model_without_a_gguf_file_is_a_note(monkeypatch, tiny):
    """A Hugging Face folder has no GGUF file for llama.cpp: the baseline is skipped with a note."""
    import sys
    import types

    from decodekit.bench import baselines

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    monkeypatch.setattr(baselines, "llamacpp_available", lambda: True)
    monkeypatch.setattr(baselines, "model_gguf", lambda model: None)
    built, notes = build_baselines(["llamacpp"], tiny, model="some/folder", dtype="float32", threads=1)
    assert built == [] and notes == ["llamacpp baseline skipped: model 'some/folder' has no GGUF file"]


def test_a_methods_run_reports_the_tokens_it_accepted_per_verification(tiny: LoadedModel):
    """The bench's "accepted/verify" column is the method's own mean_accepted figure for the run."""
    ids = tiny.prompt_ids("abc abc abc abc abc abc")
    expected = Engine(LoadedModel(tiny.backend.clone(), tiny.tokenizer, "tiny")).generate(
        ids, method="pld", max_new_tokens=12).stats.extra["mean_accepted"]
    result = MethodContestant(Engine(LoadedModel(tiny.backend.clone(), tiny.tokenizer, "tiny")), "pld").run(ids, 12)
    assert isinstance(expected, (int, float)) and result.mean_accepted == pytest.approx(float(expected))
    assert "mean_accepted" not in result.extra


# --------------------------------------------------------------------------- mutation hunt: aggregates, tables, resume


def test_throughputs_and_speedups_are_summed_tokens_over_summed_seconds():
    """The documented aggregate: summed new tokens over summed seconds, and a speedup the ratio of two
    such throughputs: not a mean of per-question rates or of per-question speedups (a short question
    would weigh as much as a long one); the category's seconds are sums too, each of its own kind."""
    greedy = {1: (10, 1.0), 2: (40, 2.0)}  # question -> (new tokens, decode seconds)
    fast = {1: (10, 0.25), 2: (40, 2.0)}
    prefill = 0.5
    records = [hand_record("greedy", q, new_tokens=n, decode_s=d, prefill_s=prefill) for q, (n, d) in greedy.items()]
    records += [hand_record("fast", q, new_tokens=n, decode_s=d, prefill_s=prefill) for q, (n, d) in fast.items()]
    stats = summarize(records, hand_contestants("greedy", "fast"), {})["methods"]["fast"]["categories"]["overall"]

    def rates(side):
        tokens, decode = sum(n for n, _ in side.values()), sum(d for _, d in side.values())
        return tokens / decode, tokens / (decode + prefill * len(side))

    (fast_tps, fast_e2e), (greedy_tps, greedy_e2e) = rates(fast), rates(greedy)
    assert stats["decode_tps"] == pytest.approx(fast_tps) and stats["e2e_tps"] == pytest.approx(fast_e2e)
    assert stats["speedup"] == pytest.approx(fast_tps / greedy_tps)
    assert stats["e2e_speedup"] == pytest.approx(fast_e2e / greedy_e2e)
    # (the per-question means differ here, so the test tells them apart)
    mean_rate = sum(n / d for n, d in fast.values()) / len(fast)
    mean_ratio = sum((fast[q][0] / fast[q][1]) / (greedy[q][0] / greedy[q][1]) for q in fast) / len(fast)
    assert mean_rate != pytest.approx(fast_tps) and mean_ratio != pytest.approx(fast_tps / greedy_tps)
    assert stats["decode_s"] == pytest.approx(sum(d for _, d in fast.values()))
    assert stats["prefill_s"] == pytest.approx(prefill * len(fast))


def test_exact_text_match_and_prefix_shares_come_from_their_own_verdicts():
    """exact: token-identical outputs; text match: identical text (the one verdict a llama.cpp run
    gets, and true of an output spelt with other tokens); prefix share: how much of greedy's text an
    output reproduces. Three figures from three verdicts, each the mean of the runs that have one."""
    verdicts = [(True, True, 1.0), (False, True, 1.0), (None, True, 1.0), (None, False, 0.25)]
    records = [hand_record("greedy", q) for q in range(len(verdicts))]
    records += [{**hand_record("m", q), "identical_to_reference": exact, "text_match": text, "text_prefix_share": prefix}
                for q, (exact, text, prefix) in enumerate(verdicts)]
    stats = summarize(records, hand_contestants("greedy", "m"), {})["methods"]["m"]["categories"]["overall"]

    def mean_present(i):
        present = [float(v[i]) for v in verdicts if v[i] is not None]
        return sum(present) / len(present)

    assert stats["exact_share"] == pytest.approx(mean_present(0))
    assert stats["text_match_share"] == pytest.approx(mean_present(1))
    assert stats["text_prefix_share"] == pytest.approx(mean_present(2))
    assert len({stats["exact_share"], stats["text_match_share"], stats["text_prefix_share"]}) == 3


def test_the_vs_hf_column_is_the_decode_only_ratio():
    """vs HF, like speedup, is decode-only throughput against transformers (the e2e ratio is in results.json)."""
    from decodekit.bench.report import method_table

    summary = hand_summary()
    summary["methods"]["spec"]["categories"]["overall"] |= {"speedup_vs_hf": 1.5, "e2e_speedup_vs_hf": 1.25}
    assert table_row(method_table(summary, "overall", markdown=True), "spec", markdown=True)["vs HF"] == "1.50x"


def test_each_categorys_table_shows_that_categorys_figures():
    """A per-category section shows the category's own figures, not the overall ones again."""
    summary = hand_summary()
    for name, speedup, tps in (("greedy", 1.0, 12.0), ("spec", 1.75, 21.0)):
        summary["methods"][name]["categories"]["qa"] |= {"speedup": speedup, "decode_tps": tps, "questions": 1}
    report = markdown_report(hand_results(summary=summary), image=None)
    qa = report.split("### qa (1 question)\n\n", 1)[1].split("\n\n", 1)[0]
    row = table_row(qa, "spec", markdown=True)
    assert row["speedup"] == "1.75x" and row["tok/s"] == "21.0" and row["questions"] == "1"
    overall = table_row(report.split("## Overall\n\n", 1)[1].split("\n\n", 1)[0], "spec", markdown=True)
    assert overall["speedup"] == "3.25x"


def test_the_terminal_matrix_shows_the_decode_only_speedup():
    """The terminal's by-category matrix is headed decode-only: it shows speedup, not e2e speedup."""
    terminal = terminal_report(hand_results())
    matrix_text = terminal.split("by category:\n", 1)[1]
    row = table_row(matrix_text, "spec")
    assert row["overall"] == "3.25x" and row["qa"] == "3.25x"


def test_a_methods_run_reports_the_engines_prefill_and_decode_times(tiny: LoadedModel, monkeypatch):
    """A decodekit contestant's timings are the engine's own: prefill as prefill, decode as decode."""
    contestant = MethodContestant(Engine(LoadedModel(tiny.backend.clone(), tiny.tokenizer, "tiny")), "greedy")
    made = []
    generate = contestant.engine.generate
    monkeypatch.setattr(contestant.engine, "generate", lambda *a, **k: made.append(generate(*a, **k)) or made[-1])
    result = contestant.run(tiny.prompt_ids("abc abc"), 6)
    stats = made[0].stats
    assert (result.prefill_s, result.decode_s) == (stats.prefill_s, stats.decode_s)
    assert result.tokens == list(made[0].tokens) and result.forward_passes == stats.forward_passes


def test_a_fresh_speculative_contestant_has_its_cost_table_before_the_repeats_warm_up(tiny: LoadedModel, tmp_path: Path,
                                                                                        monkeypatch):
    """Starting a repeat afresh is set-up like the first start: the verify-cost table is read (or
    measured) in fresh(), not in the repeat's warm-up or its first question."""
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))
    contestant = MethodContestant(Engine(LoadedModel(tiny.backend.clone(), tiny.tokenizer, "tiny")), "pld")
    contestant.fresh()
    contestant.engine.model.backend.memory("speculative.cost_table", lambda: pytest.fail("not prepared"))
    plain = MethodContestant(Engine(LoadedModel(tiny.backend.clone(), tiny.tokenizer, "tiny")), "greedy")
    plain.fresh()  # nothing speculative to prepare
    assert "speculative.cost_table" not in plain.engine.model.backend.__dict__.get("_memory", {})


def test_results_say_which_contestants_are_token_exact(tiny: LoadedModel, qfile: Path):
    """results.json tells a reader whose exact share is comparable: a contestant that is not token
    exact is described as such, in the run and in the summary."""
    class Loose(Scripted):
        token_exact = False

    run = run_bench([Scripted("greedy", []), Loose("loose", [])], load_questions(qfile, limit=1)[:1], prompt_fn(tiny),
                    BenchConfig(max_new_tokens=3), progress=False)
    assert {c["name"]: c["token_exact"] for c in run.contestants} == {"greedy": True, "loose": False}
    methods = summarize(run.records, run.contestants, run.peak_rss_mb)["methods"]
    assert methods["loose"]["token_exact"] is False and methods["greedy"]["token_exact"] is True


def test_the_resumed_note_is_about_this_run_only(tiny: LoadedModel, qfile: Path, tmp_path: Path):
    """"resumed: N question(s)" describes the run that says it: it is not saved in the checkpoint,
    so a run resumed twice says its own count once, not also the count of the run before."""
    out = tmp_path / "out"
    common = ("--questions", str(qfile), "--methods", "greedy", "--baselines", "none", "--max-new-tokens", "4",
              "--out", str(out))
    execute(bench_cli.make_plan(parse(*common, "--categories", "qa")), tiny, progress=False)
    second = execute(bench_cli.make_plan(parse(*common, "--categories", "qa,rag", "--resume")), tiny, progress=False)
    assert [n for n in second["notes"] if n.startswith("resumed:")] == [
        "resumed: 1 question(s) taken from an earlier run of the same code and settings"]
    third = execute(bench_cli.make_plan(parse(*common, "--resume")), tiny, progress=False)
    assert [n for n in third["notes"] if n.startswith("resumed:")] == [
        "resumed: 2 question(s) taken from an earlier run of the same code and settings"]
    saved = json.loads((out / "checkpoint.json").read_text())["notes"]
    assert not any(n.startswith("resumed:") for n in saved)


@pytest.mark.parametrize("changed, key", [(("--repeats", "2"), "repeats"), (("--opt", "pld.max_ngram=3"), "options"),
                                          (("--all-turns",), "all_turns"), (("--dtype", "bfloat16"), "dtype")])
def test_resume_refuses_other_repeats_options_turns_or_dtype(qfile: Path, tmp_path: Path, changed, key):
    """Records measured with other settings cannot be mixed into this run's medians and ratios."""
    from decodekit.bench.execution import save_checkpoint

    common = ("--questions", str(qfile), "--methods", "greedy,pld", "--baselines", "none", "--out", str(tmp_path / "out"))
    save_checkpoint(bench_cli.make_plan(parse(*common)), [], [])
    bench_cli.make_plan(parse(*common, "--resume"))  # the same settings resume
    with pytest.raises(InvalidParameter, match=f"other settings .*{key}"):
        bench_cli.make_plan(parse(*common, *changed, "--resume"))


def test_a_checkpoint_write_that_fails_midway_leaves_the_last_one_whole(qfile: Path, tmp_path: Path, monkeypatch):
    """The checkpoint is replaced atomically: a write cut short (a full disk, a kill) leaves the
    previous checkpoint to resume from, not half a JSON file."""
    from decodekit.bench.execution import save_checkpoint

    common = ("--questions", str(qfile), "--methods", "greedy", "--baselines", "none", "--out", str(tmp_path / "out"))
    plan = bench_cli.make_plan(parse(*common))
    save_checkpoint(plan, [], ["after question 1"])
    write_text = Path.write_text

    def cut_short(self, text, *args, **kwargs):
        write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError("No space left on device")

    monkeypatch.setattr(Path, "write_text", cut_short)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(plan, [], ["after question 2"])
    monkeypatch.setattr(Path, "write_text", write_text)
    assert bench_cli.make_plan(parse(*common, "--resume")).previous_notes == ["after question 1"]


def test_the_checkpoint_names_the_question_file_the_questions_were_read_from(tiny: LoadedModel, qfile: Path,
                                                                             tmp_path: Path, monkeypatch):
    """The question file is fingerprinted when its questions are read: edited later (while the model
    loads, or during the first question), the checkpoint still says which file the answers are to,
    and a resume from the edited file is refused rather than mixing answers to two question sets."""
    from decodekit.bench import execution

    common = ("--questions", str(qfile), "--methods", "greedy", "--baselines", "none", "--max-new-tokens", "4",
              "--out", str(tmp_path / "out"))
    plan = bench_cli.make_plan(parse(*common, "--categories", "qa"))
    original = qfile.read_text()
    run_bench_ = execution.run_bench

    def edited_meanwhile(*args, **kwargs):
        qfile.write_text(original.replace("say more", "say less"))
        return run_bench_(*args, **kwargs)

    monkeypatch.setattr(execution, "run_bench", edited_meanwhile)
    results = execute(plan, tiny, progress=False)
    assert all("say more" in q.turns[0] for q in plan.questions) and results["records"]
    with pytest.raises(InvalidParameter, match="has changed since"):
        bench_cli.make_plan(parse(*common, "--resume"))
    qfile.write_text(original)
    assert bench_cli.make_plan(parse(*common, "--resume")).previous  # the file it was: resumes


def test_each_turn_is_fed_in_the_files_order_after_the_contestants_earlier_answers(tiny: LoadedModel, tmp_path: Path):
    """The prompts a contestant reads are the chat of the question's turns in order, each after the
    answers it gave to the earlier ones; without all_turns, the first turn alone."""
    questions = load_questions(write_questions(tmp_path / "q.jsonl", ["qa"], turns=3))
    turns = questions[0].turns
    prompt_ids = prompt_fn(tiny)
    log: list = []
    run_bench([Scripted("greedy", log, tokens=(40, 41))], questions, prompt_ids,
              BenchConfig(max_new_tokens=2, all_turns=True), progress=False)
    chat: list[dict[str, str]] = []
    expected = []
    for turn in turns:
        chat.append({"role": "user", "content": turn})
        expected.append(prompt_ids(list(chat)))
        chat.append({"role": "assistant", "content": "xx"})  # Scripted's text for two tokens
    assert [ids for _, ids in log[1:]] == expected
    log.clear()
    run_bench([Scripted("greedy", log, tokens=(40, 41))], questions, prompt_ids, BenchConfig(max_new_tokens=2),
              progress=False)
    assert [ids for _, ids in log[1:]] == [prompt_ids([{"role": "user", "content": turns[0]}])]


def test_a_multi_turn_records_extra_figures_are_its_last_turns():
    """A record ends as its conversation ended: the method's own figures (extra) are its last turn's."""
    from decodekit.bench.questions import Question
    from decodekit.bench.runner import make_record

    first = RunResult([1], "a", 0.1, 0.2, "length", forward_passes=1, extra={"draft": 1})
    last = RunResult([2], "b", 0.1, 0.2, "length", forward_passes=1, extra={"draft": 2})
    assert make_record(Scripted("m", []), Question(1, "qa", ("a", "b")), 0, 0, [(3, first), (5, last)])["extra"] == {"draft": 2}


def test_a_record_with_a_time_that_is_not_finite_is_not_a_record():
    """A checkpoint's times are checked as finite numbers: NaN or infinity (an edited file) is refused."""
    from decodekit.bench.questions import Question
    from decodekit.bench.runner import is_record, make_record

    record = make_record(Scripted("m", []), Question(1, "qa", ("a",)), 0, 0,
                         [(3, RunResult([1, 2], "xy", 0.1, 0.2, "length", forward_passes=2))])
    assert is_record(record)
    for key in ("prefill_s", "decode_s", "decode_tps"):
        for bad in (float("nan"), float("inf")):
            assert not is_record({**record, key: bad}), (key, bad)


def test_a_record_edited_by_hand_is_refused_field_by_field():
    """Every field of a checkpoint's record is of the type make_record writes: a value of another
    (a "no" where the report sums booleans: it was a traceback in the summary) is refused; the
    values make_record writes after the comparison with the reference are taken."""
    from decodekit.bench.questions import Question
    from decodekit.bench.runner import is_record, make_record

    record = make_record(Scripted("m", []), Question(1, "qa", ("a",)), 0, 0,
                         [(3, RunResult([1, 2], "xy", 0.1, 0.2, "length", forward_passes=2, extra={"verifications": 2}))])
    compared = {**record, "identical_to_reference": True, "text_match": False, "text_prefix_share": 0.5,
                "verifications": 2, "error": "boom", "finish_reason": None}
    assert is_record(record) and is_record(compared) and is_record({**compared, "lossless": None})  # a peer's
    for key, bad in (("identical_to_reference", "no"), ("text_match", 1), ("text_prefix_share", "x"),
                     ("category", 123), ("kind", None), ("family", 5), ("lossless", "yes"), ("texts", [5]),
                     ("tokens", ["a"]), ("tokens", [[1, -2]]), ("tokens", [[True]]), ("finish_reason", 5),
                     ("verifications", "x"), ("verifications", -1), ("error", 3), ("extra", []), ("group", None)):
        assert not is_record({**compared, key: bad}), (key, bad)


def test_a_bench_without_questions_or_with_a_name_twice_is_refused(tiny: LoadedModel, qfile: Path):
    questions = load_questions(qfile, limit=1)
    with pytest.raises(InvalidParameter, match="no questions"):
        run_bench([Scripted("greedy", [])], [], prompt_fn(tiny), BenchConfig(max_new_tokens=2), progress=False)
    log: list = []
    with pytest.raises(InvalidParameter, match="names must be unique"):
        run_bench([Scripted("greedy", log), Scripted("b", log), Scripted("b", log)], questions, prompt_fn(tiny),
                  BenchConfig(max_new_tokens=2), progress=False)
    assert log == []  # refused before any warm-up


def test_a_checkpoint_of_a_run_with_more_contestants_resumes_this_runs_questions(tiny: LoadedModel, qfile: Path):
    """Resuming with fewer contestants than the interrupted run had takes the questions every one of
    this run's contestants finished, and reports only their records."""
    questions = load_questions(qfile, limit=1)
    config = BenchConfig(max_new_tokens=3)
    wider = run_bench([Scripted(n, []) for n in ("greedy", "b", "c")], questions, prompt_fn(tiny), config, progress=False)
    log: list = []
    narrower = run_bench([Scripted(n, log) for n in ("greedy", "b")], questions, prompt_fn(tiny), config, progress=False,
                         previous=wider.records)
    assert narrower.resumed == len(questions) and len(log) == 2  # the warm-ups alone
    assert {r["method"] for r in narrower.records} == {"greedy", "b"}


def test_the_reference_text_is_compared_without_surrounding_whitespace():
    """Texts are compared as the reports show them: greedy's trailing newline is no mismatch."""
    from decodekit.bench.runner import compare_to_reference

    def rec(method, text):
        return {"method": method, "error": None, "texts": [text], "tokens": [[1]],
                "identical_to_reference": None, "text_match": None, "text_prefix_share": None}

    greedy, other = rec("greedy", "the answer\n"), rec("m", "the answer")
    compare_to_reference([greedy, other], "greedy", {})
    assert other["text_match"] is True and other["text_prefix_share"] == 1.0


def test_a_bench_leaves_the_collector_as_its_caller_had_it(tiny: LoadedModel, qfile: Path):
    """A caller that turned the collector off finds it off after the bench (timed runs turn it off, then restore it)."""
    import gc

    seen: list[bool] = []

    class Probe(Scripted):
        def run(self, prompt_ids, max_new_tokens):
            seen.append(gc.isenabled())
            return super().run(prompt_ids, max_new_tokens)

    gc.disable()
    try:
        run_bench([Probe("greedy", [])], load_questions(qfile, limit=2), prompt_fn(tiny), BenchConfig(max_new_tokens=2),
                  progress=False)
        assert seen and not any(seen) and not gc.isenabled()
    finally:
        gc.enable()


def test_machine_record_and_report_keep_usable_and_logical_cores_apart(monkeypatch):
    from decodekit.bench import results as results_mod
    from decodekit.bench.report import machine_lines

    monkeypatch.setattr(results_mod, "usable_cores", lambda: 1)
    monkeypatch.setattr(results_mod.os, "cpu_count", lambda: 8)
    m = results_mod.machine_info(model="m", dtype="float32")
    assert (m["usable_cores"], m["logical_cores"]) == (1, 8)
    assert "(1 usable of 8 logical cores" in machine_lines(m)[0]


def test_the_cpu_is_named_by_its_model_name_line(monkeypatch):
    from decodekit.bench import results as results_mod

    class FakePath:
        def __init__(self, p):
            self.p = p

        def read_text(self, encoding=None):
            return "processor\t: 0\nmodel name\t: Test CPU @ 2.00GHz\n"

    monkeypatch.setattr(results_mod, "Path", FakePath)
    assert results_mod.cpu_model() == "Test CPU @ 2.00GHz"


def test_a_run_on_another_model_never_resumes(qfile):
    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--baselines", "none"))
    import dataclasses

    assert dataclasses.replace(plan, model="other.gguf").resume_key() != plan.resume_key()


def test_the_machine_record_counts_only_this_runs_passes(tiny, qfile, tmp_path, monkeypatch):
    from decodekit.models.threads import GOVERNOR

    monkeypatch.setitem(GOVERNOR.passes, 999, 5)  # passes an earlier run of this process made
    plan = bench_cli.make_plan(parse("--questions", str(qfile), "--methods", "greedy", "--baselines", "none",
                                     "--max-new-tokens", "2", "--limit", "1", "--out", str(tmp_path / "o")))
    results = execute(plan, tiny, progress=False)
    assert "999" not in results["machine"]["passes_by_threads"]


def test_all_turns_records_sum_every_turns_prefill_and_match_identical_texts(tiny, tmp_path):
    questions = load_questions(write_questions(tmp_path / "q.jsonl", ["qa"], turns=2))
    run = run_bench([Scripted("greedy", [], tokens=(40, 41)), Scripted("copy", [], tokens=(40, 41))], questions,
                    prompt_fn(tiny), BenchConfig(max_new_tokens=2, all_turns=True), progress=False)
    for rec in run.records:
        assert rec["turns"] == 2 and rec["prefill_s"] == pytest.approx(2 * 0.002)
        assert rec["text_match"] is True and rec["text_prefix_share"] == 1.0


def test_a_speedup_against_a_reference_that_produced_no_tokens_is_unknown():
    """A reference that produced no tokens has a throughput of 0: a ratio over it has no size, shown
    as unknown rather than dividing by zero."""
    records = [hand_record("greedy", 1, new_tokens=0, decode_s=1.0), hand_record("fast", 1, new_tokens=10, decode_s=0.5)]
    stats = summarize(records, hand_contestants("greedy", "fast"), {})["methods"]["fast"]["categories"]["overall"]
    assert stats["decode_tps"] == pytest.approx(10 / 0.5)
    assert stats["speedup"] is None and stats["e2e_speedup"] is None


def test_accepted_per_verification_weighs_questions_by_verifications_over_an_even_number_of_repeats():
    """A question's verification count over repeats is one observed count (the lower median), so it
    still weighs its question: with two repeats each, 10 verifications of 2.0 tokens and 2 of 4.0
    give (20 + 8) / 12 tokens per verification, not the mean of the questions' figures (3.0)."""
    records = [hand_record("greedy", q, repeat=r) for q in (1, 2) for r in (0, 1)]
    for q, accepted, verifications in ((1, 2.0, 10), (2, 4.0, 2)):
        for r in (0, 1):
            records.append(hand_record("spec", q, accepted=accepted, repeat=r) | {"verifications": verifications})
    stats = summarize(records, hand_contestants("greedy", "spec"), {})["methods"]["spec"]["categories"]["overall"]
    assert stats["mean_accepted"] == pytest.approx((2.0 * 10 + 4.0 * 2) / 12)


def test_a_share_of_zero_reads_0_percent_not_unknown():
    """An exact or text-match share of 0 (no output matched greedy) is a figure, 0%; only a share
    that could not be measured reads "-"."""
    from decodekit.bench.report import method_table

    summary = hand_summary()
    summary["methods"]["spec"]["categories"]["overall"] |= {"exact_share": 0.0, "text_match_share": None}
    row = table_row(method_table(summary, "overall", markdown=True), "spec", markdown=True)
    assert row["exact"] == "0%" and row["text match"] == "-"


def test_compare_shows_no_change_as_zero_not_unknown():
    """Two runs with the same figures changed by +0, which is not the "-" of a change that cannot be computed."""
    from decodekit.bench.report import change, speedups

    assert change(5.0, 5.0) == ["5.0", "5.0", "+0.0%"]
    assert speedups({"speedup": 2.0}, {"speedup": 2.0}) == ["2.00x", "2.00x", "+0.00"]
    spec = next(line for line in compare(hand_results(), hand_results()).splitlines() if line.startswith("spec "))
    assert spec.split() == ["spec", "qa", "30.0", "30.0", "+0.0%", "3.25x", "3.25x", "+0.00"]


def test_a_category_heading_counts_the_references_questions_whatever_the_method_order():
    """The heading's count is the reference's (every question of the category), not that of the first
    method listed, which may have failed some."""
    summary = hand_summary()
    summary["methods"] = {"spec": summary["methods"]["spec"], "greedy": summary["methods"]["greedy"]}
    summary["methods"]["spec"]["categories"]["qa"]["questions"] = 1
    report = markdown_report(hand_results(summary=summary), image=None)
    assert "### qa (2 questions)\n" in report


def test_memory_is_reported_to_a_tenth_of_a_gib(monkeypatch):
    """8000000 KiB is 8000000 / 1024**2 = 7.63 GiB: the machine record keeps one decimal, 7.6, not 8."""
    from pathlib import Path

    from decodekit.bench import results

    read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "MemTotal:        8000000 kB\n"
                        if str(self) == "/proc/meminfo" else read_text(self, *a, **k))
    assert results.memory_gb() == 7.6


def test_the_exactness_note_reads_the_overall_share_not_a_categorys():
    """A lossless method that matched greedy on every qa output but on none of the writing ones matched
    on half of all outputs: the note gives the overall share, and is made although qa alone is 100%."""
    from decodekit.bench.results import exactness_notes

    shares = {"qa": 1.0, "writing": 0.0, "overall": 0.5}
    spec = {"lossless": True, "categories": {c: {"exact_share": s} for c, s in shares.items()}}
    notes = exactness_notes({"reference": "greedy", "methods": {"spec": spec}})
    assert len(notes) == 1 and notes[0].startswith("spec is lossless but matched greedy on 50% of outputs")


def test_end_to_end_throughput_counts_a_run_with_no_decode_time():
    """An answer of one token comes out of the prefill: no decode seconds, so no decode-only rate,
    but its end-to-end rate is 1 token / 0.5 s, and the end-to-end speedup over an identical reference is 1."""
    records = [hand_record(m, 1, new_tokens=1, decode_s=0.0, prefill_s=0.5) for m in ("greedy", "m")]
    stats = summarize(records, hand_contestants("greedy", "m"), {})["methods"]["m"]["categories"]["overall"]
    assert stats["decode_tps"] is None and stats["speedup"] is None
    assert stats["e2e_tps"] == pytest.approx(1 / 0.5) and stats["e2e_speedup"] == pytest.approx(1.0)


def test_a_run_into_a_folder_that_holds_another_says_it_replaces_it(qfile: Path, tmp_path: Path, capsys):
    """Without --resume, an --out holding an earlier run's checkpoint is replaced, and a line says so
    (an interrupted run left the new checkpoint beside the old results without a word)."""
    out = tmp_path / "run"
    argv = ("--questions", str(qfile), "--methods", "greedy", "--baselines", "none", "--out", str(out))
    bench_cli.make_plan(parse(*argv))
    assert "replaces" not in capsys.readouterr().err
    out.mkdir()
    (out / "checkpoint.json").write_text("{}")
    bench_cli.make_plan(parse(*argv))
    assert capsys.readouterr().err == f"decodekit: {out} holds an earlier run, which this one replaces (--resume continues it)\n"
