"""Trained drafters (EAGLE, Medusa) on a tiny model: the features they read, their training, their
files, and the lossless promise (greedy token identity, keyed-sampling identity, chi-square)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import shutil
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from decodekit.engine.core import Request, StepDecoder
from decodekit.errors import InvalidModel, InvalidParameter
from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.tiny import tiny_llama
from decodekit.samplers import Sampler
from decodekit.speculative.controller import Controller
from decodekit.speculative.drafters import DRAFTER_SPECS
from decodekit.speculative.loop import SpeculativeMethod
from decodekit.speculative.trained import data as data_module
from decodekit.speculative.trained import store
from decodekit.speculative.trained.data import Corpus, Exclusion, answer, check_excluded, self_distil
from decodekit.speculative.trained.networks import EagleNet, MedusaNet
from decodekit.speculative.trained.train import Settings, batches, draft_vocabulary, mean_loss, new_net, report, split, train
from decodekit.speculative.verify import SamplingVerifier
from tests.test_speculative_sampling import chi_square_passes, marginal
from tests.marks import HAS_FAST_NUMERICS, needs_fast_numerics

KINDS = ["eagle", "medusa", "hydra"]
QUERIES = ["abcabc", "hello world", "xyz xyz", "the cat sat", "qqq rrr", "mnop", "a b c d", "zzz"]
PROMPTS = [CharTokenizer(96).encode(q) for q in QUERIES[:4]]



def train_args(**given) -> argparse.Namespace:
    """``train-drafter``'s arguments as its parser gives them, with ``given`` in place of its defaults."""
    from decodekit.speculative.trained import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return argparse.Namespace(**{**vars(parser.parse_args(["--kind", given["kind"]])), **given})

def tiny(seed: int = 0, **kwargs) -> LoadedModel:
    kwargs.setdefault("hidden_size", 64)  # head_dim 16: the kernels' path, where every row is computed on its own
    return LoadedModel(tiny_llama(seed=seed, scale=2.0, **kwargs), CharTokenizer(kwargs.get("vocab_size", 96)), "tiny")


def corpus_of(model: LoadedModel, tokens: int = 60, count: int = len(QUERIES)) -> Corpus:
    samples = [answer(model.backend, model.tokenizer, q, tokens) for q in QUERIES[:count]]
    return Corpus(samples)


STEPS = {"eagle": 100, "medusa": 400, "hydra": 200}  # enough for the acceptance test's margin (about twice it), with room to spare


def trained_net(model: LoadedModel, kind: str):
    settings = Settings(kind, minutes=1, steps=STEPS[kind], vocab=64, batch_tokens=256)
    corpus = corpus_of(model)
    samples, _ = split(corpus, 0)
    net = new_net(kind, model.backend, draft_vocabulary(samples, settings.vocab, model.backend.info.vocab_size), settings)
    train(net, samples, model.backend, settings)
    return net, settings, corpus


@pytest.fixture(scope="module")
def drafter_files(tmp_path_factory):
    """A trained drafter of each kind for tiny(seed=0) in each numerics (the ``fast`` one holds
    quantised weights: another model), saved to files; trained on the answers to QUERIES, which
    the tests decode (a tiny random model's text is not learnable beyond what it has seen)."""
    folder = tmp_path_factory.mktemp("drafters")
    paths = {}
    for numerics in ("exact", "fast") if HAS_FAST_NUMERICS else ("exact",):
        model = tiny(numerics=numerics)
        for kind in KINDS:
            net, settings, corpus = trained_net(model, kind)
            paths[kind, numerics] = store.save(net, kind, model.backend, folder / f"{kind}-{numerics}.safetensors", {})
    return paths


def method_for(kind: str, path, budget: int | None = None, verifier=None, **options) -> SpeculativeMethod:
    drafter = DRAFTER_SPECS[kind].factory(drafter=str(path), **options)
    controller = Controller(8, budget=budget) if budget else Controller(8, cost_table={1: 1.0, 4: 1.0, 9: 1.0})
    return SpeculativeMethod(drafter, controller, verifier)


def run(model, method, prompt, sampler=None, n=40):
    request = Request(list(prompt), sampler or Sampler(greedy=True), max_new_tokens=n, ignore_eos=True)
    return StepDecoder(method).generate(model, request)


# The features the drafters read ---------------------------------------------------------------------------


def test_features_are_the_same_in_a_step_a_tree_and_a_prompt():
    """A position's feature does not depend on the pass that computed it (rows are independent)."""
    backend = tiny().backend
    prompt = [5, 6, 7, 8, 9]
    backend.prefill(prompt)
    prompt_features = backend.last_features[0].clone()
    assert prompt_features.shape == (len(prompt), backend.info.hidden_size)
    backend.step(torch.tensor([10]))
    stepped = backend.last_features[0, 0].clone()
    backend.truncate(len(prompt))
    backend.verify_tree(torch.tensor([10, 11, 12]), [-1, 0, 0])
    assert torch.equal(backend.last_features[0, 0], stepped)
    backend.reset(1)
    backend.append(torch.tensor([prompt[:3]]))
    assert torch.equal(backend.last_features[0], prompt_features[:3])


# Training ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, unroll", [("eagle", 1), ("eagle", 2), ("medusa", 1), ("hydra", 1)])
def test_training_lowers_the_loss(kind, unroll):
    model = tiny()
    settings = Settings(kind, minutes=1, steps=STEPS[kind] // 2, vocab=64, batch_tokens=256, unroll=unroll)
    samples = corpus_of(model).samples
    net = new_net(kind, model.backend, draft_vocabulary(samples, settings.vocab, 96), settings)
    before = mean_loss(net, samples, model.backend, settings)
    outcome = train(net, samples, model.backend, settings)
    after = mean_loss(net, samples, model.backend, settings)
    assert outcome.steps == settings.steps
    assert after < 0.7 * before, (before, after)


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_count_trains_the_same_net_twice(kind):
    """``steps``: the schedule runs over the steps, not the clock, so a second run is the same net."""
    model = tiny()
    samples = corpus_of(model, tokens=20).samples
    settings = Settings(kind, minutes=1, steps=12, vocab=64, batch_tokens=128)
    nets = []
    for _ in range(2):
        net = new_net(kind, model.backend, draft_vocabulary(samples, settings.vocab, 96), settings)
        assert train(net, samples, model.backend, settings).steps == 12
        nets.append(net.state_dict())
    assert nets[0].keys() == nets[1].keys()
    assert all(torch.equal(nets[0][k], nets[1][k]) for k in nets[0])
    with pytest.raises(InvalidParameter, match="--steps must be at least 1"):
        Settings(kind, steps=0)


def test_the_draft_vocabulary_is_the_most_frequent_tokens():
    corpus = Corpus([data_module.Sample([1, 2, 2, 3, 3, 3, 9], 1, torch.zeros(7, 4))])
    assert draft_vocabulary(corpus.samples, 2, 96).tolist() == [2, 3]  # token 1 is before scored_from
    assert draft_vocabulary(corpus.samples, 5, 96).tolist() == [0, 1, 2, 3, 9]  # topped up with unused ids
    tied = [data_module.Sample([5, 4, 4, 5, 7], 0, torch.zeros(5, 4))]
    assert draft_vocabulary(tied, 1, 96).tolist() == [4]  # a tie in frequency: the smaller id first


def test_the_draft_vocabulary_counts_only_the_scored_part():
    """The template before ``scored_from`` is never a draft target: its tokens are not counted, however often."""
    samples = [data_module.Sample([4, 4, 4, 2, 3, 3], 3, torch.zeros(6, 4))]
    assert draft_vocabulary(samples, 2, 96).tolist() == [2, 3]


def test_the_draft_vocabulary_is_topped_up_with_ids_it_does_not_hold_yet():
    """Fewer distinct tokens than asked: the smallest *unused* ids fill it, each id once."""
    samples = [data_module.Sample([0, 0, 5], 0, torch.zeros(3, 4))]
    assert draft_vocabulary(samples, 3, 96).tolist() == [0, 1, 5]


def test_batches_hold_up_to_batch_tokens_counting_each_sample_cut_to_max_len():
    """Batches of about ``batch_tokens`` tokens: a group exactly that full is one batch, and a sample
    counts as the ``max_len`` tokens it is cut to."""
    def sizes(lengths, **kw):
        settings = Settings("eagle", **kw)
        samples = [data_module.Sample([1] * n, 0, torch.zeros(n, 4)) for n in lengths]
        stream = batches(samples, settings, random.Random(0))
        groups = {id(g): g for g in (next(stream) for _ in range(len(lengths)))}  # every group, each once
        return sorted(len(g) for g in groups.values())
    assert sizes([4, 4, 4, 4], batch_tokens=8) == [2, 2]
    assert sizes([10, 10, 10, 10], batch_tokens=8, max_len=4) == [2, 2]


def test_training_records_its_first_and_last_loss_and_the_scored_tokens_seen():
    """The outcome the drafter file reports: the first step's loss, the last one's, and the tokens
    scored (from the query on, not the template nor the padding)."""
    model = tiny()
    samples = [data_module.Sample(list(range(1, 13)), 4, torch.zeros(12, 64)),
               data_module.Sample(list(range(1, 9)), 2, torch.zeros(8, 64))]
    settings = Settings("medusa", minutes=1, steps=3, vocab=16, batch_tokens=64)
    net = new_net("medusa", model.backend, draft_vocabulary(samples, settings.vocab, 96), settings)
    losses = []
    outcome = train(net, samples, model.backend, settings, lambda step, loss, metrics: losses.append(loss))
    assert outcome.steps == 3 and len(losses) == 3
    assert outcome.first_loss == losses[0] and outcome.last_loss == losses[-1] and losses[0] != losses[-1]
    assert outcome.tokens_seen == 3 * ((12 - 4) + (8 - 2))  # both samples in one batch, every step


def learning_rates(monkeypatch, settings: Settings, clock=None) -> tuple[list[float], object]:
    """The learning rate of each optimiser step of a short Medusa training (and its outcome);
    ``clock``: what ``time.perf_counter`` reads in the training, where a test sets the time."""
    from decodekit.speculative.trained import train as train_module

    rates: list[float] = []

    class Recording(torch.optim.AdamW):
        def step(self, *args, **kwargs):
            rates.append(self.param_groups[0]["lr"])
            return super().step(*args, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", Recording)
    if clock is not None:
        monkeypatch.setattr(train_module, "time", SimpleNamespace(perf_counter=clock))
    model = tiny()
    samples = [data_module.Sample(list(range(1, 9)), 2, torch.zeros(8, 64))]
    net = new_net("medusa", model.backend, draft_vocabulary(samples, settings.vocab, 96), settings)
    return rates, train(net, samples, model.backend, settings)


def test_the_learning_rate_warms_up_over_20_steps_then_decays_as_a_cosine_over_the_steps_to_a_floor(monkeypatch):
    """From lr / 20 up to about lr over the first 20 steps, then a cosine over the steps asked for
    (half of lr halfway), never below lr / 50; the clock has no part in it when steps are given."""
    lr = 1e-3
    rates, outcome = learning_rates(monkeypatch, Settings("medusa", minutes=1, steps=100, vocab=16, lr=lr))
    assert outcome.steps == len(rates) == 100
    assert rates[0] == pytest.approx(lr / 20)
    assert all(a < b for a, b in zip(rates[:20], rates[1:20]))  # the warm-up
    assert all(a >= b for a, b in zip(rates[19:], rates[20:]))  # the decay
    assert rates[50] == pytest.approx(lr / 2)
    assert min(rates) == pytest.approx(lr / 50) and rates[-1] == pytest.approx(lr / 50)


def test_a_training_without_steps_stops_at_its_minutes_and_decays_over_them(monkeypatch):
    """No ``steps``: the budget is ``minutes`` of the clock, and the schedule runs over it."""
    now = iter(range(0, 10_000, 10))  # every reading of the clock 10 seconds after the last
    lr = 1e-3
    rates, outcome = learning_rates(monkeypatch, Settings("medusa", minutes=1, vocab=16, lr=lr), lambda: next(now))
    assert outcome.steps == len(rates) == 5  # at 10, 20, ..., 50 s of the 60; none at 60
    assert outcome.seconds == 70  # the reading after the stop
    # the warm-up's factor (k + 1) / 20 times the cosine at 10 (k + 1) of the 60 seconds, above the floor
    expected = [max(lr * (k + 1) / 20 * 0.5 * (1 + math.cos(math.pi * (k + 1) / 6)), lr / 50) for k in range(5)]
    assert rates == pytest.approx(expected)


def test_medusa_never_scores_a_token_outside_the_draft_vocabulary():
    """A label outside the draft vocabulary is not a draft target: a sample whose scored tokens all
    lie outside it has nothing to score (loss 0), whatever the draft index its id might be mistaken for."""
    model = tiny()
    settings = Settings("medusa", vocab=4)
    net = new_net("medusa", model.backend, torch.tensor([1, 2, 3, 4]), settings)
    outside = data_module.Sample([1, 2, 50, 60, 70, 80, 90], 2, torch.randn(7, 64))
    inside = data_module.Sample([1, 2, 3, 4, 1, 2, 3], 2, torch.randn(7, 64))
    assert mean_loss(net, [outside], model.backend, settings) == 0
    assert mean_loss(net, [inside], model.backend, settings) > 0


@pytest.mark.parametrize("change, message", [
    ({"minutes": 0}, "--minutes must be positive"),
    ({"minutes": float("nan")}, "--minutes must be positive"),
    ({"seed": -1}, "--seed must be in [0, 18446744073709551615], got -1"),
    ({"seed": 2**64}, "--seed must be in [0, 18446744073709551615], got 18446744073709551616"),
    ({"kind": "medusa", "heads": 64}, "--heads must be at most 63, got 64"),
    ({"kind": "lookahead"}, "--kind must be one of eagle, medusa, hydra, got 'lookahead'"),
    ({"kind": "medusa", "unroll": 2}, "--unroll applies to --kind eagle"),
    ({"kind": "hydra", "unroll": 2}, "--unroll applies to --kind eagle"),
    ({"unroll": 64}, "--unroll must be at most 63, got 64"),  # (300 was killed for memory)
])
def test_training_settings_out_of_range_are_one_line(change, message):
    with pytest.raises(InvalidParameter, match=re.escape(message)):
        Settings(**{"kind": "eagle", **change})


def test_training_settings_at_their_limits_are_taken():
    """The largest seed torch's generators take, and as many heads as a verification pass can check."""
    assert Settings("eagle", seed=2**64 - 1).seed == 2**64 - 1 and Settings("medusa", heads=63).heads == 63


def test_held_aside_conversations_are_not_trained_on():
    corpus = Corpus([data_module.Sample([i], 0, torch.zeros(1, 4), f"q{i}") for i in range(5)])
    training, held = split(corpus, 2)
    assert [s.query for s in held] == ["q3", "q4"] and len(training) == 3
    assert len(split(corpus, 10)[0]) == 1  # always something to train on
    alone = Corpus(corpus.samples[:1])
    assert split(alone, 8) == (alone.samples, [])  # even when that leaves nothing aside


# The benchmark questions never reach the training data ------------------------------------------------------


def test_benchmark_questions_are_dropped_and_checked(monkeypatch):
    exclusion = Exclusion()
    question = data_module.benchmark_questions()[0]
    assert exclusion.overlaps(question)
    assert exclusion.overlaps("Please: " + question.upper() + " Thanks.")  # a question inside a longer query
    assert not exclusion.overlaps("a question nobody benchmarks on, about pumpkins")
    queries = iter([[question, "a fresh question about the weather", "a fresh question about the weather"]] + [[]] * 1000)
    monkeypatch.setattr(data_module, "draft_queries", lambda *args, **kwargs: next(queries))
    model = tiny()
    corpus = self_distil(model.backend, model.tokenizer, 10_000, max_new_tokens=8, rows=4)
    assert [s.query for s in corpus.samples] == ["a fresh question about the weather"]  # the benchmark one and the repeat dropped
    corpus.samples.append(data_module.Sample([1], 0, torch.zeros(1, 4), question))
    with pytest.raises(AssertionError, match="overlap the benchmark"):
        check_excluded(corpus, exclusion)


def test_every_eight_word_run_of_a_question_is_excluded_the_last_one_too():
    """A query that quotes any 8 consecutive words of a benchmark question overlaps it, the question's
    last 8 words included; 7 of them do not."""
    words = "one two three four five six seven eight nine ten".split()
    exclusion = Exclusion([" ".join(words)])
    assert exclusion.overlaps(" ".join(words[2:]))  # the last run
    assert exclusion.overlaps("so " + " ".join(words[:8]) + " then")  # the first, inside a longer query
    assert not exclusion.overlaps(" ".join(words[3:]))  # seven words


def kept_queries(monkeypatch, drafted: list[str]) -> list[str]:
    """The queries a corpus keeps when the model drafts ``drafted`` in its first round, then nothing."""
    queries = iter([drafted] + [[]] * 1000)
    monkeypatch.setattr(data_module, "draft_queries", lambda *args, **kwargs: next(queries))
    model = tiny()
    corpus = self_distil(model.backend, model.tokenizer, 10_000, max_new_tokens=4, rows=4, exclusion=Exclusion([]))
    return [s.query for s in corpus.samples]


def test_queries_of_fewer_than_three_words_are_dropped(monkeypatch):
    """A query needs three words to be one; three are enough."""
    assert kept_queries(monkeypatch, ["just two", "now three words", "one"]) == ["now three words"]


def answer_jobs(monkeypatch, model, rounds: list[list[str]], **options) -> list[tuple]:
    """The (query, temperature, seed) answer jobs ``self_distil`` gives out when the model drafts the
    queries of ``rounds`` one round after another (answers are not decoded)."""
    queries = iter(rounds + [[]] * 1000)
    monkeypatch.setattr(data_module, "draft_queries", lambda *args, **kwargs: next(queries))
    jobs = []

    def answered(backend, tokenizer, given, max_new_tokens, concurrency):
        jobs.extend(given)
        return [data_module.Sample([1, 2], 0, torch.zeros(2, 4), query) for query, _, _ in given]

    monkeypatch.setattr(data_module, "answer_all", answered)
    self_distil(model.backend, model.tokenizer, 10_000, exclusion=Exclusion([]), **options)
    return jobs


def test_every_fourth_answer_is_sampled_and_the_others_are_greedy(monkeypatch):
    """``sampled_every=4``: answers 3, 7, ... (0-based) are sampled at temperature 1, the rest greedy."""
    jobs = answer_jobs(monkeypatch, tiny(), [[f"fresh question number {i}" for i in range(8)]], rows=8, sampled_every=4)
    assert [temperature for _, temperature, _ in jobs] == [0.0, 0.0, 0.0, 1.0] * 2


def test_a_model_that_drafts_no_query_stops_soon_in_one_line_and_caches_no_data(monkeypatch, tmp_path):
    """A pretrained model with no chat template never ends a Magpie query: self-distillation
    stops after a few barren rounds (it spent fifty, minutes on a real model) and says why, and no
    empty corpus is saved for the next run to fail on."""
    from decodekit.speculative.trained import cli

    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    asked = []
    monkeypatch.setattr(data_module, "draft_queries", lambda *args, **kwargs: asked.append(1) or [])
    model = tiny()
    with pytest.raises(InvalidParameter, match="no usable query in 5 drafting rounds: it has no chat template.*--prompts tasks"):
        self_distil(model.backend, model.tokenizer, 300, max_new_tokens=4, rows=2)
    assert len(asked) == data_module.FIRST_BARREN_ROUNDS
    args = train_args(kind="medusa", tokens=400, prompts="magpie", minutes=1, steps=40, vocab=64, seed=0,
                              eval_queries=2, unroll=1, max_new_tokens=16, out=None)
    with pytest.raises(InvalidParameter, match="no usable query"):
        cli.run(args, model=model)
    assert not list((tmp_path / "drafters").glob("*-data*.pt"))


def test_magpie_queries_come_from_the_pre_query_template():
    model = tiny()
    queries = data_module.draft_queries(model.backend, model.tokenizer, rows=6, max_tokens=400,
                                        generator=torch.Generator().manual_seed(0))
    assert queries and all(isinstance(q, str) for q in queries)


def test_task_prompts_open_every_other_drafting_round_with_the_materials_budget(monkeypatch):
    openings = data_module.TASK_OPENINGS
    assert [data_module.opening_of_round("magpie", r) for r in range(6)] == [""] * 6
    rounds = [data_module.opening_of_round("tasks", r) for r in range(2 * len(openings) + 2)]
    assert rounds[0::2] == [""] * (len(openings) + 1) and rounds[1::2] == [*openings, openings[0]]
    asked = []

    def drafted(backend, tokenizer, rows, max_tokens, generator, opening=""):
        asked.append((opening, max_tokens))
        return [f"{opening}material number {len(asked)} is here"]

    monkeypatch.setattr(data_module, "draft_queries", drafted)
    model = tiny()
    corpus = self_distil(model.backend, model.tokenizer, 300, max_new_tokens=4, rows=2, wave=1, query_tokens=7,
                         material_tokens=11, prompts="tasks")
    assert asked[:4] == [("", 7), (openings[0], 11), ("", 7), (openings[1], 11)]
    assert [s.query for s in corpus.samples[:2]] == ["material number 1 is here", f"{openings[0]}material number 2 is here"]
    with pytest.raises(InvalidParameter, match="--prompts must be one of magpie, tasks"):
        self_distil(model.backend, model.tokenizer, 10, prompts="books")
    with pytest.raises(InvalidParameter, match="--prompts must be one of magpie, tasks, got 'books'"):
        Settings("eagle", prompts="books")  # said before a model is loaded


def test_a_material_starts_with_its_opening_and_one_not_ended_is_cut_after_its_last_full_line():
    model = tiny()
    prefixes, prefill = [], model.backend.prefill
    model.backend.prefill = lambda ids, **kwargs: prefixes.append(list(ids)) or prefill(ids, **kwargs)
    queries = data_module.draft_queries(model.backend, model.tokenizer, rows=6, max_tokens=300,
                                        generator=torch.Generator().manual_seed(0), opening="Sum up:  ")
    assert queries and all(q.startswith("Sum up:  ") and len(q) > len("Sum up:  ") for q in queries)
    assert prefixes[0][-9:] == model.tokenizer.encode("Sum up:  ")  # the target writes after the opening
    assert data_module._cut_after_last_line("first line\nsecond line\nhalf a li") == "first line\nsecond line"
    assert data_module._cut_after_last_line("no full line yet") == ""
    assert data_module._cut_after_last_line("\n  \nhalf") == ""



class _LineTokenizer(CharTokenizer):
    """Characters, with "|" read as a line break (CharTokenizer has none)."""

    def decode(self, ids):
        return super().decode(ids).replace("|", "\n")


class _ScriptedRows:
    """A batch backend whose row r writes ``texts[r]`` (then end-of-sequence), one token a pass: the
    sampled token is certain (every other logit at -1e9)."""

    def __init__(self, tokenizer, texts: list[str | list[int]], vocab: int = 96):
        self.scripts = [t if isinstance(t, list) else tokenizer.encode(t) for t in texts]
        self.vocab, self.t = vocab, 0

    def _logits(self) -> torch.Tensor:
        logits = torch.full((len(self.scripts), self.vocab), -1e9)
        for r, script in enumerate(self.scripts):
            logits[r, script[self.t] if self.t < len(script) else 0] = 0.0
        return logits

    def prefill(self, ids, batch_size=1):
        assert batch_size == len(self.scripts)
        self.t = 0
        return self._logits()

    def append(self, tokens):
        from types import SimpleNamespace

        self.t += 1
        return SimpleNamespace(logits=self._logits()[:, None])


def test_a_magpie_query_is_what_the_target_wrote_up_to_its_end_and_only_an_ended_one_is_kept():
    """Without an opening only the queries the target ended within ``max_tokens`` are kept, each up to
    its end-of-sequence token (what a row samples after it is not part of it)."""
    tok = CharTokenizer(96)
    ended_then_more = tok.encode("what is a cat") + [0] + tok.encode("zzz")
    backend = _ScriptedRows(tok, [ended_then_more, "this one never ends at all", "how do owls fly"])
    queries = data_module.draft_queries(backend, tok, rows=3, max_tokens=20, generator=torch.Generator().manual_seed(0))
    assert queries == ["what is a cat", "how do owls fly"]


def test_an_ended_material_is_kept_whole_and_one_not_ended_cut_after_its_last_full_line():
    """With an opening, a material the target ended is kept as written; one not ended within
    ``max_tokens`` is cut after its last full line."""
    tok = _LineTokenizer(96)
    backend = _ScriptedRows(tok, ["line one|line two", "first|second|half a li"])
    queries = data_module.draft_queries(backend, tok, rows=2, max_tokens=22, generator=torch.Generator().manual_seed(0),
                                        opening="Sum up: ")
    assert queries == ["Sum up: line one\nline two", "Sum up: first\nsecond"]



def test_an_answer_runs_max_new_tokens_with_a_feature_at_every_position():
    """The target answers up to ``max_new_tokens`` tokens (fewer only where it ends), and each
    position of the sample has its feature."""
    model = tiny()
    ids, _ = data_module.chat_ids(model.tokenizer, "hello world")
    sample = answer(model.backend, model.tokenizer, "hello world", 6)
    generated = sample.tokens[len(ids):]
    assert sample.tokens[:len(ids)] == ids
    assert len(generated) == 6 or (generated[-1] in model.tokenizer.eos_token_ids and len(generated) < 6)
    assert sample.features.shape == (len(sample.tokens), model.backend.info.hidden_size)


class _TemplateTokenizer(CharTokenizer):
    """A chat template "<u>CONTENT</u>": the pre-query template is "<u>"."""

    def chat_prompt(self, messages, **kwargs):
        return "".join(f"<u>{m['content']}</u>" for m in messages)


def test_the_pre_query_template_is_the_chat_template_up_to_the_user_turns_content():
    """Magpie's pre-query template: the templated text before the empty user turn's content, not after it."""
    tok = _TemplateTokenizer(96)
    assert data_module.pre_query(tok) == tok.encode("<u>")
    ids, start = data_module.chat_ids(tok, "hi there")
    assert ids == tok.encode("<u>hi there</u>") and start == 3


def test_drafting_goes_on_while_fresh_queries_come_now_and_then(monkeypatch):
    """Only barren rounds *in a row* stop self-distillation: a model that gives a fresh query every
    other round is drafted from until the samples hold the tokens asked for."""
    rounds = []

    def drafted(*args, **kwargs):
        rounds.append(1)
        return [f"fresh question number {len(rounds)}"] if len(rounds) % 2 else []

    monkeypatch.setattr(data_module, "draft_queries", drafted)
    monkeypatch.setattr(data_module, "answer_all", lambda backend, tokenizer, given, max_new_tokens, concurrency: [
        data_module.Sample([1, 2], 0, torch.zeros(2, 4), query) for query, _, _ in given])
    model = tiny()
    corpus = self_distil(model.backend, model.tokenizer, 2 * 40, rows=1, wave=1, exclusion=Exclusion([]))
    assert len(corpus.samples) == 40 and len(rounds) > data_module.BARREN_ROUNDS


def test_the_corpus_stops_at_the_tokens_asked_for(monkeypatch):
    """Answers are added until the samples hold ``tokens`` tokens: the rest of a wave is not kept."""
    queries = iter([[f"fresh question number {i}" for i in range(8)]] + [[]] * 1000)
    monkeypatch.setattr(data_module, "draft_queries", lambda *args, **kwargs: next(queries))
    monkeypatch.setattr(data_module, "answer_all", lambda backend, tokenizer, given, max_new_tokens, concurrency: [
        data_module.Sample([1, 2], 0, torch.zeros(2, 4), query) for query, _, _ in given])
    model = tiny()
    corpus = self_distil(model.backend, model.tokenizer, 5, rows=8, exclusion=Exclusion([]))
    assert corpus.tokens == 6 and len(corpus.samples) == 3  # 2 + 2 < 5 tokens: a third; then 6 >= 5


def test_every_benchmark_question_is_excluded_every_spec_bench_turn_and_every_gsm8k_problem():
    """The shipped files read on their own: each turn of each Spec-Bench question (not only the
    first) and each GSM8K problem overlaps the default exclusion."""
    from decodekit.data import GSM8K_TEST, SPEC_BENCH_QUESTIONS, data_file, read_jsonl

    exclusion = Exclusion()
    turns = [turn for _, row in read_jsonl(data_file(SPEC_BENCH_QUESTIONS)) for turn in row["turns"]]
    problems = [row["question"] for _, row in read_jsonl(data_file(GSM8K_TEST))]
    assert len(turns) > 240 and problems  # second turns there too
    assert [t for t in turns if not exclusion.overlaps(t)] == []
    assert [p for p in problems if not exclusion.overlaps(p)] == []


def test_a_query_that_differs_from_a_question_only_in_case_and_punctuation_is_excluded():
    """Words are compared, not spelling: case and punctuation do not hide a question; the questions
    may come as any iterable (a generator too), read for the whole texts and the 8-word runs alike."""
    exclusion = Exclusion(q for q in ["What is the capital of France?", "one two three four five six seven eight nine, ten."])
    assert exclusion.overlaps("what is the capital of france")
    assert exclusion.overlaps("WHAT IS THE CAPITAL OF FRANCE !!")
    assert exclusion.overlaps("Quote: one two three four five six seven eight")  # an 8-word run
    assert exclusion.overlaps("three four five six seven eight nine ten")  # the last run, across the comma
    assert not exclusion.overlaps("what is the capital of spain")


def test_queries_that_differ_only_in_case_and_punctuation_are_one_query(monkeypatch):
    """De-duplication compares the normalised text: the first spelling is kept, the others dropped."""
    spellings = ["What is the weather today?", "what is the weather today", "WHAT, is the weather today!"]
    assert kept_queries(monkeypatch, spellings) == ["What is the weather today?"]


def test_sampled_answers_keep_their_turn_across_waves_and_each_has_a_seed_of_its_own(monkeypatch):
    """Every ``sampled_every``-th answer of the whole corpus is sampled, however the queries fall into
    waves; each answer's seed is its own, and another run seed gives other seeds."""
    model = tiny()

    def jobs_of(seed):
        rounds = [[f"fresh question number {i}"] for i in range(8)]  # one a round
        return answer_jobs(monkeypatch, model, rounds, rows=1, wave=3, sampled_every=4, seed=seed)

    jobs = jobs_of(0)
    assert [query for query, _, _ in jobs] == [f"fresh question number {i}" for i in range(8)]
    assert [temperature for _, temperature, _ in jobs] == [0.0, 0.0, 0.0, 1.0] * 2  # waves of 3, 3 and 2
    seeds = [seed for _, _, seed in jobs]
    assert len(set(seeds)) == len(seeds)
    assert [seed for _, _, seed in jobs_of(1)] != seeds


def test_answers_made_side_by_side_are_each_the_answer_made_alone():
    """answer_all: each job's answer (tokens and features) is :func:`answer`'s for the same query,
    temperature and seed, in the jobs' order."""
    model = tiny()
    jobs = [("hello world", 0.0, 5), ("the cat sat", 1.0, 11), ("the cat sat", 1.0, 13), ("xyz xyz", 1.0, 12)]
    got = data_module.answer_all(model.backend, model.tokenizer, jobs, 12, concurrency=3)
    assert [s.query for s in got] == [query for query, _, _ in jobs]
    for sample, (query, temperature, seed) in zip(got, jobs):
        alone = answer(model.backend, model.tokenizer, query, 12, temperature,
                       torch.Generator().manual_seed(seed) if temperature > 0 else None)
        assert sample.tokens == alone.tokens and sample.scored_from == alone.scored_from
        assert torch.equal(sample.features, alone.features)
    assert got[1].tokens != got[2].tokens  # two seeds, two samples of one query


def test_an_answer_that_fails_side_by_side_fails_answer_all(monkeypatch):
    """An error in one of the answers made side by side is raised on the caller, never a corpus quietly short of it."""
    model = tiny()
    real = data_module.answer

    def failing(backend, tokenizer, query, *args):
        if query == "bad query":
            raise ValueError("the pass failed")
        return real(backend, tokenizer, query, *args)

    monkeypatch.setattr(data_module, "answer", failing)
    jobs = [("hello world", 0.0, 0), ("bad query", 0.0, 1), ("the cat sat", 0.0, 2)]
    with pytest.raises(ValueError, match="the pass failed"):
        data_module.answer_all(model.backend, model.tokenizer, jobs, 4, concurrency=2)


def test_a_saved_corpus_loads_as_it_was_and_a_damaged_or_half_written_one_is_made_again(tmp_path, monkeypatch):
    """save_corpus/load_corpus round-trip; a save that fails midway leaves the last whole corpus in
    place; a damaged file or none loads as None (the data is made again), never a traceback."""
    model = tiny()
    corpus = corpus_of(model, tokens=6, count=3)
    corpus.queries_drafted, corpus.seconds = 7, 1.5
    path = tmp_path / "drafters" / "tiny-data.pt"
    data_module.save_corpus(corpus, path)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    loaded = data_module.load_corpus(path)
    assert (loaded.queries_drafted, loaded.seconds, loaded.tokens) == (7, 1.5, corpus.tokens)
    for a, b in zip(loaded.samples, corpus.samples, strict=True):
        assert (a.tokens, a.scored_from, a.query) == (b.tokens, b.scored_from, b.query)
        assert torch.equal(a.features, b.features)

    def half_written(obj, file):
        open(file, "wb").write(b"half a corpus")
        raise OSError("No space left on device")

    monkeypatch.setattr(data_module.torch, "save", half_written)
    with pytest.raises(OSError, match="No space"):
        data_module.save_corpus(Corpus(), path)
    monkeypatch.undo()
    assert data_module.load_corpus(path).queries_drafted == 7
    whole = path.read_bytes()
    for damaged in (whole[: len(whole) // 2], b"not a corpus", b""):
        path.write_bytes(damaged)
        assert data_module.load_corpus(path) is None
    assert data_module.load_corpus(tmp_path / "none.pt") is None


# Drafter files ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_drafter_for_another_model_is_refused(drafter_files, kind):
    other = tiny(seed=1)
    other.backend.info = dataclasses.replace(other.backend.info, name="other-llama")
    with pytest.raises(InvalidParameter, match=r"trained for another model \(tiny-llama\), not other-llama"):
        store.load(other.backend, kind, drafter_files[kind, "exact"])
    assert store.load(tiny().backend, kind, drafter_files[kind, "exact"]) is not None


def test_a_drafter_given_as_a_folder_is_refused_in_the_file_options_words(tmp_path):
    """Not safetensors' "No such device (os error 19)": the words of the CLI's file options."""
    with pytest.raises(InvalidParameter, match=r"^drafter '.*' is a folder: give a file$") as err:
        store.load(tiny().backend, "eagle", tmp_path)
    assert err.value.param == "drafter"


def test_damaged_and_wrong_drafter_files_are_one_line(drafter_files, tmp_path):
    backend = tiny().backend
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(drafter_files["eagle", "exact"].read_bytes()[:100])
    with pytest.raises(InvalidModel, match="cannot be read as a drafter"):
        store.load(backend, "eagle", broken)
    flipped = bytearray(drafter_files["eagle", "exact"].read_bytes())
    flipped[-5] ^= 0x40  # one bit of the last weight
    broken.write_bytes(bytes(flipped))
    with pytest.raises(InvalidModel, match="damaged"):
        store.load(backend, "eagle", broken)
    with pytest.raises(InvalidParameter, match="holds a medusa drafter, not a eagle"):
        store.load(backend, "eagle", drafter_files["medusa", "exact"])
    with pytest.raises(InvalidParameter, match="not found"):
        store.load(backend, "eagle", tmp_path / "missing.safetensors")
    # the digest written again over a head whose token ids are not ids: refused in one line too
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(drafter_files["eagle", "exact"]), framework="pt") as handle:
        meta, tensors = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}
    ids = tensors["head.vocab"]
    # not ids, none, or an id twice (it would be proposed twice among siblings)
    for vocab in (torch.cat([torch.tensor([-5]), ids[1:]]), ids[:0], torch.cat([ids[:1], ids[:-1]])):
        crafted = {**tensors, "head.vocab": vocab.contiguous()}
        save_file(crafted, str(broken), metadata={**meta, "digest": store.drafter_digest(crafted, meta)})
        with pytest.raises(InvalidModel, match="head.vocab is not a list of distinct token ids"):
            store.load(backend, "eagle", broken)
    # weights that are not finite, or not stored as a drafter's are; a config that cannot be a network's
    name = next(n for n, t in tensors.items() if t.is_floating_point())
    for weights in (torch.full_like(tensors[name], float("nan")), tensors[name].double(), tensors[name].to(torch.int8)):
        crafted = {**tensors, name: weights.contiguous()}
        save_file(crafted, str(broken), metadata={**meta, "digest": store.drafter_digest(crafted, meta)})
        with pytest.raises(InvalidModel, match=f"{re.escape(name)} must hold finite float16"):
            store.load(backend, "eagle", broken)
    # (each under the digest a save would write: the config's own checks, behind the digest's)
    config = json.loads(meta["config"])
    for change, problem in (({"heads": 0}, "heads must be a positive integer"),
                            ({"rope_theta": float("nan")}, "rope_theta must be a positive number"),
                            # an odd head size (the rotary embedding turns pairs of values)
                            ({"heads": config["heads"] * config["head_dim"], "head_dim": 1}, "head_dim must be even"),
                            ({"eps": -1}, "eps must be a positive number"),
                            ({"intermediate": 7}, "size mismatch for"),  # the weights' shapes say otherwise
                            # sizes a damaged config could ask for: refused before anything is allocated
                            ({"intermediate": 10**12}, "its config asks for [0-9]+ weights, more than the file holds")):
        edited = {**meta, "config": json.dumps({**config, **change})}
        save_file(tensors, str(broken), metadata={**edited, "digest": store.drafter_digest(tensors, edited)})
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # one line: no torch warning before it
            with pytest.raises(InvalidModel, match=problem):
                store.load(backend, "eagle", broken)


def test_a_drafter_whose_token_ids_reach_past_the_targets_vocabulary_is_refused(drafter_files, tmp_path):
    """Draft token ids index the target's vocabulary: vocab_size - 1 is the last there is, vocab_size is not."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    backend = tiny().backend
    with safe_open(str(drafter_files["eagle", "exact"]), framework="pt") as handle:
        meta, tensors = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}
    crafted_path = tmp_path / "crafted.safetensors"
    for last, fits in ((backend.info.vocab_size - 1, True), (backend.info.vocab_size, False)):
        vocab = tensors["head.vocab"].clone()
        vocab[-1] = last
        crafted = {**tensors, "head.vocab": vocab}
        save_file(crafted, str(crafted_path), metadata={**meta, "digest": store.drafter_digest(crafted, meta)})
        if fits:
            assert store.build(crafted_path, "eagle", backend) is not None
        else:
            with pytest.raises(InvalidParameter, match="does not fit"):
                store.build(crafted_path, "eagle", backend)


def test_a_model_made_in_memory_is_fingerprinted_by_its_sizes_too():
    """Without weight files the fingerprint read the output head alone: a model and a truncated copy
    sharing it (one layer less) took each other's drafters."""
    assert store.target_fingerprint(tiny_llama(seed=0, num_layers=2)) != store.target_fingerprint(tiny_llama(seed=0, num_layers=1))
    assert store.target_fingerprint(tiny_llama(seed=0)) == store.target_fingerprint(tiny_llama(seed=0))


def test_the_loss_a_test_compares_is_eagles_without_its_training_noise():
    """mean_loss measures, it does not train: EAGLE's inputs carry no noise there (three calls on one
    net gave three losses, and drew from the global random state)."""
    model = tiny()
    settings = Settings("eagle", minutes=1, steps=1, vocab=64, batch_tokens=256)
    samples = corpus_of(model).samples[:4]
    net = new_net("eagle", model.backend, draft_vocabulary(samples, settings.vocab, 96), settings)
    assert len({mean_loss(net, samples, model.backend, settings) for _ in range(3)}) == 1


def test_the_target_fingerprint_covers_every_weights_file(tmp_path, monkeypatch):
    """A model in several weight files (shards) is another model when any one of them differs."""
    import types

    real_digest = store.file_digest

    files = {}
    for name, body in (("a", b"first shard"), ("b", b"second shard"), ("c", b"another second shard")):
        files[name] = tmp_path / f"{name}.safetensors"
        files[name].write_bytes(body)

    def fingerprint(*names: str) -> str:
        backend = types.SimpleNamespace(weights_files=[str(files[n]) for n in names],
                                        memory=lambda key, compute: compute())
        return store.target_fingerprint(backend)

    assert fingerprint("a", "b") == fingerprint("a", "b")
    assert fingerprint("a", "b") != fingerprint("a", "c")
    assert fingerprint("a", "b") != fingerprint("b", "a")  # the files in order
    # each file is read once as it stands (a server's slots ask one after another), again once rewritten
    read = []
    monkeypatch.setattr(store, "file_digest", lambda path: read.append(path.name) or real_digest(path))
    before = fingerprint("a", "c")
    assert fingerprint("a", "c") == before and read == []
    files["c"].write_bytes(b"a second shard, rewritten")
    assert fingerprint("a", "c") != before and read == ["a.safetensors", "c.safetensors"]


def test_without_a_drafter_the_message_says_how_to_train_one(monkeypatch, tmp_path):
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    model = tiny()
    with pytest.raises(InvalidParameter, match="decodekit train-drafter --kind medusa"):
        run(model, SpeculativeMethod(DRAFTER_SPECS["medusa"].factory(), Controller(8, budget=4)), [1, 2, 3])


def test_train_drafter_saves_in_the_cache_and_the_method_finds_it(monkeypatch, tmp_path, capsys):
    from decodekit.speculative.trained import cli

    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    queries = iter([[f"query number {i} about things" for i in range(4)] for _ in range(200)])
    monkeypatch.setattr(data_module, "draft_queries", lambda *args, **kwargs: next(queries))
    model = tiny()
    args = train_args(kind="medusa", tokens=400, prompts="magpie", minutes=1, steps=40, vocab=64, seed=0, eval_queries=2, unroll=1,
                              max_new_tokens=16, out=None)
    assert cli.run(args, model=model) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["evaluation"]["identical_to_greedy"] == "2/2"
    assert record["data_tokens"] >= 400 and record["train_steps"] > 0
    saved = store.cache_path(model.backend, "medusa")
    feature = torch.randn(1, model.backend.info.hidden_size, generator=torch.Generator().manual_seed(0))

    def drafts(net) -> torch.Tensor:  # (the weights live in the kernels' closures: compared by what they compute)
        return net(feature)

    assert torch.equal(drafts(store.load(model.backend, "medusa")), drafts(store.build(saved, "medusa", model.backend)))
    first = drafts(store.load(model.backend, "medusa"))
    args.steps = 80  # trained again into the same file, in the same process: the new drafter is the one used
    assert cli.run(args, model=model) == 0  # the data is made once, then reused
    assert json.loads(capsys.readouterr().out)["data_seconds"] == record["data_seconds"]
    again = drafts(store.load(model.backend, "medusa"))
    assert not torch.equal(first, again) and torch.equal(again, drafts(store.build(saved, "medusa", model.backend)))
    # cached data with a benchmark question in it (an earlier version's, or edited) is made again
    data_path = next((tmp_path / "drafters").glob("*-data*.pt"))
    corpus = data_module.load_corpus(data_path)
    corpus.samples[0].query = data_module.benchmark_questions()[0]
    data_module.save_corpus(corpus, data_path)
    assert cli.run(args, model=model) == 0
    assert not data_module.leaked(data_module.load_corpus(data_path), Exclusion())
    args.prompts = "tasks"  # another recipe: data of its own, not the Magpie data again
    assert cli.run(args, model=model) == 0
    numerics = model.backend.numerics  # and the data of one numerics is not the other's
    made = sorted(path.name.split("-data")[1] for path in (tmp_path / "drafters").glob("*-data*.pt"))
    assert made == [f"-{numerics}-400-s0.pt", f"-tasks-{numerics}-400-s0.pt"]


def test_train_drafter_refuses_a_model_it_cannot_train_on_before_making_data(monkeypatch, tmp_path, capsys):
    """A backend without features, or a cache of one sequence (training decodes many answers side by
    side), is one line before any data is made, not after the first minutes of it."""
    from decodekit.models.kv_policy import parse_kv_cache
    from decodekit.speculative.trained import cli

    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(cli, "self_distil", lambda *args, **kwargs: pytest.fail("data was made"))
    args = train_args(kind="eagle", tokens=400, prompts="magpie", minutes=1, steps=4, vocab=64, seed=0, eval_queries=2, unroll=1,
                              max_new_tokens=16, out=None)
    for change, message in ((("gives_features", False), "needs a backend that gives features"),
                            (("kv_policy", parse_kv_cache("int8")), "needs the full kv cache, not int8")):
        model = tiny()
        setattr(model.backend, *change)
        with pytest.raises(InvalidParameter, match=message):
            cli.run(args, model=model)
    # answers that cannot fit, and a folder where the drafter's file would be saved
    with pytest.raises(InvalidParameter, match="--max-new-tokens 100000000 leaves no room"):
        cli.run(argparse.Namespace(**{**vars(args), "max_new_tokens": 10**8}), model=tiny())
    store.cache_path(tiny().backend, "eagle").mkdir(parents=True)
    with pytest.raises(InvalidParameter, match="is a folder: the drafter's file cannot be saved there"):
        cli.run(args, model=tiny())
    assert "self-distilling" not in capsys.readouterr().err


def test_train_drafter_refuses_a_vocabulary_past_the_models_and_answers_as_long_as_its_context(monkeypatch, tmp_path):
    """Both said before any data is made: a draft vocabulary of more tokens than the model has, and
    evaluation answers that fill the whole context (no room for the query)."""
    from decodekit.speculative.trained import cli

    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(cli, "self_distil", lambda *args, **kwargs: pytest.fail("data was made"))
    args = train_args(kind="eagle", tokens=400, prompts="magpie", minutes=1, steps=4, vocab=97, seed=0, eval_queries=2,
                              unroll=1, max_new_tokens=16, out=None)
    with pytest.raises(InvalidParameter, match="--vocab 97 is more than the model's 96 tokens"):
        cli.run(args, model=tiny())
    model = tiny()
    context = model.backend.info.max_length
    with pytest.raises(InvalidParameter, match=f"--max-new-tokens {context} leaves no room"):
        cli.run(argparse.Namespace(**{**vars(args), "vocab": 96, "max_new_tokens": context}), model=model)


def test_train_drafter_learns_its_vocabulary_on_the_training_part_and_evaluates_on_the_held_aside(monkeypatch, tmp_path,
                                                                                                   capsys):
    """The held-aside conversations are the evaluation's queries and take no part in training, not even
    in choosing the draft vocabulary (their tokens would be counted)."""
    from decodekit.speculative.trained import cli

    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    samples = [data_module.Sample([10 + i] * 6, 0, torch.zeros(6, 64), f"q{i}") for i in range(5)]
    monkeypatch.setattr(cli, "self_distil", lambda *args, **kwargs: Corpus(list(samples)))
    vocab_samples, queries = [], []

    def vocabulary(training, size, vocab_size):
        vocab_samples.extend(training)
        return draft_vocabulary(training, size, vocab_size)

    monkeypatch.setattr(cli, "draft_vocabulary", vocabulary)
    monkeypatch.setattr(cli, "evaluate", lambda model, kind, path, asked, n: queries.extend(asked) or {})
    args = train_args(kind="medusa", tokens=30, prompts="magpie", minutes=1, steps=2, vocab=8, seed=0, eval_queries=2,
                              unroll=1, max_new_tokens=8, out=None)
    assert cli.run(args, model=tiny()) == 0
    assert [s.query for s in vocab_samples] == ["q0", "q1", "q2"] and queries == ["q3", "q4"]
    assert json.loads(capsys.readouterr().out)["conversations"] == 5


def test_train_drafter_options_reach_the_data_the_training_the_file_and_the_evaluation(monkeypatch, tmp_path, capsys):
    """Every option of train-drafter is used: --seed, --prompts and --tokens make the data, --unroll,
    --steps, --vocab and --seed train (and are recorded), --out is where the drafter is saved and what
    the evaluation reads, --max-new-tokens the evaluation's answer length."""
    from decodekit.speculative.trained import cli

    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))
    samples = [data_module.Sample([10 + i] * 6, 0, torch.zeros(6, 64), f"q{i}") for i in range(5)]
    distilled, evaluated = [], []

    def distil(backend, tokenizer, tokens, **kwargs):
        distilled.append({"tokens": tokens, "seed": kwargs.get("seed", 0), "prompts": kwargs.get("prompts", "magpie")})
        return Corpus(list(samples))

    monkeypatch.setattr(cli, "self_distil", distil)
    monkeypatch.setattr(cli, "evaluate", lambda model, kind, path, asked, n: evaluated.append((kind, path, asked, n)) or {})
    out = tmp_path / "mine" / "drafter.safetensors"
    out.parent.mkdir()
    args = train_args(kind="eagle", tokens=30, prompts="tasks", minutes=0.02, steps=2, vocab=8, seed=3, eval_queries=2,
                              unroll=2, max_new_tokens=7, out=out)
    model = tiny()
    assert cli.run(args, model=model) == 0
    record = json.loads(capsys.readouterr().out)
    assert distilled == [{"tokens": 30, "seed": 3, "prompts": "tasks"}]
    assert {k: record["settings"][k] for k in ("kind", "tokens", "prompts", "steps", "vocab", "seed", "held_out", "unroll")} == {
        "kind": "eagle", "tokens": 30, "prompts": "tasks", "steps": 2, "vocab": 8, "seed": 3, "held_out": 2, "unroll": 2}
    assert record["train_steps"] == 2
    assert record["drafter"] == str(out) and out.is_file() and not store.cache_path(model.backend, "eagle").exists()
    assert evaluated == [("eagle", out, ["q3", "q4"], 7)]
    # --heads: Medusa's and Hydra's, in the file's network
    assert cli.run(train_args(kind="hydra", tokens=30, steps=1, vocab=8, eval_queries=2, heads=2, out=out),
                   model=model) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["heads"] == 2 and store.load(model.backend, "hydra", out).config.heads == 2


def test_heads_default_per_kind_and_settings_without_a_flag_are_named_as_fields():
    assert (Settings("medusa").heads, Settings("hydra").heads, Settings("eagle").heads) == (4, 3, None)
    assert Settings("medusa", heads=2).heads == 2
    with pytest.raises(InvalidParameter, match="--heads applies to --kind medusa or hydra"):
        Settings("eagle", heads=2)
    with pytest.raises(InvalidParameter, match="^batch_tokens must be at least 1, got 0$"):  # no flag: the field's name
        Settings("eagle", batch_tokens=0)


def test_the_evaluation_decodes_both_answers_to_the_length_asked(monkeypatch):
    """Plain greedy and the drafter's answer are each max_new_tokens long at most: compared at
    different lengths they could never be identical."""
    from types import SimpleNamespace

    from decodekit.engine import api
    from decodekit.speculative.trained.cli import evaluate

    asked = []

    class Recorded:
        def __init__(self, model):
            pass

        def generate(self, query, method, **kwargs):
            asked.append((method, kwargs.get("max_new_tokens")))
            return SimpleNamespace(tokens=[1, 2], stats=SimpleNamespace(extra={"verifications": 1, "accepted": 1}))

    monkeypatch.setattr(api, "Engine", Recorded)
    evaluate(None, "medusa", "drafter.safetensors", ["a"], 9)
    assert sorted(asked) == [("greedy", 9), ("medusa", 9)]


def test_the_evaluation_counts_each_verifications_bonus_token_in_the_mean_accepted(monkeypatch):
    """Mean accepted tokens per verification, as the papers report it: accepted drafts plus the
    target's own token of each verification, over all the queries' verifications."""
    from types import SimpleNamespace

    from decodekit.engine import api
    from decodekit.speculative.trained.cli import evaluate

    drafted = iter([{"verifications": 4, "accepted": 6}, {"verifications": 2, "accepted": 0}])

    class Counted:
        def __init__(self, model):
            pass

        def generate(self, query, method, **kwargs):
            extra = {} if method == "greedy" else next(drafted)
            return SimpleNamespace(tokens=[1, 2] if method == "greedy" or query == "a" else [1, 3],
                                   stats=SimpleNamespace(extra=extra))

    monkeypatch.setattr(api, "Engine", Counted)
    got = evaluate(None, "eagle", "drafter.safetensors", ["a", "b"], 8)
    assert got == {"queries": 2, "mean_accepted": round((6 + 0 + 4 + 2) / (4 + 2), 3), "identical_to_greedy": "1/2"}


def test_an_evaluation_that_verified_nothing_reports_no_figure(drafter_files):
    from decodekit.speculative.trained.cli import evaluate

    assert evaluate(tiny(), "eagle", drafter_files["eagle", "exact"], [], 8) == {
        "queries": 0, "mean_accepted": None, "identical_to_greedy": "0/0"}


# Lossless -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("numerics", ["exact", pytest.param("fast", marks=needs_fast_numerics)])
@pytest.mark.parametrize("kind", KINDS)
def test_trained_drafters_are_token_identical_to_greedy(drafter_files, kind, numerics):
    model = tiny(numerics=numerics)
    accepted = 0
    for prompt in PROMPTS:
        plain = run(model, _plain(), prompt)
        spec = run(model, method_for(kind, drafter_files[kind, numerics]), prompt)
        assert spec.tokens == plain.tokens
        accepted += spec.stats.extra["accepted"]
    assert accepted > 0  # the drafts are verified and some accepted: the path-keeping code ran


@pytest.mark.parametrize("kind", KINDS)
def test_a_draft_vocabulary_smaller_than_the_candidates_asked_drafts_what_it_has(kind, tmp_path):
    model = tiny()
    settings = Settings(kind, minutes=1, steps=2, vocab=2, batch_tokens=256)
    samples, _ = split(corpus_of(model), 0)
    net = new_net(kind, model.backend, draft_vocabulary(samples, settings.vocab, model.backend.info.vocab_size), settings)
    train(net, samples, model.backend, settings)
    path = store.save(net, kind, model.backend, tmp_path / f"{kind}.safetensors", {})
    spec = run(model, method_for(kind, path, budget=6, candidates=8), PROMPTS[0])
    assert spec.tokens == run(model, _plain(), PROMPTS[0]).tokens


def _plain():
    from decodekit.engine.registry import PlainDecoding

    return PlainDecoding()


@pytest.mark.parametrize("kind", KINDS)
def test_a_trained_drafter_is_accepted_more_than_an_untrained_one(drafter_files, kind, tmp_path):
    """Catches drafts made from the wrong feature or position: they are still lossless, but rarely accepted."""
    model = tiny()
    untrained = new_net(kind, model.backend, store.load(model.backend, kind, drafter_files[kind, "exact"]).head.vocab,
                        Settings(kind, vocab=64))
    untrained_path = store.save(untrained, kind, model.backend, tmp_path / f"{kind}.safetensors", {})
    prompts = PROMPTS + [[12, 13, 14]]  # and one it has not seen

    def mean_accepted(path) -> float:
        stats = [run(model, method_for(kind, path, budget=4), p, n=60).stats.extra for p in prompts]
        return sum(s["accepted"] for s in stats) / sum(s["verifications"] for s in stats)

    assert mean_accepted(drafter_files[kind, "exact"]) > mean_accepted(untrained_path) + 0.3


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_with_a_trained_drafter_is_plain_sampling(drafter_files, kind):
    """The keyed verifier: each seed gives plain sampling's tokens."""
    model = tiny()
    for seed in range(12):
        params = {"temperature": 1.0, "seed": seed}
        plain = run(model, _plain(), [5, 6, 7], Sampler.from_params(**params), n=20)
        spec = run(model, method_for(kind, drafter_files[kind, "exact"]), [5, 6, 7], Sampler.from_params(**params), n=20)
        assert spec.tokens == plain.tokens


SMALL_V = 8
CHI_SAMPLES = 1500


@pytest.mark.parametrize("kind", KINDS)
def test_trained_drafters_sample_the_target_distribution(kind, tmp_path):
    """Chi-square of tokens (1, 2) and (2, 3) against the exact joint distribution, with the rejection
    sampling verifier (the keyed one is checked token for token above, and the verifier's exact
    distribution on fixed trees in ``test_speculative_sampling.py``). What it can detect: 0.05 of
    probability moved between two cells of mass 0.1 (non-centrality 75 at 1,500 samples) fails
    it with power >= 0.95 at its alpha of 1e-3, for up to the 63 degrees of freedom of 64 cells."""
    model = LoadedModel(tiny_llama(seed=3, scale=1.0, vocab_size=SMALL_V, hidden_size=64), CharTokenizer(SMALL_V), "tiny8")
    backend = model.backend
    settings = Settings(kind, minutes=1, steps=100, vocab=SMALL_V, batch_tokens=256)
    samples = [answer(backend, model.tokenizer, q, 30, 1.0, torch.Generator().manual_seed(i)) for i, q in
               enumerate(["\x21\x22", "\x23", "\x24\x25\x26"])]
    net = new_net(kind, backend, torch.arange(SMALL_V), settings)
    train(net, samples, backend, settings)
    path = store.save(net, kind, backend, tmp_path / "d.safetensors", {})
    prompt = [1, 2, 3]
    sampler = Sampler.from_params(temperature=1.0)

    def after(context: list[int]) -> list[float]:
        return sampler.probs(backend.prefill(context), None)[0].tolist()

    exact: dict[tuple, float] = {}
    first = after(prompt)
    for a in range(SMALL_V):
        second = after(prompt + [a])
        for b in range(SMALL_V):
            third = after(prompt + [a, b])
            for c in range(SMALL_V):
                exact[(a, b, c)] = first[a] * second[b] * third[c]
    counts: Counter = Counter()
    # three tokens are drawn, the first from the prefill: drafts deeper than two levels go unused
    deep_enough = {"max_depth": 2} if kind == "eagle" else {}
    method = method_for(kind, path, budget=6, verifier=SamplingVerifier(), **deep_enough)
    for seed in range(CHI_SAMPLES):
        tokens = run(model, method, prompt, Sampler.from_params(temperature=1.0, seed=seed), n=3).tokens
        counts[tuple(tokens[:3])] += 1
    for positions in (slice(0, 2), slice(1, 3)):
        ok, stat, critical = chi_square_passes(Counter(marginal(counts, positions)), marginal(exact, positions), CHI_SAMPLES)
        assert ok, f"tokens {positions.start + 1}-{positions.stop}: chi-square {stat:.1f} >= {critical:.1f}"


def test_a_drafters_matrices_run_on_the_backends_kernels():
    """``Backend.matrix``: Q8_0 blocks on the native kernels (within 8-bit error of the float
    product); a shape the block kernels do not take falls back to the float product."""
    backend = tiny().backend
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(48, 64, generator=g), torch.randn(3, 64, generator=g)
    exact = x @ weight.T
    product = backend.matrix(weight)(x)
    assert product.shape == exact.shape
    assert (product - exact).abs().max() < 0.05 * exact.abs().max()
    odd = torch.randn(5, 40, generator=g)
    assert torch.allclose(backend.matrix(odd)(x[:, :40]), x[:, :40] @ odd.T)



def test_on_kernels_runs_every_linear_layer_and_the_head_through_the_matrix_and_keeps_the_biases():
    """``on_kernels``: each linear layer (bias included) and the draft head run through ``matrix(weight)``,
    and the network computes what it computed before."""
    import torch.nn.functional as F

    from decodekit.speculative.trained.networks import MedusaConfig, MedusaNet, on_kernels

    g = torch.Generator().manual_seed(0)
    net = MedusaNet(MedusaConfig(hidden=8, heads=2), torch.arange(5))
    net.head.attach(torch.randn(5, 8, generator=g))
    with torch.no_grad():
        for block in net.blocks:
            block.weight.copy_(torch.randn(8, 8, generator=g))
            block.bias.copy_(torch.randn(8, generator=g))
    features = torch.randn(3, 8, generator=g)
    with torch.no_grad():
        before = net(features)
    given = []

    def matrix(weight):
        given.append(weight.detach().clone())
        return lambda x: F.linear(x, weight.detach())

    on_kernels(net, matrix)
    assert len(given) == 3 and any(torch.equal(w, net.head.rows) for w in given)  # two blocks and the head
    with torch.no_grad():
        assert torch.allclose(net(features), before, atol=1e-6)


def test_rms_norm_gives_unit_root_mean_square():
    """RMSNorm (Zhang & Sennrich, 2019): x / sqrt(mean(x^2) + eps), times its weight (ones at first)."""
    from decodekit.speculative.trained.networks import RMSNorm

    x = torch.tensor([[3.0, 4.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    out = RMSNorm(4, eps=0.0)(x)
    assert torch.allclose(out, x / torch.tensor([[2.5], [1.0]]))  # rms of (3, 4, 0, 0) is sqrt(25 / 4)


def test_rotary_embedding_is_llamas_rotation_of_half_split_pairs():
    """Pair i (x_i, x_{i + d/2}) is rotated by position * theta^(-2i/d), as a complex number times e^{i angle}."""
    from decodekit.speculative.trained.networks import rotary_angles, rotate

    head_dim, theta = 8, 10000.0
    positions = torch.tensor([0, 1, 5])
    cos, sin = rotary_angles(positions, head_dim, theta)
    x = torch.randn(1, 3, 2, head_dim, generator=torch.Generator().manual_seed(0))  # [B, n, heads, d]
    out = rotate(x, cos, sin)
    for n, p in enumerate(positions.tolist()):
        for i in range(head_dim // 2):
            angle = p * theta ** (-2 * i / head_dim)
            z = torch.complex(x[0, n, :, i], x[0, n, :, i + head_dim // 2]) * complex(math.cos(angle), math.sin(angle))
            assert torch.allclose(out[0, n, :, i], z.real, atol=1e-5)
            assert torch.allclose(out[0, n, :, i + head_dim // 2], z.imag, atol=1e-5)


def test_eagle_noise_is_centred_on_the_feature(monkeypatch):
    """EAGLE's feature noise is uniform in [-noise, noise]: a draw in the middle of the range adds nothing."""
    net = small_eagle()
    g = torch.Generator().manual_seed(0)
    features, embeds = torch.randn(1, 6, 8, generator=g), torch.randn(1, 6, 8, generator=g)
    mask = torch.ones(1, 6, dtype=torch.bool)
    quiet = net.loss(features, embeds, mask, noise=0.0)[0].item()
    monkeypatch.setattr(torch, "rand_like", lambda t: torch.full_like(t, 0.5))
    assert net.loss(features, embeds, mask, noise=0.5)[0].item() == pytest.approx(quiet, rel=1e-6)


class StubEagle(torch.nn.Module):
    """A deterministic stand-in for EAGLE's network: the next feature is a fixed mix of the current
    feature and the token's embedding (no attention), with a real draft head."""

    def __init__(self, backend):
        super().__init__()
        from decodekit.speculative.trained.networks import ReducedHead

        self.head = ReducedHead(torch.arange(backend.info.vocab_size))
        self.head.attach(backend.head_rows(self.head.vocab) * 3)

    def forward(self, features, embeds, positions, visible, past=None):
        assert visible.shape[0] == features.shape[1]
        empty = torch.zeros(1, 1, features.shape[1], 1)
        return torch.tanh(features * 0.5 + embeds), (empty, empty)


@pytest.mark.parametrize("top_k, depth, budget, prompt", [(3, 4, 7, [5, 6, 7, 8]), (2, 6, 4, [5, 6, 7, 8]),
                                                         (3, 6, 5, [9, 3, 9, 3]), (4, 5, 9, [1, 2]),
                                                         (2, 3, 30, [5, 6, 7, 8])])  # a budget above every node drafted
def test_eagle_trees_are_eagle2s_most_confident_paths(monkeypatch, top_k, depth, budget, prompt):
    """EAGLE-2's tree: each level expands the top_k most confident newest nodes into their top_k
    tokens; the tree kept is the ``budget`` most confident nodes. Checked against a reference written
    over paths (confidence = product of draft probabilities along the path), which grows every level
    the drafter may stop before (once ``budget`` nodes are at least as confident as a level's best)."""
    from decodekit.engine.core import DecodeState, GenerationStats
    from decodekit.speculative.drafters.eagle import EagleDrafter

    model = tiny()
    backend = model.backend
    stub = StubEagle(backend)
    monkeypatch.setattr(store, "load", lambda *args, **kwargs: stub)
    drafter = EagleDrafter(candidates=top_k, max_depth=depth, min_confidence=0.0)
    state = DecodeState(backend, Sampler(greedy=True), prompt, GenerationStats())
    state.prefill()
    drafter.begin(state)
    state.commit([int(state.next_logits().argmax())])
    tree = drafter.draft(state, budget)

    embed = lambda t: backend.token_embeddings(torch.tensor([t]))[0]  # noqa: E731
    probs = lambda f: torch.softmax(stub.head(f), -1)  # noqa: E731
    with torch.no_grad():
        features = backend.last_features[0]
        pairs = torch.tanh(features * 0.5 + backend.token_embeddings(torch.tensor(state.tokens[1:])))
        ahead = pairs[-1]  # the last committed pair: (feature before the root, the root)
        level, every = [], []
        top = probs(ahead).topk(top_k)
        level = [((int(t),), float(p), ahead) for p, t in zip(top.values, top.indices)]
        every += level
        for _ in range(1, min(depth, budget)):
            frontier = sorted(level, key=lambda n: -n[1])[:top_k]
            level = []
            for path, score, parent_feature in frontier:
                out = torch.tanh(parent_feature * 0.5 + embed(path[-1]))
                top = probs(out).topk(top_k)
                level += [(path + (int(t),), score * float(p), out) for p, t in zip(top.values, top.indices)]
            every += level
    kept = {path for path, _, _ in sorted(every, key=lambda n: -n[1])[:budget]}
    kept |= {path[:i] for path in kept for i in range(1, len(path))}

    def path_of(node: int) -> tuple:
        out = []
        while node >= 0:
            out.append(tree.tokens[node])
            node = tree.parents[node]
        return tuple(reversed(out))

    assert {path_of(i) for i in range(len(tree))} == kept
    assert len(tree) == min(budget, len(every))


def test_eagle_drafts_nothing_while_a_committed_tokens_feature_is_unknown(monkeypatch):
    """The network reads the feature of every committed position but the root's: a token committed
    without its pass's features (a pass that gave none) leaves nothing to draft from, so the tree
    is empty rather than drafted from features that are not the tokens'."""
    from decodekit.engine.core import DecodeState, GenerationStats
    from decodekit.speculative.drafters.eagle import EagleDrafter

    backend = tiny().backend
    monkeypatch.setattr(store, "load", lambda *args, **kwargs: StubEagle(backend))
    drafter = EagleDrafter(candidates=2, max_depth=3, min_confidence=0.0)
    state = DecodeState(backend, Sampler(greedy=True), [5, 6, 7, 8], GenerationStats())
    state.prefill()
    drafter.begin(state)
    state.commit([int(state.next_logits().argmax())])
    assert len(drafter.draft(state, 4)) == 4
    state.commit([3])  # no update: the feature at the last root's position is unknown
    assert len(drafter.draft(state, 4)) == 0


def test_eagle_stops_growing_once_no_deeper_node_could_be_kept(monkeypatch):
    """A level is drafted only while one of its nodes could still be among the ``budget`` most
    confident: the same trees with fewer passes of the draft network than growing to ``max_depth``."""
    from decodekit.engine.core import DecodeState, GenerationStats
    from decodekit.speculative.drafters import eagle

    backend = tiny().backend
    stub = StubEagle(backend)
    forwards = []
    original = stub.forward
    stub.forward = lambda *args, **kwargs: forwards.append(1) or original(*args, **kwargs)
    monkeypatch.setattr(store, "load", lambda *args, **kwargs: stub)

    def trees() -> list[tuple[list[int], list[int]]]:
        out = []
        for prompt in ([5, 6, 7, 8], [9, 3, 9, 3], [1, 2], [40, 41, 42]):
            drafter = eagle.EagleDrafter(candidates=3, max_depth=8, min_confidence=0.0)
            state = DecodeState(backend, Sampler(greedy=True), prompt, GenerationStats())
            state.prefill()
            drafter.begin(state)
            state.commit([int(state.next_logits().argmax())])
            tree = drafter.draft(state, 4)
            out.append((tree.tokens, tree.parents))
        return out

    pruned, pruned_forwards = trees(), len(forwards)
    forwards.clear()
    monkeypatch.setattr(eagle, "_can_enter", lambda scores, best, budget: True)
    assert trees() == pruned
    assert pruned_forwards < len(forwards) == 4 * (1 + 3)  # a prompt's last pair, then every level down to the budget


def test_eagle_drafts_no_level_once_budget_nodes_are_as_confident_as_its_best():
    """A deeper node is at most as confident as the level's best and loses ties to the nodes before it
    (a stable sort): once ``budget`` nodes reach that confidence, it could not be kept."""
    from decodekit.speculative.drafters.eagle import _can_enter

    assert not _can_enter([0.5, 0.4, 0.3], 0.3, 3)  # exactly budget nodes at least as confident: stop
    assert _can_enter([0.5, 0.4, 0.2], 0.3, 3)  # only two reach it
    assert _can_enter([0.5, 0.4], 0.1, 3)  # fewer nodes than the budget


def test_eagle_grows_a_level_whose_best_confidence_is_exactly_the_minimum(monkeypatch):
    """Growth stops when a level's best path confidence is *below* ``min_confidence``: at exactly
    the minimum the next level is still drafted, a hair above it is not."""
    import math

    from decodekit.engine.core import DecodeState, GenerationStats
    from decodekit.speculative.drafters import eagle

    backend = tiny().backend
    monkeypatch.setattr(store, "load", lambda *args, **kwargs: StubEagle(backend))
    best = []
    can_enter = eagle._can_enter
    monkeypatch.setattr(eagle, "_can_enter", lambda scores, top, budget: best.append(top) or can_enter(scores, top, budget))

    def depth_of_tree(min_confidence: float) -> int:
        drafter = eagle.EagleDrafter(candidates=2, max_depth=2, min_confidence=min_confidence)
        state = DecodeState(backend, Sampler(greedy=True), [5, 6, 7, 8], GenerationStats())
        state.prefill()
        drafter.begin(state)
        state.commit([int(state.next_logits().argmax())])
        tree = drafter.draft(state, 16)
        return 2 if any(p >= 0 for p in tree.parents) else 1

    assert depth_of_tree(0.0) == 2
    level_best = best[0]  # the first level's best confidence, as the drafter compares it
    best.clear()
    assert depth_of_tree(level_best) == 2
    assert depth_of_tree(math.nextafter(level_best, 1.0)) == 1


def eagle_drafting_levels(drafter_files, candidates: int, max_depth: int):
    """A tiny target after two prompts (the last token the root), its features, and an EAGLE drafter
    set up with those features committed but the root's, which records each level it drafts: the
    lists ``levels`` (per level: its parents, the feature predicted at each parent's position) and
    ``grown`` (the tree as drafted, before selection), filled by its next draft."""
    from decodekit.speculative.drafters.eagle import EagleDrafter

    model = tiny()
    tokens = PROMPTS[1] + PROMPTS[2]  # the last one is the root
    model.backend.prefill(tokens)
    features = model.backend.last_features[0].clone()
    drafter = EagleDrafter(drafter=str(drafter_files["eagle", "exact"]), candidates=candidates, max_depth=max_depth,
                           min_confidence=0.0)
    drafter.net = store.load(model.backend, "eagle", drafter.path)
    n = len(tokens)
    drafter.chunks, drafter.chunk_start, drafter.known, drafter.first = [features[: n - 1]], 0, n - 1, 0
    drafter.past, drafter.pairs, drafter.ahead = None, 0, None
    levels, grown = [], []
    add_children = drafter._add_children
    drafter._add_children = lambda tree, scores, feature, parents, predicted, root: (
        levels.append((list(parents), predicted.clone())) or grown.append(tree)
        or add_children(tree, scores, feature, parents, predicted, root))
    return model, tokens, features, drafter, levels, grown


def test_eagle_drafts_each_level_at_the_position_a_committed_pair_would_take(drafter_files):
    """A drafted node's pair (the feature predicted at its parent's position, its token) sits right
    after the committed pairs, where it would be were it committed: the draft network predicts the
    same next feature from it as from that pair committed with the predicted feature."""
    from decodekit.engine.core import DecodeState, GenerationStats

    model, tokens, features, drafter, levels, grown = eagle_drafting_levels(drafter_files, candidates=3, max_depth=2)
    n = len(tokens)
    state = DecodeState(model.backend, Sampler(greedy=True), tokens, GenerationStats())
    with torch.inference_mode():
        tree = drafter.draft(state, 12)
        (_, at_root), (frontier, below) = levels  # the root's children, then the first level's
        first = frontier[0]
        # the same pair committed: the feature predicted at the root's position, the first node's token
        drafter.chunks, drafter.known = [torch.cat([features[: n - 1], at_root])], n
        drafter._commit_pairs(DecodeState(model.backend, Sampler(greedy=True), tokens + [tree.tokens[first]],
                                          GenerationStats()), n)
    assert torch.allclose(below[0], drafter.ahead, atol=1e-4)


def test_eagle_drafts_every_node_as_if_its_whole_path_were_committed(drafter_files):
    """Each drafted node sees the committed pairs and the pairs of all its ancestors (not only its
    parent), in the draft cache's order: the feature the draft network predicts after a node of
    depth 1, 2 or 3 is the one it predicts after the node's path committed as pairs (with the
    predicted features), as a verification that accepted the path would commit it."""
    from decodekit.engine.core import DecodeState, GenerationStats

    model, tokens, features, drafter, levels, grown = eagle_drafting_levels(drafter_files, candidates=2, max_depth=4)
    n = len(tokens)
    with torch.inference_mode():
        drafter.draft(DecodeState(model.backend, Sampler(greedy=True), tokens, GenerationStats()), 40)
        tree, past, pairs = grown[0], drafter.past, drafter.pairs  # the whole tree drafted, before selection
        assert len(levels) == 4  # the root's children, then three levels expanded

        def predicted(node: int, level: int) -> torch.Tensor:
            parents, out = levels[level]
            return out[parents.index(node)]

        checked = 0
        for level in range(1, len(levels)):
            for node in levels[level][0]:
                path = [node]
                while tree.parents[path[0]] >= 0:
                    path.insert(0, tree.parents[path[0]])
                assert len(path) == level
                # committed: the features predicted at the root's and each ancestor's position, the path's tokens
                chunk = torch.cat([features[: n - 1], levels[0][1], *[predicted(a, i + 1)[None] for i, a in enumerate(path[:-1])]])
                drafter.chunks, drafter.chunk_start, drafter.known = [chunk], 0, len(chunk)
                drafter.past, drafter.pairs, drafter.ahead = past, pairs, None
                state = DecodeState(model.backend, Sampler(greedy=True), tokens + [tree.tokens[a] for a in path],
                                    GenerationStats())
                drafter._commit_pairs(state, n + level - 1)
                assert torch.allclose(predicted(node, level), drafter.ahead, atol=1e-4), (level, node)
                checked += 1
    assert checked == 3 * 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_drafter_holds_the_targets_feature_at_every_position(drafter_files, kind):
    """After every verification and plain step, the features a drafter takes are, position by position,
    the ones a single pass over the whole text gives (a wrong row of a verification pass would differ)."""
    model = tiny()
    method = method_for(kind, drafter_files[kind, "exact"], budget=4)
    drafter, taken = method.drafter, []
    update = drafter.update

    def recording(state, tree, verdict, logits):
        before = drafter.known
        update(state, tree, verdict, logits)
        taken.append((before, drafter.chunks[-1].clone(), len(verdict.path)))

    drafter.update = recording
    out = run(model, method, PROMPTS[0], n=40)
    assert out.stats.extra["accepted"] > 0 and any(accepted for _, _, accepted in taken)
    model.backend.prefill(PROMPTS[0] + out.tokens)
    whole = model.backend.last_features[0]
    for start, chunk, _ in taken:
        assert torch.allclose(chunk, whole[start : start + len(chunk)], atol=1e-5), start


def recorded_trees(monkeypatch, drafter_class) -> list[list[list[int]]]:
    """The trees ``drafter_class`` drafts from now on, a list of them a request (append an empty
    list before each request)."""
    trees: list[list[list[int]]] = []
    draft = drafter_class.draft

    def recording(self, state, budget):
        tree = draft(self, state, budget)
        trees[-1].append(list(tree.tokens))
        return tree

    monkeypatch.setattr(drafter_class, "draft", recording)
    return trees


@pytest.mark.parametrize("kind", KINDS)
def test_a_prompt_whose_beginning_the_cache_kept_drafts_as_if_read_whole(drafter_files, kind, monkeypatch):
    """A chat's next turn reads only what the cache did not keep; the drafter takes the features of
    the kept beginning from the last request, so it drafts the trees a fresh engine drafts (EAGLE's
    draft network sees the whole context, as in the paper)."""
    from decodekit.engine import Engine

    trees = recorded_trees(monkeypatch, type(DRAFTER_SPECS[kind].factory(drafter=str(drafter_files[kind, "exact"]))))
    options = dict(method=kind, drafter=str(drafter_files[kind, "exact"]), budget=4, max_new_tokens=24, chat=False,
                   ignore_eos=True)
    model = tiny()
    trees.append([])
    first = Engine(model).generate(QUERIES[0], **options)
    turn = QUERIES[0] + first.text + QUERIES[0]
    assert model.backend.shared_prefix(model.tokenizer.encode(turn)) > len(QUERIES[0])  # the cache kept turn one
    for engine in (Engine(model), Engine(tiny())):  # the kept cache, then a fresh model's
        trees.append([])
        engine.generate(turn, **options)
    assert trees[1] and trees[1] == trees[2]


def test_a_conversation_back_from_the_servers_prompt_cache_drafts_as_a_fresh_engine(drafter_files, monkeypatch):
    """A served EAGLE conversation whose slot another prompt took, then whose next turn starts from
    the prompt cache: the cache's entries come back with the features of their positions, so it
    drafts the trees a fresh engine drafts, as after a kept slot (the test above)."""
    from decodekit.engine import Engine
    from decodekit.serve.scheduler import Job, Scheduler

    options = {"drafter": str(drafter_files["eagle", "exact"]), "budget": 4}
    trees = recorded_trees(monkeypatch, type(DRAFTER_SPECS["eagle"].factory(drafter=options["drafter"])))
    model = tiny()
    scheduler = Scheduler(model, max_batch=1, max_queue=0)
    try:
        def served(prompt, method, params):
            (future,) = scheduler.submit([Job(prompt, method, params, 24, ignore_eos=True)])
            return future.result(timeout=60).generation

        prompt = model.tokenizer.encode(QUERIES[0])
        trees.append([])
        first = served(prompt, "eagle", options)
        trees.append([])
        served(model.tokenizer.encode(QUERIES[1]), "eagle", options)  # takes the only slot, and its feature history
        turn = prompt + first.tokens + model.tokenizer.encode(QUERIES[2])
        before = scheduler.prefix_tokens
        trees.append([])
        served(turn, "eagle", options)
        assert scheduler.prefix_tokens - before > len(prompt)  # from the prompt cache
    finally:
        scheduler.close()
    trees.append([])
    Engine(tiny()).generate(turn, method="eagle", max_new_tokens=24, chat=False, ignore_eos=True, **options)
    assert trees[-2] and trees[-2] == trees[-1]


def test_only_a_drafter_that_reads_earlier_features_keeps_them_for_the_next_request(drafter_files):
    """Medusa reads the last feature alone: it keeps no history of a request's features; EAGLE,
    whose network attends to every earlier one, does."""
    from decodekit.engine import Engine

    for kind, keeps in (("medusa", False), ("eagle", True)):
        model = tiny()
        Engine(model).generate(QUERIES[0], method=kind, drafter=str(drafter_files[kind, "exact"]), budget=4,
                               max_new_tokens=8, chat=False, ignore_eos=True)
        assert ("features.history" in model.backend.__dict__.get("_memory", {})) == keeps, kind


def test_the_features_of_a_request_before_the_last_are_not_taken(drafter_files, monkeypatch):
    """The cache kept a plain request's text, not that of the EAGLE request before it, whose
    features belong to other tokens: a next turn of the plain request drafts as it would had the
    EAGLE request never run (from the features of what it reads)."""
    from decodekit.engine import Engine
    from decodekit.speculative.drafters.eagle import EagleDrafter

    options = dict(method="eagle", drafter=str(drafter_files["eagle", "exact"]), budget=4, max_new_tokens=24,
                   chat=False, ignore_eos=True)
    trees = recorded_trees(monkeypatch, EagleDrafter)
    turns = []
    for eagle_first in (True, False):
        model = tiny()
        if eagle_first:  # its features: more positions than the plain request's kept text
            trees.append([])
            Engine(model).generate(QUERIES[1] * 4, **options)
        plain = Engine(model).generate(QUERIES[0], max_new_tokens=12, chat=False, ignore_eos=True)
        turn = QUERIES[0] + plain.text + QUERIES[2]
        assert model.backend.shared_prefix(model.tokenizer.encode(turn)) > len(QUERIES[0])
        trees.append([])
        Engine(model).generate(turn, **options)
        turns.append(trees[-1])
    assert turns[0] and turns[0] == turns[1]


def test_a_feature_history_gives_every_position_it_holds_the_last_included():
    """A next prompt whose kept beginning is exactly the last request's featured positions takes
    them all; one position more than the history holds, or other tokens, take none."""
    from decodekit.speculative.drafters.base import FeatureHistory

    history = FeatureHistory()
    history.tokens, history.chunks = [5, 6, 7, 8], [torch.arange(4.0).view(2, 2), torch.arange(4.0, 6.0).view(1, 2)]
    assert torch.equal(history.before([5, 6, 7, 9], 3), torch.arange(6.0).view(3, 2))
    assert torch.equal(history.before([5, 6, 7], 2), torch.arange(4.0).view(2, 2))
    assert history.before([5, 6, 7, 8], 4) is None  # 3 positions held
    assert history.before([5, 1, 7, 8], 3) is None

def begun_feature_drafter(prompt: list[int]):
    """A feature drafter (the features alone: no network) begun on a tiny model's prompt pass."""
    from decodekit.engine.core import DecodeState, GenerationStats
    from decodekit.speculative.drafters.base import FeatureDrafter
    from decodekit.speculative.tree import DraftTree

    class Features(FeatureDrafter):
        kind = "medusa"

        def draft(self, state, budget):
            return DraftTree()

    model = tiny()
    state = DecodeState(model.backend, Sampler(greedy=True), list(prompt), GenerationStats())
    state.prefill()
    drafter = Features()
    drafter.net, drafter._net_for = object(), model.backend
    drafter.begin(state)
    return model, state, drafter


def test_a_feature_drafter_takes_no_feature_from_a_pass_that_is_not_the_updates():
    """update takes the features of the pass the loop says it ran (the root, then the tree's nodes):
    where the backend's last pass is another (still the prompt's, of many rows), it learns nothing
    rather than file another position's feature under the root's."""
    from decodekit.speculative.tree import DraftTree, Verification

    prompt = PROMPTS[1]
    model, state, drafter = begun_feature_drafter(prompt)
    whole = model.backend.last_features[0].float().clone()
    logits = state.next_logits()  # the prompt's pass's: no pass more
    state.commit([int(logits.argmax())])  # the root is pending: no pass has read it yet
    drafter.update(state, DraftTree(), Verification([], int(logits.argmax())), logits[None])
    assert drafter.known == len(prompt) and torch.equal(drafter.features_from(0), whole)
    logits = state.next_logits()  # the root's pass: now the update takes its feature
    drafter.update(state, DraftTree(), Verification([], int(logits.argmax())), logits[None])
    assert drafter.known == len(prompt) + 1
    assert torch.equal(drafter.features_from(len(prompt))[0], model.backend.last_features[0, 0].float())


def test_a_feature_drafter_that_missed_a_step_takes_no_feature_and_knows_none_before_the_root():
    """After a step whose update the drafter did not see, the next pass's feature is not the one of
    the position it would file it under: it takes none, and has no feature for the position before
    the root (Medusa's input), rather than an older position's."""
    from decodekit.speculative.tree import DraftTree, Verification

    prompt = PROMPTS[1]
    model, state, drafter = begun_feature_drafter(prompt)
    state.commit([int(state.next_logits().argmax())])
    assert drafter.last_feature(state) is not None  # the prompt's last position: known
    state.commit([int(state.next_logits().argmax())])  # a step the drafter did not see
    logits = state.next_logits()
    drafter.update(state, DraftTree(), Verification([], int(logits.argmax())), logits[None])
    assert drafter.known == len(prompt)
    assert drafter.last_feature(state) is None


@pytest.mark.parametrize("kind", KINDS)
def test_a_drafter_checked_for_one_model_and_begun_on_another_checks_again(kind):
    """begin checks the drafter again where it was checked for another target (a drafter used
    without the loop, or moved to a second model): a network trained for another model is refused
    there, never drafted with."""
    from decodekit.engine.core import DecodeState, GenerationStats
    from tests.conftest import required_options

    model, other = tiny(), tiny(seed=1)
    drafter = DRAFTER_SPECS[kind].factory(**required_options(kind, model.backend))
    drafter.check(model.backend)
    state = DecodeState(other.backend, Sampler(greedy=True), list(PROMPTS[0]), GenerationStats())
    state.prefill()
    with pytest.raises(InvalidParameter, match="trained for another model"):
        drafter.begin(state)


def test_eagle_predicts_the_same_after_pairs_committed_one_by_one_or_together(drafter_files):
    """The draft network's cache of committed pairs gives the same prediction whether the pairs came
    in one pass or several (after a verification several arrive at once)."""
    from decodekit.engine.core import DecodeState, GenerationStats
    from decodekit.speculative.drafters.eagle import EagleDrafter

    model = tiny()
    tokens = PROMPTS[1] + PROMPTS[2]
    model.backend.prefill(tokens)
    features = model.backend.last_features[0].clone()
    state = DecodeState(model.backend, Sampler(greedy=True), tokens, GenerationStats())
    aheads = []
    for steps in ([len(tokens) - 1], [3, len(tokens) - 4, len(tokens) - 3, len(tokens) - 1]):
        drafter = EagleDrafter(drafter=str(drafter_files["eagle", "exact"]))
        drafter.net = store.load(model.backend, "eagle", drafter.path)
        drafter.chunks, drafter.chunk_start, drafter.known, drafter.first = [features], 0, len(tokens), 0
        drafter.past, drafter.pairs, drafter.ahead = None, 0, None
        with torch.inference_mode():
            for upto in steps:
                drafter._commit_pairs(state, upto)
        aheads.append(drafter.ahead)
    assert torch.allclose(aheads[0], aheads[1], atol=1e-4)


def test_a_drafter_file_may_be_given_as_a_path(drafter_files):
    from decodekit.engine import Engine

    engine = Engine(tiny())
    path = drafter_files["eagle", "exact"]
    given = engine.generate("hello", method="eagle", drafter=path, max_new_tokens=8, chat=False)
    assert given.tokens == engine.generate("hello", method="eagle", drafter=str(path), max_new_tokens=8, chat=False).tokens


def test_a_drafter_file_is_loaded_once_however_its_path_is_spelt(drafter_files, monkeypatch):
    backend = tiny().backend
    path = drafter_files["eagle", "exact"]
    net = store.load(backend, "eagle", path)
    monkeypatch.chdir(path.parent)
    assert store.load(backend, "eagle", path.name) is net
    assert store.load(backend, "eagle", path.parent / "." / path.name) is net


def test_the_cache_keeps_a_drafter_of_each_kind_for_a_target(drafter_files, monkeypatch, tmp_path):
    """``train-drafter --kind eagle`` and ``--kind medusa`` for one model: both files stay, each
    found by its own method."""
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    backend = tiny().backend
    paths = {kind: store.cache_path(backend, kind) for kind in KINDS}
    for kind in KINDS:
        paths[kind].parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(drafter_files[kind, "exact"], paths[kind])
    assert isinstance(store.load(backend, "eagle"), EagleNet)
    assert isinstance(store.load(backend, "medusa"), MedusaNet)


def test_medusa_loss_is_the_same_with_a_samples_padding():
    """In a batch a shorter sample is padded: its padding is scored neither as a feature nor as the
    label of a head's feature shift tokens back (padding tokens may lie in the draft vocabulary)."""
    model = tiny()
    net = new_net("medusa", model.backend, torch.arange(16), Settings("medusa"))
    g = torch.Generator().manual_seed(0)
    features = torch.randn(1, 12, model.backend.info.hidden_size, generator=g)
    targets, mask = torch.randint(0, 16, (1, 12), generator=g), torch.ones(1, 12, dtype=torch.bool)
    mask[0, :3] = False  # the prompt: not scored
    alone, _ = net.loss(features, targets, mask)
    padded_loss, _ = net.loss(torch.cat([features, torch.zeros(1, 5, features.shape[-1])], dim=1),
                              torch.cat([targets, torch.zeros(1, 5, dtype=torch.long)], dim=1),
                              torch.cat([mask, torch.zeros(1, 5, dtype=torch.bool)], dim=1))
    assert padded_loss.item() == pytest.approx(alone.item(), rel=1e-6)


def test_a_batch_scores_each_sample_from_its_query_to_its_end():
    """``padded``: the shared template before ``scored_from`` and a shorter sample's padding are not scored."""
    from decodekit.speculative.trained.train import padded

    backend = tiny().backend
    D = backend.info.hidden_size
    group = [data_module.Sample([5, 6, 7, 8, 9], 2, torch.ones(5, D)),
             data_module.Sample([5, 6, 7, 8, 9, 10, 11], 3, torch.ones(7, D))]
    features, embeds, tokens, mask = padded(group, backend, max_len=512)
    assert mask.tolist() == [[False, False, True, True, True, False, False],
                             [False, False, False, True, True, True, True]]
    assert tokens[0].tolist() == [5, 6, 7, 8, 9, 0, 0] and features[0, 5:].abs().sum() == 0
    assert padded(group, backend, max_len=4)[3].tolist() == [[False, False, True, True], [False, False, False, True]]


def small_eagle(seed: int = 0):
    from decodekit.speculative.trained.networks import EagleConfig, EagleNet

    torch.manual_seed(seed)
    net = EagleNet(EagleConfig(hidden=8, heads=2, head_dim=4, intermediate=16), torch.arange(5))
    net.head.attach(torch.randn(5, 8))
    return net


@pytest.mark.parametrize("unroll", [1, 2])
def test_eagle_loss_is_the_same_with_a_samples_padding(unroll):
    """Pair j predicts f_{j+1} and is scored where position j + 1 is: padding is scored neither in the
    regression nor in the cross-entropy (and the prompt's pairs not either)."""
    net = small_eagle()
    g = torch.Generator().manual_seed(0)
    features, embeds = torch.randn(1, 10, 8, generator=g), torch.randn(1, 10, 8, generator=g)
    mask = torch.ones(1, 10, dtype=torch.bool)
    mask[0, :3] = False  # the prompt: not scored
    alone, _ = net.loss(features, embeds, mask, noise=0.0, unroll=unroll)
    padded_loss, _ = net.loss(torch.cat([features, torch.zeros(1, 4, 8)], dim=1),
                              torch.cat([embeds, torch.randn(1, 4, 8, generator=g)], dim=1),
                              torch.cat([mask, torch.zeros(1, 4, dtype=torch.bool)], dim=1), noise=0.0, unroll=unroll)
    assert padded_loss.item() == pytest.approx(alone.item(), rel=1e-6)


def test_eagle_loss_scores_pair_j_where_its_target_feature_is():
    """The loss of pair j (f_j, e_{j+1}) is weighted by the mask at j + 1, the position of the feature it
    predicts: with every position scored but the last, a changed last feature changes nothing, and a
    mask of one scored position gives that one pair's smooth-L1 plus 0.1 times its cross-entropy."""
    net = small_eagle()
    g = torch.Generator().manual_seed(1)
    features, embeds = torch.randn(1, 6, 8, generator=g), torch.randn(1, 6, 8, generator=g)
    mask = torch.ones(1, 6, dtype=torch.bool)
    mask[0, -1] = False
    changed = features.clone()
    changed[0, -1] += 5.0
    assert net.loss(changed, embeds, mask, noise=0.0)[0].item() == pytest.approx(
        net.loss(features, embeds, mask, noise=0.0)[0].item(), rel=1e-6)
    one = torch.zeros(1, 6, dtype=torch.bool)
    one[0, 4] = True  # the feature predicted by pair 3
    with torch.no_grad():
        predicted, _ = net(features[:, :-1], embeds[:, 1:], torch.arange(5), torch.ones(5, 5, dtype=torch.bool).tril())
        guess, target = predicted[0, 3], features[0, 4]
        diff = (guess - target).abs()
        regression = torch.where(diff < 1, 0.5 * diff**2, diff - 0.5).mean()
        p = torch.softmax(net.head.rows @ target, -1)
        cross_entropy = -(p * torch.log_softmax(net.head.rows @ guess, -1)).sum()
        loss, figures = net.loss(features, embeds, one, noise=0.0)
    assert figures["regression"] == pytest.approx(regression.item(), rel=1e-5)
    assert loss.item() == pytest.approx((regression + 0.1 * cross_entropy).item(), rel=1e-5)


def test_medusa_loss_weighs_head_k_by_the_decay_to_the_k():
    """Medusa-1's loss: the sum over heads of ``decay ** k`` times head k's cross-entropy against the
    token k + 2 ahead; head 0 has weight 1. Untrained heads are the target's head on the feature."""
    from decodekit.speculative.trained.networks import MedusaConfig, MedusaNet

    net = MedusaNet(MedusaConfig(hidden=4, heads=2), torch.arange(3))
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 4, generator=g)
    net.head.attach(rows)
    features = torch.randn(1, 5, 4, generator=g)
    targets = torch.tensor([[0, 1, 2, 1, 0]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    log_q = torch.log_softmax(features[0] @ rows.T, -1)  # [5, 3]: every head's, untrained
    head0 = -sum(log_q[j, targets[0, j + 2]] for j in range(3)) / 3
    head1 = -sum(log_q[j, targets[0, j + 3]] for j in range(2)) / 2
    with torch.no_grad():
        assert net.loss(features, targets, mask, decay=0.5)[0].item() == pytest.approx((head0 + 0.5 * head1).item(), rel=1e-5)


def random_hydra(hidden: int = 4, heads: int = 3, vocab: int = 5, seed: int = 0):
    """A Hydra net with random (not the initial, feature-only) weights, attached to random head rows."""
    from decodekit.speculative.trained.networks import HydraConfig, HydraNet

    net = HydraNet(HydraConfig(hidden=hidden, heads=heads), torch.arange(vocab) + 30)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    net.head.attach(torch.randn(vocab, hidden, generator=g))
    return net.requires_grad_(False), g


def test_untrained_hydra_heads_are_the_targets_head_on_the_feature():
    """Each head starts as the target's head on the feature, whatever tokens follow it."""
    from decodekit.speculative.trained.networks import HydraConfig, HydraNet

    net = HydraNet(HydraConfig(hidden=4, heads=3), torch.arange(3))
    rows = torch.randn(3, 4)
    net.head.attach(rows)
    feature = torch.randn(4)
    for k in range(3):
        inputs = torch.cat([feature, torch.randn((k + 1) * 4)])
        assert torch.allclose(net(k, inputs), rows @ feature, atol=1e-6), k


def test_a_hydra_head_is_the_residual_block_on_its_path():
    """Head k: the target's head on ``f + D x + c + SiLU(W x + b)``, where x is the feature and the
    k + 1 embeddings, and head k's matrix holds D's rows, then W's (Hydra's ResBlock, its projection
    written as the feature plus D)."""
    net, g = random_hydra(hidden=4, heads=2)
    for k in range(2):
        x = torch.randn((k + 2) * 4, generator=g)
        weight, bias = net.blocks[k].weight, net.blocks[k].bias
        state = x[:4] + weight[:4] @ x + bias[:4] + torch.nn.functional.silu(weight[4:] @ x + bias[4:])
        assert torch.allclose(net(k, x), net.head.rows @ state, atol=1e-5), k


def test_a_hydra_file_whose_config_asks_for_thousands_of_heads_is_refused_before_they_are_made(tmp_path):
    """Head k holds (k + 2) D x 2D weights: a damaged ``heads`` would allocate terabytes; the sizes are
    compared with the file's on no memory first."""
    model = tiny()
    path = store.save(new_net("hydra", model.backend, torch.arange(16), Settings("hydra")), "hydra", model.backend,
                      tmp_path / "hydra.safetensors", {})
    assert isinstance(store.load(model.backend, "hydra", path).blocks, torch.nn.ModuleList)
    meta = _crafted(path, path)[1]
    config = json.loads(meta["config"])
    _crafted(path, path, redigest=True, config=json.dumps({**config, "heads": 3000}))
    with pytest.raises(InvalidModel, match="config asks for [0-9]+ weights, more than the file holds") as refused:
        store.load(tiny().backend, "hydra", path)
    assert str(refused.value).count("does not hold a valid") == 1  # said once, not wrapped in itself


def test_a_drafter_is_never_saved_over_a_device_or_under_a_folders_name(tmp_path):
    """Saving renames a new file over the name: /dev/null itself would become that file (a pipe
    stands in for the device here, so that a mutant replaces nothing the machine needs)."""
    import os

    model = tiny()
    net = new_net("medusa", model.backend, torch.arange(16), Settings("medusa"))
    os.mkfifo(tmp_path / "pipe")
    for path, problem in ((tmp_path / "pipe", "is not a regular file"), (tmp_path, "must name the drafter's file")):
        with pytest.raises(InvalidParameter, match=problem):
            store.save(net, "medusa", model.backend, path, {})
    assert (tmp_path / "pipe").is_fifo()
    with pytest.raises(InvalidParameter, match="must name the drafter's file, not a folder"):
        store.check_drafter_path(tmp_path / "new", f"{tmp_path / 'new'}/")  # as typed: a folder to be


def test_hydra_loss_is_head_ks_cross_entropy_against_the_target_k_plus_1_positions_on():
    """Head k at position t reads f_t and the embeddings of tokens t + 1 .. t + k + 1, and is scored
    against the target's distribution at t + k + 1 (its head on that feature), where t and t + k + 2
    are scored; the heads' losses add up. Checked position by position."""
    net, g = random_hydra(heads=2)
    features, embeds = torch.randn(2, 6, 4, generator=g), torch.randn(2, 6, 4, generator=g)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :1] = False  # the template: not scored
    mask[1, 5:] = False  # padding
    want = 0.0
    with torch.no_grad():
        for k in range(2):
            terms = []
            for b in range(2):
                for t in range(6 - k - 2):
                    if not (mask[b, t] and mask[b, t + k + 2]):
                        continue
                    inputs = torch.cat([features[b, t]] + [embeds[b, t + j] for j in range(1, k + 2)])
                    p = torch.softmax(net.head(features[b, t + k + 1]), -1)
                    terms.append(-(p * torch.log_softmax(net(k, inputs), -1)).sum())
            want += sum(terms) / len(terms)
        got = net.loss(features, embeds, mask)[0]
    assert got.item() == pytest.approx(float(want), rel=1e-5)


@pytest.mark.parametrize("budget", [1, 4, 9, 25])
def test_hydra_trees_are_the_most_probable_paths_each_head_reading_its_path(budget):
    """Head d expands a depth-d node from the feature, the root's token and the path's tokens down to
    it (siblings get children of their own), and the tree is the ``budget`` most probable paths:
    checked against every path written out, each scored by running the heads along it."""
    import itertools

    from decodekit.speculative.drafters.hydra import HydraDrafter

    heads, candidates = 3, 2
    net, g = random_hydra(heads=heads, seed=budget)
    embeddings = torch.randn(40, 4, generator=g)
    feature, root = torch.randn(4, generator=g), 7
    state = argparse.Namespace(tokens=[3, root], backend=argparse.Namespace(token_embeddings=lambda t: embeddings[t]))
    drafter = HydraDrafter(candidates=candidates)
    drafter.net = net
    drafter.last_feature = lambda state: feature
    tree = drafter.draft(state, budget=budget)

    def top(path: tuple[int, ...]):
        inputs = torch.cat([feature, embeddings[root]] + [embeddings[t] for t in path])
        probs = torch.softmax(net(len(path), inputs), -1)
        best = probs.topk(candidates)
        return [(int(net.head.vocab[i]), float(p)) for p, i in zip(best.values, best.indices)]

    every = {(): 1.0}  # path of tokens -> its probability
    with torch.no_grad():
        for depth in range(heads):
            for path in [p for p in every if len(p) == depth]:
                for token, p in top(path):
                    every[path + (token,)] = every[path] * p
    del every[()]
    best = set(sorted(every, key=lambda path: -every[path])[:budget])
    paths = {tuple(path) for path in tree.paths()}
    assert paths == best and len(tree) == min(budget, len(every))
    assert len({tuple(top((a,))) for a, in [p for p in every if len(p) == 1]}) > 1  # siblings' children differ


def test_a_damaged_drafter_in_the_cache_falls_back_to_the_shipped_one_with_a_line(drafter_files, monkeypatch,
                                                                                 tmp_path, capsys):
    """The cache's drafter takes precedence over the package's; a damaged one is said so in one line
    and the shipped drafter is used (it used to stop every eagle request with the error)."""
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))
    package = tmp_path / "package"
    package.mkdir()
    good = drafter_files["medusa", "exact"]
    (package / "tiny-medusa.safetensors").write_bytes(good.read_bytes())
    monkeypatch.setattr(store, "SHIPPED", package)
    model = tiny()
    saved = store.cache_path(model.backend, "medusa")
    saved.parent.mkdir(parents=True)
    data = bytearray(good.read_bytes())
    data[-100] ^= 0xFF  # a flipped byte in the weights
    saved.write_bytes(bytes(data))
    loaded = store.load(model.backend, "medusa")
    err = capsys.readouterr().err
    assert f"decodekit: {saved}: damaged" in err and "using the drafter shipped with decodekit instead" in err
    from_package = store.build(good, "medusa", model.backend).state_dict()
    assert all(torch.equal(t, from_package[name]) for name, t in loaded.state_dict().items())
    # the next request (a server's) neither reads the damaged file again nor says so again
    monkeypatch.setattr(store, "build", lambda path, *args: pytest.fail(f"{path} read again"))
    assert store.load(model.backend, "medusa") is loaded and capsys.readouterr().err == ""
    monkeypatch.undo()
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(store, "SHIPPED", tmp_path / "nothing")  # no fallback: the damage is the error
    with pytest.raises(InvalidModel, match="damaged"):
        store.load(tiny().backend, "medusa")
    # a drafter of another model under this model's name in the cache (its file since replaced): the same
    monkeypatch.setattr(store, "SHIPPED", package)
    _crafted(good, saved, redigest=True, target="another model's weights", target_name="other")
    loaded = store.load(tiny().backend, "medusa")
    err = capsys.readouterr().err
    assert "was trained for another model (other)" in err and "using the drafter shipped with decodekit instead" in err
    assert all(torch.equal(t, from_package[name]) for name, t in loaded.state_dict().items())


def test_medusa_hangs_head_ks_candidates_below_every_node_of_depth_k():
    """Head k predicts the token k + 2 positions after the feature: its candidates are the children of
    the depth-k nodes (depth 0: the root, with head 0's), so the tree is as deep as there are heads."""
    from decodekit.speculative.drafters.medusa import MedusaDrafter

    heads = 3
    logits = torch.full((heads, 6), -5.0)
    for k in range(heads):
        logits[k, 2 * k], logits[k, 2 * k + 1] = 2.0, 1.0  # head k proposes draft indices 2k and 2k + 1

    class Net:
        head = argparse.Namespace(vocab=torch.tensor([10, 11, 12, 13, 14, 15]))

        def __call__(self, feature):
            return logits

    drafter = MedusaDrafter(candidates=2)
    drafter.net = Net()
    drafter.last_feature = lambda state: torch.zeros(4)
    tree = drafter.draft(None, budget=100)
    assert len(tree) == 2 + 4 + 8 and tree.depth() == heads
    depth = []
    for parent in tree.parents:
        depth.append(0 if parent < 0 else depth[parent] + 1)
    assert all(token in (10 + 2 * d, 11 + 2 * d) for token, d in zip(tree.tokens, depth))


@pytest.mark.parametrize("budget", [1, 5, 11, 20])
def test_medusa_trees_are_the_most_probable_paths_of_the_heads(budget):
    """The tree is grown best first by the product of the heads' softmax probabilities along a path:
    it is the ``budget`` most probable paths (head d's candidates at depth d), checked against every
    path written out."""
    import itertools

    from decodekit.speculative.drafters.medusa import MedusaDrafter

    heads, candidates, vocab = 3, 3, torch.tensor([40, 41, 42, 43, 44, 45, 46])
    logits = torch.randn(heads, len(vocab), generator=torch.Generator().manual_seed(budget)) * 2

    class Net:
        head = argparse.Namespace(vocab=vocab)

        def __call__(self, feature):
            return logits

    drafter = MedusaDrafter(candidates=candidates)
    drafter.net = Net()
    drafter.last_feature = lambda state: torch.zeros(4)
    tree = drafter.draft(None, budget=budget)

    probs = torch.softmax(logits, dim=-1)
    top = [probs[k].topk(candidates) for k in range(heads)]
    every = {}  # path of tokens -> its probability
    for depth in range(1, heads + 1):
        for choice in itertools.product(range(candidates), repeat=depth):
            path = tuple(int(vocab[top[k].indices[c]]) for k, c in enumerate(choice))
            every[path] = math.prod(float(top[k].values[c]) for k, c in enumerate(choice))
    best = set(sorted(every, key=lambda path: -every[path])[:budget])
    paths = {tuple(path) for path in tree.paths()}
    assert paths == best and len(tree) == budget


def _crafted(source, path, tensors=None, redigest=False, **meta_changes):
    """``source``'s drafter file written again to ``path`` with other tensors or metadata: under its
    saved digest (a damaged file), or with ``redigest`` under the digest a save would write (a file
    that passes the digest, for the checks behind it)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(source), framework="pt") as handle:
        meta, original = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}
    meta = {k: v for k, v in {**meta, **meta_changes}.items() if v is not None}
    tensors = tensors or original
    if redigest:
        meta["digest"] = store.drafter_digest(tensors, meta)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path), metadata=meta)
    return original, meta


def test_a_saved_drafter_holds_float16_weights_and_integer_token_ids(drafter_files):
    """The module's promise: a drafter file is float16 weights (half a float32 file's size); the
    draft head's token ids stay integers."""
    from safetensors import safe_open

    with safe_open(str(drafter_files["eagle", "exact"]), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    assert tensors["head.vocab"].dtype in (torch.int32, torch.int64)
    assert {t.dtype for name, t in tensors.items() if name != "head.vocab"} == {torch.float16}


def test_a_drafter_holding_a_scalar_tensor_is_one_line(drafter_files, tmp_path):
    """A tensor of no dimensions (a crafted file's) is hashed as its one value: the file is refused
    for what it holds, not with an error from the digest."""
    from safetensors import safe_open

    with safe_open(str(drafter_files["eagle", "exact"]), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    assert store.drafter_digest({"x": torch.tensor(1.0)}, {}) != store.drafter_digest({"x": torch.tensor(2.0)}, {})
    path = tmp_path / "scalar.safetensors"
    for crafted, problem in (({**tensors, "extra": torch.tensor(1.0, dtype=torch.float16)}, "Unexpected key"),
                             ({**tensors, "head.vocab": torch.tensor(5)}, "head.vocab is not a list")):
        _crafted(drafter_files["eagle", "exact"], path, crafted, redigest=True)
        with pytest.raises(InvalidModel, match=problem):
            store.load(tiny().backend, "eagle", path)


def test_a_tensor_reshaped_under_its_saved_digest_is_damaged(drafter_files, tmp_path):
    """The digest covers each tensor's name and shape, not only its bytes: the same bytes under
    another shape are a damaged file, said so, not taken for another network."""
    path = tmp_path / "reshaped.safetensors"
    from safetensors import safe_open

    with safe_open(str(drafter_files["eagle", "exact"]), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    name = next(n for n, t in tensors.items() if t.dim() == 2 and t.is_floating_point())
    _crafted(drafter_files["eagle", "exact"], path, {**tensors, name: tensors[name].reshape(-1)})
    with pytest.raises(InvalidModel, match="damaged"):
        store.load(tiny().backend, "eagle", path)


def test_a_drafter_whose_metadata_was_edited_under_its_saved_digest_is_damaged(drafter_files, tmp_path):
    """The digest covers the metadata that shapes the network and says whose it is, not only the
    weights: any config field (heads, head_dim, rope_theta...), the kind or the target record edited
    under the saved digest is refused as damaged, not built into another network; untouched, it loads."""
    backend, source = tiny().backend, drafter_files["eagle", "exact"]
    untouched = tmp_path / "untouched.safetensors"
    meta = _crafted(source, untouched)[1]
    assert store.load(backend, "eagle", untouched) is not None
    config = json.loads(meta["config"])
    edits = [{"config": json.dumps({**config, key: value * 2})} for key, value in config.items()]
    edits += [{"kind": "medusa"}, {"target": "0" * 32}, {"target_name": "other-llama"}]
    for i, edit in enumerate(edits):
        path = tmp_path / f"edited-{i}.safetensors"
        _crafted(source, path, **edit)
        with pytest.raises(InvalidModel, match=r"damaged \(its weights or metadata do not match the digest"):
            store.load(backend, "eagle", path)


def test_a_file_whose_metadata_names_no_target_is_not_a_drafter(drafter_files, tmp_path):
    """Kind, config and target are what make a drafter file: without a target it is one line, not a KeyError."""
    path = tmp_path / "no-target.safetensors"
    _crafted(drafter_files["medusa", "exact"], path, target=None)
    with pytest.raises(InvalidModel, match="not a decodekit drafter"):
        store.load(tiny().backend, "medusa", path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.uint8, torch.int8])
def test_a_head_whose_token_ids_are_not_integers_is_refused(drafter_files, tmp_path, dtype):
    """head.vocab holds token ids: stored as floats (even whole ones), as truth values or as bytes
    ([False, True] would read as ids 0 and 1) it is no drafter of ours."""
    from safetensors import safe_open

    path = tmp_path / "odd-vocab.safetensors"
    with safe_open(str(drafter_files["eagle", "exact"]), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    crafted = {**tensors, "head.vocab": tensors["head.vocab"][:2].to(dtype)}
    _crafted(drafter_files["eagle", "exact"], path, crafted, redigest=True)
    with pytest.raises(InvalidModel, match="head.vocab is not a list of token ids"):
        store.load(tiny().backend, "eagle", path)


def test_a_drafter_of_another_width_is_refused_though_its_header_names_the_target(drafter_files, tmp_path):
    """A drafter whose network is narrower or wider than the target's hidden size cannot read its
    features: one line, whatever fingerprint its header carries."""
    wide = tiny(hidden_size=128)
    path = tmp_path / "other-width.safetensors"
    _crafted(drafter_files["eagle", "exact"], path, redigest=True, target=store.target_fingerprint(wide.backend))
    with pytest.raises(InvalidParameter, match="does not fit"):
        store.build(path, "eagle", wide.backend)


def test_a_shipped_drafter_for_another_model_is_not_used(drafter_files, monkeypatch, tmp_path):
    """The package's drafters are the embedded model's: one trained for another target is passed
    over, and the message says how to train one for this model."""
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path / "cache"))
    package = tmp_path / "package"
    package.mkdir()
    (package / "tiny-medusa.safetensors").write_bytes(drafter_files["medusa", "exact"].read_bytes())
    monkeypatch.setattr(store, "SHIPPED", package)
    assert store.shipped(tiny().backend, "medusa") == package / "tiny-medusa.safetensors"
    other = tiny(seed=1)
    assert store.shipped(other.backend, "medusa") is None
    with pytest.raises(InvalidParameter, match="no medusa drafter for .*train-drafter"):
        store.load(other.backend, "medusa")


def test_the_fingerprint_of_a_model_in_memory_covers_every_row_of_its_head():
    """A model built in memory is fingerprinted by its whole output head: two heads that differ
    only in the last token's row are two models."""
    import types

    def fingerprint(head: torch.Tensor) -> str:
        backend = types.SimpleNamespace(weights_files=[], info=types.SimpleNamespace(vocab_size=head.shape[0]),
                                        head_rows=lambda ids: head[ids], memory=lambda key, compute: compute())
        return store.target_fingerprint(backend)

    head = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
    last_changed, first_changed = head.clone(), head.clone()
    last_changed[-1, 0] += 1
    first_changed[0, 0] += 1
    assert fingerprint(head) == fingerprint(head.clone())
    assert fingerprint(head) != fingerprint(last_changed) and fingerprint(head) != fingerprint(first_changed)


def test_a_save_that_fails_leaves_no_file_behind(drafter_files, monkeypatch, tmp_path):
    """A drafter is written under a temporary name and moved into place: a write that fails leaves
    neither a drafter nor a half-written file in the folder."""
    model = tiny()
    net = store.build(drafter_files["medusa", "exact"], "medusa", model.backend)

    def failing(state, path, metadata):
        path.write_bytes(b"half a drafter")
        raise OSError("disk full")

    monkeypatch.setattr(store, "save_tensors", failing)
    folder = tmp_path / "drafters"
    with pytest.raises(OSError, match="disk full"):
        store.save(net, "medusa", model.backend, folder / "tiny-medusa.safetensors", {})
    assert list(folder.iterdir()) == []


def test_eagle_unrolled_steps_learn_from_their_inputs_as_constants():
    """Step s of an unrolled loss reads the features step s - 1 predicted, detached: its gradient is
    that of its own loss with those inputs held fixed (the earlier steps' keys it attends to still
    learn from it), so the total gradient is the first step's plus the second's (and not through the
    first step's predictions again)."""
    g = torch.Generator().manual_seed(3)
    features, embeds = torch.randn(1, 9, 8, generator=g), torch.randn(1, 9, 8, generator=g)
    mask = torch.ones(1, 9, dtype=torch.bool)

    def gradients(loss: torch.Tensor, net) -> list[torch.Tensor]:
        loss.backward()
        return [p.grad.clone() for p in net.parameters() if p.grad is not None]

    net = small_eagle()
    both = gradients(net.loss(features, embeds, mask, noise=0.0, unroll=2)[0], net)
    net = small_eagle()
    first = gradients(net.loss(features, embeds, mask, noise=0.0, unroll=1)[0], net)
    net = small_eagle()
    first_step, (k, v) = net(features[:, :-1], embeds[:, 1:], torch.arange(8), torch.ones(8, 8, dtype=torch.bool).tril())
    visible = torch.cat([torch.ones(7, 7, dtype=torch.bool).tril(), torch.eye(7, dtype=torch.bool)], 1)
    predicted, _ = net(first_step.detach()[:, :-1], embeds[:, 2:], torch.arange(1, 8), visible, (k[:, :, :7], v[:, :, :7]))
    second = gradients(net._scored(predicted, features[:, 2:], mask[:, 2:].float(), 0.1)[0], net)
    assert len(both) == len(first) == len(second) > 0
    assert all(torch.allclose(b, f + s, rtol=1e-4, atol=1e-6) for b, f, s in zip(both, first, second))


def test_eagle_unrolled_steps_predict_what_drafting_predicts_at_each_depth():
    """Step s of the unrolled loss trains the pair a depth-s draft node runs, in the context drafting
    gives it (EAGLE-3's training-time test): the target's features up to the draft's start, then the
    node's ancestors on its path. Drafting is spelt out here as EagleDrafter runs it: the prefix's
    pairs in one pass, then one pair a level with the cache of the levels before."""
    g = torch.Generator().manual_seed(5)
    features, embeds = torch.randn(1, 9, 8, generator=g), torch.randn(1, 9, 8, generator=g)
    net = small_eagle()
    with torch.no_grad():
        steps = net.unrolled(features[:, :-1], embeds, 3)
        assert [tuple(t.shape) for t in steps] == [(1, 8, 8), (1, 7, 8), (1, 6, 8)]
        for start in range(6):  # the draft starts after the target's features 0..start
            n = start + 1
            out, (k, v) = net(features[:, :n], embeds[:, 1 : n + 1], torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
            feature = out[:, -1:]
            assert torch.allclose(feature, steps[0][:, start : start + 1], atol=1e-5)
            for depth in (1, 2):  # the node's pair: its parent's predicted feature, its own token
                if start + depth >= 8:
                    break
                out, (k_new, v_new) = net(feature, embeds[:, start + depth + 1 : start + depth + 2],
                                          torch.tensor([start + depth]), torch.ones(1, k.shape[2] + 1, dtype=torch.bool), (k, v))
                k, v = torch.cat([k, k_new], 2), torch.cat([v, v_new], 2)
                feature = out
                assert torch.allclose(feature, steps[depth][:, start : start + 1], atol=1e-5), (start, depth)


def test_a_training_without_a_time_limit_records_its_minutes_as_json_can_read_them():
    """``--minutes inf --steps N`` trains N steps whatever the machine: the report (printed, and kept
    in the drafter file) records no time limit as null, never as Infinity, which strict JSON refuses."""
    import json
    from types import SimpleNamespace

    corpus = SimpleNamespace(tokens=10, samples=[1], queries_drafted=1, seconds=1.0)
    outcome = SimpleNamespace(seconds=2.0, steps=3, tokens_seen=30, first_loss=2.0, last_loss=1.0)
    unbounded = report(Settings("eagle", minutes=float("inf"), steps=3), corpus, outcome, {})
    assert unbounded["settings"]["minutes"] is None and unbounded["settings"]["steps"] == 3
    json.dumps(unbounded, allow_nan=False)  # strict JSON: raises on an infinity
    assert report(Settings("eagle", minutes=2.5, steps=3), corpus, outcome, {})["settings"]["minutes"] == 2.5


def test_eagle_unroll_reaches_the_training_loss():
    model = tiny()
    samples = corpus_of(model, count=2).samples
    settings = Settings("eagle", minutes=1, steps=1, vocab=64, batch_tokens=256, unroll=2)
    net = new_net("eagle", model.backend, draft_vocabulary(samples, settings.vocab, 96), settings)
    outcome = train(net, samples, model.backend, settings)
    assert "regression_2" in outcome.metrics


def fake_tokenizer(encode):
    return SimpleNamespace(prompt_prefix=(1,), encode=encode,
                           chat_prompt=lambda messages: f"<u>{messages[-1]['content']}</u><a>")


def test_the_pre_query_template_and_the_query_start_keep_the_prompt_prefix():
    from decodekit.speculative.trained.data import chat_ids, pre_query

    tok = fake_tokenizer(lambda text: [ord(c) for c in text])
    assert pre_query(tok) == [1, *map(ord, "<u>")]
    ids, start = chat_ids(tok, "hi there")
    assert start == 4 and ids[:start] == pre_query(tok)


def test_the_query_start_is_0_where_the_templates_tokens_do_not_begin_the_prompt():
    from decodekit.speculative.trained.data import chat_ids

    tok = fake_tokenizer(lambda text: [ord(c) for c in reversed(text)])
    assert chat_ids(tok, "hi there")[1] == 0


def test_the_saved_drafter_records_its_evaluation(monkeypatch, tmp_path, capsys):
    from decodekit.speculative.trained import cli

    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    queries = iter([[f"query number {i} about things" for i in range(4)] for _ in range(200)])
    monkeypatch.setattr(data_module, "draft_queries", lambda *args, **kwargs: next(queries))
    model = tiny()
    args = train_args(kind="medusa", tokens=400, prompts="magpie", minutes=1, steps=5, vocab=64, seed=0,
                      eval_queries=2, unroll=1, max_new_tokens=16, out=None)
    assert cli.run(args, model=model) == 0
    printed = json.loads(capsys.readouterr().out)
    _, meta = store.read(store.cache_path(model.backend, "medusa"))
    assert json.loads(meta["trained"])["evaluation"] == printed["evaluation"]
