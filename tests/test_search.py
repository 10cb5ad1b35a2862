"""Search methods on tiny random models and on a hand-made bigram model."""

from __future__ import annotations

import math

import pytest
import torch

from decodekit.engine import Engine, build_decoder, make_sampler
from decodekit.engine.core import Request
from decodekit.errors import InvalidParameter
from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.backend import Backend, ModelInfo, StepOutput
from decodekit.models.tiny import tiny_llama
from decodekit.search import SampleDecoder, decode_batch, majority_vote, mbr_select
from decodekit.search.batch import Sample, StepRecorder, step_done
from decodekit.search.beam import gnmt_penalty
from decodekit.search.cache import PrefixCache
from decodekit.search.cot import answer_token_span, choose_path, path_confidence
from decodekit.search.select import chrf_utility, first_finished
from decodekit.search.steps import ParticleFilter, effective_sample_size
from tests.marks import needs_fast_numerics

TOK = CharTokenizer(96)


def cid(c: str) -> int:
    return TOK.encode(c)[0]


class BigramBackend(Backend):
    """Logits depend on the last token only: ``table[last]``. Exact arithmetic for controlled tests."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        v = table.shape[0]
        self.info = ModelInfo("bigram", v, 1, 1, 4096, torch.float32, "bigram")
        self.reset(1)

    @property
    def length(self) -> int:
        return len(self.rows[0])

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def reset(self, batch_size: int = 1) -> None:
        self.rows = [[] for _ in range(batch_size)]

    def append(self, tokens, *, hidden_layers=(), skip_layers=frozenset(), last_only=False) -> StepOutput:
        for row, new in zip(self.rows, tokens.tolist()):
            row.extend(new)
        logits = self.table[tokens]
        return StepOutput(logits=logits[:, -1:] if last_only else logits)

    def truncate(self, length: int) -> None:
        self.rows = [r[:length] for r in self.rows]

    def reorder(self, rows) -> None:
        self.rows = [list(self.rows[i]) for i in rows.tolist()]

    def verify_tree(self, tokens, parents):
        raise NotImplementedError

    def commit_path(self, nodes):
        raise NotImplementedError


def bigram_model(rules: dict[str, dict[str, float]], floor: float = -30.0) -> LoadedModel:
    """``rules[prev][next] = logit`` over CharTokenizer ids ("" = EOS); unlisted logits are ``floor``."""
    table = torch.full((96, 96), floor)
    for prev, nexts in rules.items():
        for nxt, logit in nexts.items():
            table[cid(prev), 0 if nxt == "" else cid(nxt)] = logit
    return LoadedModel(BigramBackend(table), TOK, "bigram")


def random_bigram(seed: int, chars: str = "ab c", eos_logit: float = -1.0) -> LoadedModel:
    g = torch.Generator().manual_seed(seed)
    rules = {p: {n: float(torch.randn(1, generator=g)) for n in chars} | {"": eos_logit} for p in chars + "p"}
    return bigram_model(rules)


@pytest.fixture
def tiny() -> LoadedModel:
    return LoadedModel(backend=tiny_llama(seed=0), tokenizer=TOK, name="tiny")


def request(model: LoadedModel, prompt: str, method: str = "sample", seed: int = 0, max_new: int = 20, **sampler) -> Request:
    return Request(TOK.encode(prompt), make_sampler(method, {"seed": seed, **sampler}), max_new)


# Batched sampling ------------------------------------------------------------------------------


def test_batch_rows_are_sequential_samples_with_their_own_seed(tiny):
    samples = decode_batch(tiny, request(tiny, "hello", seed=7, max_new=24), 4)
    engine = Engine(tiny)
    for i, s in enumerate(samples):
        seq = engine.generate("hello", method="sample", seed=7 + i, max_new_tokens=24, chat=False)
        assert s.tokens == seq.tokens
    assert len({tuple(s.tokens) for s in samples}) > 1


@pytest.mark.parametrize("numerics", ["exact", pytest.param("fast", marks=needs_fast_numerics)])
def test_a_batch_rows_logits_are_bit_for_bit_those_of_one_sequence(numerics):
    """On the kernels of a model on GGUF blocks, a batch of rows runs as the pass batcher runs
    sequences (each row on its own slice of the cache): a row's logits are exactly those of the
    same tokens alone, so row i is the sample seeded seed + i, in ``fast`` too (whose 8-bit inputs
    turn the smallest difference into a different token within a few)."""
    backend = tiny_llama(seed=0, hidden_size=64, max_position=256, numerics=numerics, gguf_blocks=True)
    ids = TOK.encode("hello there")
    alone = backend.prefill(ids)
    steps = [backend.step(torch.tensor([t]))[0] for t in TOK.encode("abc")]
    batch = backend.prefill(ids, batch_size=3)
    assert torch.equal(batch, alone.expand(3, -1))
    for t, want in zip(TOK.encode("abc"), steps):
        assert torch.equal(backend.step(torch.tensor([t, t, t])), want.expand(3, -1))
    model = LoadedModel(backend=backend, tokenizer=TOK, name="tiny")
    samples = decode_batch(model, request(model, "hello", seed=7, max_new=24, temperature=1.0), 4)
    for i, sample in enumerate(samples):
        assert sample.tokens == Engine(model).generate("hello", method="sample", seed=7 + i, max_new_tokens=24,
                                                       chat=False).tokens


def test_batch_is_reproducible_and_records_each_step(tiny):
    a = decode_batch(tiny, request(tiny, "abc", seed=3), 3)
    b = decode_batch(tiny, request(tiny, "abc", seed=3), 3)
    assert [s.tokens for s in a] == [s.tokens for s in b]
    for s in a:
        assert len(s.logprobs) == len(s.certainty) == len(s.margin) == len(s.topk) == len(s.tokens)
        assert all(lp <= 0 for lp in s.logprobs) and all(0 <= m <= 1 for m in s.margin)


def test_ragged_rows_stop_on_their_own_and_batch_stops_when_all_done():
    model = random_bigram(0, eos_logit=0.5)
    samples = decode_batch(model, request(model, "p", seed=1, max_new=40), 8)
    reasons = {s.finish_reason for s in samples}
    assert "eos" in reasons
    for s in samples:
        assert 0 not in s.tokens
        if s.finish_reason == "eos":
            assert s.eos_logprob is not None and s.choices == len(s.tokens) + 1


def test_a_row_ending_on_eos_records_the_eos_choices_own_log_prob():
    """eos_logprob is the log-prob of choosing EOS at the step after the last token (not the last
    token's): p -> a (logits a 2, b 1), then a -> EOS (logits EOS 3, c 0), the rest at -30."""
    model = bigram_model({"p": {"a": 2.0, "b": 1.0}, "a": {"": 3.0, "c": 0.0}})
    [s] = decode_batch(model, request(model, "p", method="greedy", max_new=5), 1)
    assert (s.tokens, s.finish_reason) == ([cid("a")], "eos")
    table = model.backend.table
    assert s.logprobs[0] == pytest.approx(float(torch.log_softmax(table[cid("p")], -1)[cid("a")]), abs=1e-6)
    assert s.eos_logprob == pytest.approx(float(torch.log_softmax(table[cid("a")], -1)[0]), abs=1e-6)
    assert s.loglik == pytest.approx(s.logprobs[0] + s.eos_logprob)


def test_tokens_spent_count_only_the_rows_still_decoding():
    """A finished row's pad feeds cost nothing: the spend is each row's own choices (EOS included)."""
    from decodekit.search.batch import SearchContext

    model = random_bigram(0, eos_logit=0.5)
    ctx = SearchContext(model, request(model, "p", seed=1, max_new=40))
    samples = ctx.decode(ctx.prompt, ctx.row_samplers(), range(8), 40)
    assert len({s.choices for s in samples}) > 1  # ragged
    assert ctx.spent == sum(s.choices for s in samples)


def test_first_finish_ends_the_batch_when_a_row_hits_a_stop_string():
    """A stop string finishes a row as EOS does: first-finish stops the whole batch there, every row
    having run as many steps as the winner."""
    model = random_bigram(1, eos_logit=-30.0)
    g = build_decoder("first-finish", n=4).generate(model, Request(TOK.encode("p"), make_sampler("sample", {"seed": 2}),
                                                                    40, stop="c"))
    assert g.finish_reason == "stop" and g.generated < 40
    assert g.stats.extra["tokens_spent"] == 4 * g.generated


def test_step_recorder_matches_hand_computed_statistics():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    rec = StepRecorder(topk=3)
    rec.add(logits, [1])
    lps, cert, margin, top, _ = rec.row(0, 1, False)
    p = torch.softmax(logits[0], -1)
    assert lps[0] == pytest.approx(math.log(p[1]), abs=1e-6)
    assert cert[0] == pytest.approx(float((0.25 * torch.log(0.25 / p)).sum()), abs=1e-6)  # KL(U || p)
    assert margin[0] == pytest.approx(float(p[0] - p[1]), abs=1e-6)
    assert top[0] == pytest.approx(torch.log(p[:3]).tolist(), abs=1e-6)


def test_sample_decoder_greedy_equals_engine_greedy(tiny):
    for prompt in ("hello world", "xyz"):
        plain = Engine(tiny).generate(prompt, max_new_tokens=30, chat=False)
        got = SampleDecoder().generate(tiny, request(tiny, prompt, method="greedy", max_new=30))
        assert got.tokens == plain.tokens and got.text == plain.text
        assert set(got.extra["uncertainty"]) >= {"phi_first", "self_certainty", "mean_logprob", "margin"}


def test_sample_decoder_names_its_mode_and_reads_phi_first_where_the_tasks_answer_starts(tiny):
    """extra['method'] says greedy or sample as the request's sampler does; the eval task's
    answer_start (not the last number's) places phi_first."""
    seen = []
    got = SampleDecoder(lambda text: seen.append(text) or 0).generate(tiny, request(tiny, "hi", method="greedy", max_new=8))
    assert got.extra["method"] == "greedy" and seen == [got.text]
    sampled = SampleDecoder().generate(tiny, request(tiny, "hi", method="sample", temperature=0.8, max_new=8))
    assert sampled.extra["method"] == "sample"


def test_prefix_cache_reuses_the_longest_common_prefix(tiny):
    cache = PrefixCache(tiny.backend)
    ids = TOK.encode("hello there")
    cache.fork(ids[:6], 3)
    before = cache.tokens_run
    logits = cache.fork(ids, 1)
    assert cache.tokens_run - before == len(ids) - 6
    fresh = tiny_llama(seed=0).prefill(ids)
    assert torch.allclose(logits, fresh, atol=1e-4)


def test_a_fork_after_steps_and_a_select_reuses_the_row_that_shares_the_most(tiny):
    """Rows grow with every step and follow a select: a new prefix is read from the row sharing the
    longest prefix with it (whichever row that is), running only its last id, with a fresh prefill's logits."""
    a, b, c, d, e, f, x = TOK.encode("abcdefx")
    ids = TOK.encode("hello")
    cache = PrefixCache(tiny.backend)
    cache.fork(ids, 3)
    cache.step([a, b, c])
    cache.step([d, e, f])
    before = cache.tokens_run
    logits = cache.fork(ids + [b, e, x], 1)
    assert cache.tokens_run - before == 1
    assert torch.allclose(logits, tiny_llama(seed=0).prefill(ids + [b, e, x]), atol=1e-4)
    cache.fork(ids, 2)
    cache.step([a, b])
    cache.select([1])
    before = cache.tokens_run
    logits = cache.fork(ids + [b, x], 1)
    assert cache.tokens_run - before == 1
    assert torch.allclose(logits, tiny_llama(seed=0).prefill(ids + [b, x]), atol=1e-4)


@torch.inference_mode()  # as the decoders run
def test_a_second_fork_of_the_same_ids_runs_no_pass_and_returns_their_logits(tiny):
    cache = PrefixCache(tiny.backend)
    ids = TOK.encode("hello there")
    first = cache.fork(ids, 1)
    want = first.clone()
    first[0, :5] = float("-inf")  # callers may change logits in place (CoT masks EOS)
    passes = cache.passes
    again = cache.fork(ids, 1)
    assert cache.passes == passes and torch.equal(again, want)
    again[0, 5:9] = float("-inf")
    assert torch.equal(cache.fork(ids, 3), want.expand(3, -1)) and cache.passes == passes
    cache.step([1, 2, 3])
    cache.fork(ids, 1)  # a pass ran since the last fork: the last id is run again
    assert cache.passes == passes + 2


def test_beam_and_cot_run_as_many_passes_as_greedy_for_greedys_tokens(tiny):
    for max_new in (1, 8):
        plain = Engine(tiny).generate("hello", max_new_tokens=max_new, chat=False, ignore_eos=True)
        for method in ("beam", "cot"):
            got = Engine(tiny).generate("hello", method=method, n=1, max_new_tokens=max_new, chat=False)
            assert got.tokens == plain.tokens, method
            assert got.stats.forward_passes == plain.stats.forward_passes, (method, max_new)


def test_step_done_needs_content_before_the_delimiter():
    assert not step_done("\n\n", "\n\n")
    assert step_done("\n\nStep one.\n\n", "\n\n")
    assert not step_done("Step one.\n", "\n\n")
    # the delimiter is a string, not a set of letters: "ep" and "Set " are content before "Step"
    assert step_done("epStep", "Step") and step_done("Set Step", "Step") and step_done("StepStepxStep", "Step")
    assert not step_done("Step Step", "Step") and not step_done(" StepStep", "Step")


# Beam search -------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["hello", "The cat", "zz"])
def test_beam_width_one_equals_greedy(tiny, prompt):
    plain = Engine(tiny).generate(prompt, max_new_tokens=25, chat=False)
    beam = Engine(tiny).generate(prompt, method="beam", n=1, max_new_tokens=25, chat=False)
    assert beam.tokens == plain.tokens


def test_beam_width_one_is_greedy_where_logits_tie():
    """Greedy decoding's argmax takes the lowest of tied tokens; a beam of width one does too (topk
    ordered ties as it liked: 'bbbb' against greedy's 'aaaa'); wider beams rank ties the same way."""
    from decodekit.search.beam import best_entries

    rules = {prev: {**{nxt: 1.0 for nxt in "abcd"}, "<eos>": -2.0} for prev in "pabcd"}
    model = bigram_model(rules)
    plain = Engine(model).generate("p", max_new_tokens=4, chat=False)
    assert plain.text == "aaaa" and Engine(model).generate("p", method="beam", n=1, max_new_tokens=4, chat=False).text == "aaaa"
    scores = torch.tensor([0.0, 2.0, 1.0, 2.0, 2.0, -1.0, 2.0])
    assert best_entries(scores, 3) == ([2.0, 2.0, 2.0], [1, 3, 4]) and best_entries(scores, 5)[1] == [1, 3, 4, 6, 2]


def test_full_relative_pruning_keeps_only_the_best_candidate(tiny):
    plain = Engine(tiny).generate("hello", max_new_tokens=20, chat=False)
    pruned = Engine(tiny).generate("hello", method="beam", n=4, prune_ratio=1.0, max_new_tokens=20, chat=False)
    assert pruned.tokens == plain.tokens


@pytest.mark.parametrize("ratio, kept", [(0.5, ["a"]), (0.3, ["a", "b"])])
def test_relative_pruning_drops_candidates_below_the_ratio_of_the_best(ratio, kept):
    """Freitag & Al-Onaizan's relative threshold: after "p", "b" has e^-1 (0.37) of "a"'s
    probability, so rp = 0.5 drops it and rp = 0.3 keeps it."""
    model = bigram_model({"p": {"a": 1.0, "b": 0.0}, "a": {"": 10.0}, "b": {"": 10.0}})
    beam = build_decoder("beam", n=2, length_penalty=0.0, prune_ratio=ratio)
    g = beam.generate(model, request(model, "p", method="beam", max_new=5))
    assert [c["text"] for c in g.extra["candidates"]] == kept


def test_beam_ranks_candidates_by_gnmt_normalised_score(tiny):
    g = Engine(tiny).generate("hi", method="beam", n=3, length_penalty=1.0, max_new_tokens=12, chat=False)
    scores = [c["score"] for c in g.extra["candidates"]]
    assert scores == sorted(scores, reverse=True)
    for c in g.extra["candidates"]:
        length = c["tokens"] + (c["finish_reason"] == "eos")
        assert c["score"] == pytest.approx(c["logp"] / gnmt_penalty(length, 1.0), abs=1e-3)
    assert gnmt_penalty(1, 0.6) == 1.0 and gnmt_penalty(7, 1.0) == 2.0


def test_beam_length_penalty_counts_the_eos_token():
    # From "p": "a" (logit 0) or EOS (logit x = 0.115); after "a", EOS is certain. Width 2 finishes
    # both hypotheses: "" + EOS (logP = x - s, |Y| = 1) and "a" + EOS (logP = -s, |Y| = 2), with
    # s = log(1 + e^x). With alpha = 1: lp(1) = 1, lp(2) = 7/6, so "" scores x - s = -0.6373 and
    # beats "a" at -6s/7 = -0.6448. Leaving EOS out of |Y| (lp(0) = 5/6, lp(1) = 1) flips the order.
    model = bigram_model({"p": {"a": 0.0, "": 0.115}, "a": {"": 10.0}})
    g = build_decoder("beam", n=2, length_penalty=1.0).generate(model, request(model, "p", method="greedy", max_new=5))
    s = math.log1p(math.exp(0.115))
    cands = g.extra["candidates"]
    # (a third, " " then EOS, far below: tied candidates at the floor are taken by lower id, EOS's 0 first)
    assert [(c["text"], c["finish_reason"]) for c in cands][:2] == [("", "eos"), ("a", "eos")]
    assert cands[0]["score"] == pytest.approx(0.115 - s, abs=2e-4)
    assert cands[1]["score"] == pytest.approx(-s * 6 / 7, abs=2e-4)
    assert cands[1]["logp"] == pytest.approx(-s, abs=2e-4)
    assert g.text == "" and g.finish_reason == "eos"


def beam(model: LoadedModel, n: int = 2, max_new: int = 5, **sampler):
    req = request(model, "p", method="beam", max_new=max_new, **sampler)
    return build_decoder("beam", n=n, length_penalty=0.0).generate(model, req)


def outcomes(g) -> list[tuple[str, str]]:
    return [(c["text"], c["finish_reason"]) for c in g.extra["candidates"]]


def test_beam_finishes_an_eos_candidate_only_when_it_ranks_within_the_width():
    """As Hugging Face's: of the 2·width candidates ranked, an EOS one ranked width or below (0-based)
    neither finishes nor takes a beam's place. Width 2, from "p": "a" (log-prob -0.313) and "b"
    (-1.313). Step 2 ranks "a"+EOS (-0.313 - log(1 + e^-0.8) = -0.684), "ac" (-0.313 - 1.171 = -1.484),
    "b"+EOS (-1.313 - 0.313 = -1.626, rank 2: dropped) and "bd" (-2.626); "ac" and "bd" then end.
    Finishing "b" too would end the search at step 2 with "a" and "b"."""
    model = bigram_model({"p": {"a": 1.0, "b": 0.0}, "a": {"": 5.0, "c": 4.2}, "b": {"": 1.0, "d": 0.0},
                          "c": {"": 10.0}, "d": {"": 10.0}})
    assert outcomes(beam(model)) == [("a", "eos"), ("ac", "eos"), ("bd", "eos")]


def test_beam_keeps_width_live_hypotheses_when_an_eos_candidate_is_among_the_best():
    """2·width candidates are ranked per step, so an EOS among the best (which finishes) still leaves
    width beams: from "p", EOS (logit 2) finishes and both "a" (1) and "b" (0) go on; ranking only
    width candidates would drop "b"."""
    model = bigram_model({"p": {"": 2.0, "a": 1.0, "b": 0.0}, "a": {"": 10.0}, "b": {"": 10.0}})
    assert outcomes(beam(model)) == [("", "eos"), ("a", "eos"), ("b", "eos")]


def test_beam_at_max_new_tokens_unfinished_beams_compete_with_fewer_than_width_finished():
    """The module's promise: at max_new_tokens the unfinished beams compete as they are. From "p",
    "a" (log-prob 1 - log(e^2 + e + 1) = -0.408) and EOS (-1.408, within the width: finished) and
    "b" (-2.408); then "aa" and "bb" are certain. After 2 tokens "aa" (-0.408) beats the one finished
    hypothesis "" (-1.408)."""
    model = bigram_model({"p": {"a": 2.0, "": 1.0, "b": 0.0}, "a": {"a": 10.0, "": -50.0}, "b": {"b": 10.0, "": -50.0}})
    g = beam(model, max_new=2)
    assert outcomes(g) == [("aa", "length"), ("", "eos"), ("bb", "length")]
    assert g.text == "aa" and g.finish_reason == "length"


def test_beam_stops_once_width_hypotheses_have_finished():
    """HF's ``early_stopping=True``: from "p", "a" and "b" go on and both end on EOS at step 2, ranked 0
    and 1; two finished for width 2 end the search there (1 + 2 rows spent), before the unlikely
    beams left over would run a step."""
    model = bigram_model({"p": {"a": 1.0, "b": 0.0}, "a": {"": 10.0}, "b": {"": 10.0}})
    g = beam(model)
    assert outcomes(g) == [("a", "eos"), ("b", "eos")]
    assert g.stats.extra["tokens_spent"] == 3


def test_beam_never_extends_a_candidate_the_sampler_removed():
    """A token the sampler removed (top_k=1: every token but the best has logit -inf) is no candidate:
    width 3 keeps one beam, greedy's path, and never a hypothesis of log-probability -inf."""
    model = bigram_model({"p": {"a": 1.0, "b": 0.0}, "a": {"b": 1.0, "": 0.0}, "b": {"": 10.0}})
    g = beam(model, n=3, top_k=1)
    assert outcomes(g) == [("ab", "eos")]
    assert math.isfinite(g.extra["candidates"][0]["logp"])


@pytest.mark.parametrize("penalty, text", [({"repetition_penalty": 4.0}, "a"), ({"frequency_penalty": 1.5}, "pa")])
def test_beam_penalties_see_the_histories_plain_decoding_gives_them(penalty, text):
    """As in plain decoding, the repetition penalty counts the prompt and the frequency penalty the
    generated tokens only. From the prompt "p", "p" (logit 2) beats "a" (1) unless penalised: divided
    by 4 for the prompt's "p", it loses at once; less 1.5 once generated, it wins once, then loses."""
    model = bigram_model({"p": {"p": 2.0, "a": 1.0}, "a": {"": 10.0}})
    plain = build_decoder("greedy").generate(model, request(model, "p", method="greedy", max_new=5, **penalty))
    assert beam(model, n=1, **penalty).text == plain.text == text


# Multi-sample selection -------------------------------------------------------------------------


def test_majority_vote_returns_the_mode_and_breaks_ties_by_first_seen():
    assert majority_vote(["3", "5", "5", None, "3", "5"])[0] == "5"
    assert majority_vote(["b", "a", "a", "b"])[0] == "b"
    assert majority_vote([None, None])[0] is None
    assert majority_vote([None, None, "7"]) == ("7", {"7": 1.0})  # samples with no answer do not vote


def test_weighted_vote_weights_each_answer():
    winner, totals = majority_vote(["a", "b", "b"], [0.9, 0.3, 0.4])
    assert winner == "a" and totals == pytest.approx({"a": 0.9, "b": 0.7})


def test_self_consistency_returns_the_mode_of_its_samples(tiny):
    g = Engine(tiny).generate("hello", method="self-consistency", n=6, answer=lambda t: t[:1] or None,
                              max_new_tokens=10, chat=False, seed=2)
    answers = [c["answer"] for c in g.extra["candidates"]]
    assert g.extra["answer"] == majority_vote(answers)[0] == g.text[:1]
    assert g.extra["uncertainty"]["agreement"] == answers.count(g.extra["answer"]) / 6


def test_weighted_vote_end_to_end_follows_the_scorer(tiny):
    weight = lambda text: 10.0 if "a" in text else 0.1  # noqa: E731
    g = Engine(tiny).generate("hello", method="weighted-vote", n=6, answer=lambda t: t[:1] or None, scorer=weight,
                              max_new_tokens=10, chat=False, seed=5)
    cands = g.extra["candidates"]
    assert [c["score"] for c in cands] == [weight(c["text"]) for c in cands]
    assert g.extra["answer"] == majority_vote([c["answer"] for c in cands], [c["score"] for c in cands])[0]


def test_best_of_n_picks_the_highest_log_likelihood(tiny):
    g = Engine(tiny).generate("hello", method="best-of-n", n=5, max_new_tokens=8, chat=False, seed=1)
    scores = [c["score"] for c in g.extra["candidates"]]
    assert g.extra["chosen"] == scores.index(max(scores))
    assert g.text == g.extra["candidates"][g.extra["chosen"]]["text"]


def test_a_sample_a_stop_string_cut_scores_the_stops_tokens_as_an_eos():
    """After "p" the model writes "a" (about 0.95) or the stop string "c" (about 0.05). A sample cut
    at the stop keeps no token, but the model's choice to end there counts in its score, as an EOS
    does: it scored a perfect 0 and won best-of-n over every "ab"."""
    model = bigram_model({"p": {"a": 3.0, "c": 0.0}, "a": {"b": 5.0}, "b": {"": 5.0}, "c": {"": 5.0}})
    request = Request(TOK.encode("p"), make_sampler("best-of-n", {"seed": 0}), 10, stop=["c"])
    g = build_decoder("best-of-n", n=16, sample_temperature=1.0).generate(model, request)
    cut = [c for c in g.extra["candidates"] if c["finish_reason"] == "stop"]
    assert cut and all(c["text"] == "" and c["loglik"] < -2.5 for c in cut)  # log 0.05 = -3
    assert g.text == "ab"


def test_self_certainty_of_a_near_uniform_row_is_never_negative():
    """KL(U || p) >= 0, but computed as -log V - mean(log p) a near-uniform row rounds to about
    -1e-7, which the self-certainty scorer (declared non-negative) refuses in weighted votes."""
    from decodekit.search.batch import StepRecorder

    recorder = StepRecorder()
    for seed in range(8):  # rows of logits 1e-5 apart: several of them round below 0
        recorder.add(torch.randn(4, 96, generator=torch.Generator().manual_seed(seed)) * 1e-5, [0] * 4)
    assert min(min(step.tolist()) for step in recorder.certainty) >= 0.0


def test_best_of_n_ties_go_to_the_first_sample():
    """BestOfN's documented tie rule: of equal scores, the first sample wins."""
    from decodekit.search.select import BestOfN

    samples = [Sample([i], [lp], [], [], [], "length") for i, lp in enumerate([-2.0, -0.5, -1.0, -0.5])]
    index, scores = BestOfN(n=4).choose(None, samples, [None] * 4)
    assert scores == [-2.0, -0.5, -1.0, -0.5] and index == 1


def test_mbr_picks_the_medoid():
    numbers = ["1", "2", "3", "10", "4"]
    index, expected = mbr_select(numbers, lambda a, b: -abs(int(a) - int(b)))
    assert numbers[index] == "3"
    # each mean is over the 4 others, the sample itself left out: "3" is -(2 + 1 + 7 + 1) / 4
    assert expected == [-15 / 4, -12 / 4, -11 / 4, -30 / 4, -12 / 4]
    texts = ["the cat sat on the mat", "the cat sat on a mat", "a cat sat on the mat", "dogs bark loudly"]
    index, expected = mbr_select(texts, chrf_utility())
    assert index == 0 and min(expected) == expected[3]


def test_first_finish_returns_the_shortest_finished_sample():
    model = random_bigram(1, eos_logit=0.0)
    req = request(model, "p", seed=4, max_new=40)
    samples = decode_batch(model, req, 6)
    finished = [s for s in samples if s.finish_reason == "eos"]
    assert finished, "the test model should end some samples"
    g = build_decoder("first-finish", n=6).generate(model, request(model, "p", seed=4, max_new=40))
    shortest = min(len(s.tokens) for s in finished)
    assert len(g.tokens) == shortest and g.finish_reason == "eos"
    assert g.tokens in [s.tokens for s in finished]
    assert g.stats.extra["tokens_spent"] <= 6 * (shortest + 1)
    assert first_finished([Sample([1, 2], [], [], [], [], "eos"), Sample([1], [], [], [], [], "length")]) == 0
    # equally short finished samples: the higher log-likelihood (EOS choice included) wins, wherever it stands
    likely = Sample([5, 6], [-0.5, -0.5], [], [], [], "eos", eos_logprob=-0.2)  # loglik -1.2
    unlikely = Sample([5, 7], [-0.5, -1.0], [], [], [], "eos", eos_logprob=-0.2)  # loglik -1.7
    stopped = Sample([5, 8, 9], [-0.1, -0.1, -0.1], [], [], [], "stop")  # loglik -0.3, 3 choices like the others
    assert first_finished([unlikely, likely]) == 1
    assert first_finished([likely, unlikely]) == 0
    assert first_finished([unlikely, stopped, likely]) == 1
    # a stop string's cut tokens were decoded: a row cut to 1 token after 4 steps finished after 4
    cut = Sample([5], [-0.1], [], [], [], "stop", cut_off=[8, 9, 9])
    assert cut.steps == 4 and first_finished([cut, likely]) == 1 and first_finished([cut, unlikely]) == 1



def test_first_finish_with_no_finished_sample_returns_the_first():
    """first_finished's documented fallback: 0 when no sample finished (EOS or stop string)."""
    samples = [Sample([1, 2], [-0.1, -0.1], [], [], [], "length"), Sample([3], [-0.5], [], [], [], "length")]
    assert first_finished(samples) == 0


def test_weighted_vote_refuses_a_negative_weight(tiny):
    """Weighted voting needs non-negative weights: a callable scorer giving a negative one is refused."""
    with pytest.raises(InvalidParameter, match="non-negative"):
        Engine(tiny).generate("hello", method="weighted-vote", n=3, scorer=lambda text: -1.0, max_new_tokens=4,
                              chat=False, seed=0)


# CoT-decoding ------------------------------------------------------------------------------------


def cot_model() -> LoadedModel:
    # First token: a > b > c. After a the digit is a near coin-flip (small margin), after b it is sure.
    return bigram_model({
        "p": {"a": 5.0, "b": 4.0, "c": 3.0},
        "a": {"1": 2.0, "7": 1.9}, "b": {"2": 6.0, "8": 0.0}, "c": {"3": 3.0, "9": 2.0},
        **{d: {"": 10.0} for d in "12378 9"},
    })


def test_cot_decoding_picks_the_max_confidence_path_over_the_greedy_one():
    model = cot_model()
    g = build_decoder("cot", n=3).generate(model, request(model, "p", method="greedy", max_new=5))
    paths = g.extra["candidates"]
    assert [p["first_token"] for p in paths] == ["a", "b", "c"]
    assert g.text == "b2" and g.extra["answer"] == "2"
    assert max(p["delta"] for p in paths) == paths[1]["delta"]


def test_cot_never_branches_on_eos():
    # EOS is the likeliest first token here: the k branches are the k likeliest others
    model = bigram_model({"p": {"": 9.0, "a": 5.0, "b": 4.0, "c": 3.0}, **{c: {"": 10.0} for c in "abc"}})
    g = build_decoder("cot", n=2).generate(model, request(model, "p", method="greedy", max_new=3))
    assert [p["first_token"] for p in g.extra["candidates"]] == ["a", "b"]


def test_cot_branches_on_the_first_tokens_of_the_processed_distribution():
    """The request's sampler (penalties included) shapes the first-token branches as it does every
    later token: with the prompt "ax", a repetition penalty of 4 takes "a" from logit 5 to 1.25,
    below "b" (4) and "c" (3)."""
    model = bigram_model({"x": {"a": 5.0, "b": 4.0, "c": 3.0}, **{c: {"": 10.0} for c in "abc"}})
    plain = build_decoder("cot", n=2).generate(model, request(model, "ax", method="greedy", max_new=3))
    assert [p["first_token"] for p in plain.extra["candidates"]] == ["a", "b"]
    req = request(model, "ax", method="greedy", max_new=3, repetition_penalty=4.0)
    g = build_decoder("cot", n=2).generate(model, req)
    assert [p["first_token"] for p in g.extra["candidates"]] == ["b", "c"]


def test_cot_continues_each_branch_greedily_even_when_the_request_samples(tiny):
    """CoT-decoding (Wang & Zhou, 2024) branches on the top-k first tokens and decodes each branch
    greedily: with a temperature given, each path is still the greedy continuation of its first token."""
    prompt = TOK.encode("hello")
    g = build_decoder("cot", n=3).generate(tiny, Request(prompt, make_sampler("cot", {"seed": 0, "temperature": 1.5}), 8))
    engine = Engine(tiny)
    for path in g.extra["candidates"]:
        first = TOK.encode(path["first_token"])
        rest = engine.generate(prompt + first, max_new_tokens=7, chat=False)
        assert path["text"] == path["first_token"] + rest.text


def test_cot_answer_span_and_aggregation():
    tokens = TOK.encode("x 12 y 345.")
    span = answer_token_span(tokens, TOK, "number")
    assert TOK.decode([tokens[i] for i in span]) == "345"
    assert answer_token_span(tokens, TOK, "text") == list(range(len(tokens)))
    assert path_confidence([0.1, 0.5, 0.9], [1, 2]) == pytest.approx(0.7)
    assert choose_path([0.5, 0.4, 0.3]) == 0
    assert choose_path([0.5, 0.4, 0.3], ["1", "2", "2"]) == 1  # answer "2" totals 0.7
    # the paper's aggregation sums Δ, it does not count paths: "1" (0.9) beats "2" (0.3 + 0.2) on two paths
    assert choose_path([0.9, 0.3, 0.2], ["1", "2", "2"]) == 0


def test_cot_takes_a_tasks_answer_extractor_and_answer_start():
    """An eval task's functions: its extractor gives the answers compared, its answer start the
    span whose margins make Δ (to the end of the line) and where phi_first is read."""
    model = cot_model()
    req = lambda: request(model, "p", method="greedy", max_new=5)
    by_number = build_decoder("cot", n=3).generate(model, req())
    g = build_decoder("cot", n=3, answer=lambda text: text[:1].upper(), answer_start=lambda text: 1).generate(model, req())
    assert [p["answer"] for p in g.extra["candidates"]] == ["A", "B", "C"]
    # the span after the first letter is the digit: the same Δ as the last-number span
    assert [p["delta"] for p in g.extra["candidates"]] == [p["delta"] for p in by_number.extra["candidates"]]
    whole = build_decoder("cot", n=3, answer=lambda text: text[:1], answer_start=lambda text: 0).generate(model, req())
    assert [p["delta"] for p in whole.extra["candidates"]] != [p["delta"] for p in g.extra["candidates"]]
    with pytest.raises(InvalidParameter, match="answer_start"):
        build_decoder("cot", n=3, answer_start=lambda text: -1).generate(model, req())
    # a built-in extractor given as a function (gsm8k's extract_number) is its mode: Δ over the last number
    from decodekit.search.answers import extract_number
    as_function = build_decoder("cot", n=3, answer=extract_number, answer_start=lambda text: 0).generate(model, req())
    assert [p["delta"] for p in as_function.extra["candidates"]] == [p["delta"] for p in by_number.extra["candidates"]]


def test_cot_branches_only_on_first_tokens_the_sampler_leaves_possible():
    """A truncating sampler (top_k=2) leaves two possible first tokens: asked for three branches,
    CoT-decoding takes those two, never a token the sampler ruled out (probability 0)."""
    model = cot_model()
    g = build_decoder("cot", n=3).generate(model, request(model, "p", method="cot", max_new=5, top_k=2))
    assert [p["first_token"] for p in g.extra["candidates"]] == ["a", "b"]
    assert g.text == "b2"


def test_cot_with_only_an_end_of_text_left_returns_the_empty_answer():
    """Where the sampler (top_k=1) leaves only EOS possible first, there is no first token to branch
    on: the one path is the empty answer, never a token the sampler removed (a top-k of an all -inf
    row gives id 0, here a character; EOS is put elsewhere so that the two differ)."""
    tokenizer = CharTokenizer(96)
    tokenizer.eos_token_ids = frozenset({cid("z")})
    table = torch.full((96, 96), -30.0)
    table[cid("p"), cid("z")], table[cid("p"), cid("a")] = 9.0, 5.0
    table[0, cid("q")] = table[cid("a"), cid("z")] = table[cid("q"), cid("z")] = 10.0
    model = LoadedModel(BigramBackend(table), tokenizer, "bigram")
    req = Request(tokenizer.encode("p"), make_sampler("cot", {"seed": 0, "top_k": 1}), 3)
    g = build_decoder("cot", n=3).generate(model, req)
    assert g.tokens == [] and g.text == "" and g.finish_reason == "eos"
    assert len(g.extra["candidates"]) == 1


def test_cot_aggregate_reports_the_confidence_of_the_path_it_returns():
    """With aggregate=True the answer "2" (two paths of Δ about 0.64 each) outweighs "1" (one path of
    Δ about 0.90): the path returned is a "2" path, and its uncertainty signals (Δ included) are that
    path's, not those of the path of highest Δ."""
    model = bigram_model({
        "p": {"a": 5.0, "b": 4.0, "c": 3.0},
        "a": {"1": 3.0, "7": 0.0}, "b": {"2": 1.5, "8": 0.0}, "c": {"2": 1.5, "9": 0.0},
        **{d: {"": 10.0} for d in "12789"},
    })
    g = build_decoder("cot", n=3, aggregate=True).generate(model, request(model, "p", method="greedy", max_new=5))
    paths = g.extra["candidates"]
    deltas = [p["delta"] for p in paths]
    assert [p["answer"] for p in paths] == ["1", "2", "2"]
    assert deltas[0] == max(deltas) and deltas[1] + deltas[2] > deltas[0]  # the set-up the test needs
    chosen = g.extra["chosen"]
    assert paths[chosen]["answer"] == "2" == g.extra["answer"] and g.text == paths[chosen]["text"]
    assert g.extra["uncertainty"]["delta"] == pytest.approx(paths[chosen]["delta"], abs=1e-6)
    alone = build_decoder("cot", n=3).generate(model, request(model, "p", method="greedy", max_new=5))
    assert alone.extra["chosen"] == 0 and alone.extra["uncertainty"]["delta"] == pytest.approx(deltas[0], abs=1e-6)


def test_cot_an_answer_start_past_the_text_takes_the_whole_continuation():
    """An answer start whose line holds no text (here: the end of the continuation) gives no answer
    span: Δ falls back to the whole continuation, as with no answer start at all, not to 0."""
    model = cot_model()
    req = lambda: request(model, "p", method="greedy", max_new=5)
    whole = build_decoder("cot", n=3, answer="text").generate(model, req())
    past = build_decoder("cot", n=3, answer="text", answer_start=lambda text: len(text)).generate(model, req())
    assert [p["delta"] for p in past.extra["candidates"]] == [p["delta"] for p in whole.extra["candidates"]]
    assert all(p["delta"] > 0 for p in past.extra["candidates"])


# Step-level search ---------------------------------------------------------------------------------


def test_particle_filter_with_a_constant_scorer_is_independent_sampling():
    model = random_bigram(2, eos_logit=-0.5)
    opts = dict(n=4, scorer=lambda text: 0.0, delimiter=" ", max_step_tokens=5)
    g = build_decoder("particle", **opts).generate(model, request(model, "p", seed=0, max_new=30))
    independent = decode_batch(model, request(model, "p", seed=0, max_new=30), 4)
    assert g.extra["resamples"] == 0
    assert [c["text"] for c in g.extra["candidates"]] == [s.text for s in independent]
    assert any(len(c["step_scores"]) > 1 for c in g.extra["candidates"])


@pytest.mark.parametrize("method", ["step-beam", "particle", "astar"])
def test_a_step_search_reads_phi_first_where_the_tasks_answer_starts(method):
    """An eval task's answer_start (as for the voting methods and CoT), not the last number's."""
    model = random_bigram(2, eos_logit=-0.5)
    seen = []
    opts = dict(n=2, scorer=lambda text: 0.0, delimiter=" ", max_step_tokens=5)
    g = build_decoder(method, **opts, answer_start=lambda text: seen.append(text) or 0).generate(
        model, request(model, "p", seed=0, max_new=12))
    assert seen[-1] == g.text
    with pytest.raises(InvalidParameter, match="answer_start"):
        build_decoder(method, **opts, answer_start=lambda text: len(text) + 1).generate(
            model, request(model, "p", seed=0, max_new=12))


def test_particle_filter_resamples_when_weights_degenerate():
    model = random_bigram(3, eos_logit=-1.0)
    score = lambda text: 20.0 * text.count("a")  # noqa: E731
    g = build_decoder("particle", n=6, scorer=score, delimiter=" ", ess_threshold=1.0).generate(
        model, request(model, "p", seed=1, max_new=30))
    assert g.extra["resamples"] >= 1
    assert effective_sample_size([0.0, 0.0, 0.0, 0.0]) == pytest.approx(4.0)
    assert effective_sample_size([0.0, -100.0, -100.0]) == pytest.approx(1.0)


# A toy step problem: from "p" the model writes "x" and stops, or "y " and then "z" and stops, with
# probability 1/2 each; the scorer rates each prefix by a fixed table (aggregate="last", so a
# particle's value is the score of its current prefix).
FORK_RULES = {"p": {"x": 0.0, "y": 0.0}, "x": {"": 0.0}, "y": {" ": 0.0}, " ": {"z": 0.0}, "z": {"": 0.0}}
FORK_SCORES = {"x": math.log(3.0), "y ": 0.0, "y z": math.log(3.0)}


def fork_filter(n: int, **opts) -> ParticleFilter:
    return build_decoder("particle", n=n, scorer=lambda text: FORK_SCORES[text], delimiter=" ",
                         aggregate="last", **opts)


def test_particle_weights_are_current_prefix_scores_and_finished_keep_theirs(monkeypatch):
    model = bigram_model(FORK_RULES)
    seen = []
    original = ParticleFilter._resample

    def spy(particles, log_w, resampler):
        seen.append(([TOK.decode(p.sample.tokens) for p in particles], list(log_w)))
        return original(particles, log_w, resampler)

    monkeypatch.setattr(ParticleFilter, "_resample", staticmethod(spy))
    for seed in range(0, 70, 7):
        fork_filter(6, weight_temperature=0.5, ess_threshold=1.0).generate(model, request(model, "p", seed=seed, max_new=10))
    # a resample after every step (the reference's schedule), so a weight is one prefix's score;
    # "x" is finished from step 1 on and still weighs its final score at step 2
    assert any({"x", "y z"} <= set(texts) for texts, _ in seen)
    for texts, log_w in seen:
        assert log_w == pytest.approx([FORK_SCORES[t] / 0.5 for t in texts])


def test_particle_filter_selects_as_the_reference_on_a_toy_posterior():
    # Resampling after each step with weights exp(prefix score): "x" weighs 3 at both steps, "y "
    # weighs 1 then "y z" 3. For n particles, k ~ Bin(n, 1/2) are "x" after step 1; resampling keeps
    # k1 ~ Bin(n, 3k / (3k + n - k)) of them; after step 2 each final particle is "x" with
    # probability q2 = 3 k1 / (3 k1 + 3 (n - k1)). Old behaviour (finished particles weigh 1
    # after a reset) gives 0.537 instead of 0.724.
    n, runs = 8, 200

    def binom(m: int, q: float) -> list[float]:
        return [math.comb(m, k) * q**k * (1 - q) ** (m - k) for k in range(m + 1)]

    mean = second = 0.0
    for k, pk in enumerate(binom(n, 0.5)):
        for k1, pk1 in enumerate(binom(n, 3 * k / (3 * k + n - k))):
            q2 = k1 / n
            mean += pk * pk1 * q2
            second += pk * pk1 * (q2 * (1 - q2) / n + q2 * q2)
    sd = math.sqrt(second - mean * mean)
    assert mean == pytest.approx(0.7242, abs=1e-4)

    model = bigram_model(FORK_RULES)
    decoder = fork_filter(n, ess_threshold=1.0)
    shares = []
    for r in range(runs):  # seeds n + 1 apart: no particle or resampler stream is shared between runs
        g = decoder.generate(model, request(model, "p", seed=r * (n + 1), max_new=10))
        shares.append(sum(c["text"] == "x" for c in g.extra["candidates"]) / n)
    assert abs(sum(shares) / runs - mean) < 4 * sd / math.sqrt(runs)


def test_astar_respects_the_token_budget(tiny):
    for budget in (9, 30):
        g = Engine(tiny).generate("hello", method="astar", n=3, token_budget=budget, delimiter="e",
                                  max_step_tokens=6, max_new_tokens=60, chat=False, seed=1)
        assert 0 < g.stats.extra["tokens_spent"] <= budget
        assert len(g.tokens) <= budget
    with pytest.raises(InvalidParameter, match=r"token_budget \(2\) must be at least n \(3\)"):  # never an empty answer
        Engine(tiny).generate("hello", method="astar", n=3, token_budget=2, chat=False)
    assert Engine(tiny).generate("hello", method="astar", n=3, token_budget=3, chat=False, seed=1).tokens


def test_step_beam_returns_its_best_finished_solution():
    model = random_bigram(4, eos_logit=0.0)
    g = build_decoder("step-beam", n=2, expand=3, delimiter=" ").generate(model, request(model, "p", seed=2, max_new=25))
    values = [c["value"] for c in g.extra["candidates"]]
    assert all(c["done"] for c in g.extra["candidates"])
    assert g.extra["uncertainty"]["value"] == pytest.approx(max(values), abs=1e-5)


def test_step_searches_never_draw_with_a_slot_an_earlier_expansion_used(monkeypatch):
    """Draws are keyed by (slot's seed, position): an expansion reusing a slot that an earlier one
    drew with would redraw, from a kept prefix shorter than that one's, the positions it drew, with
    the same noise. Step-beam gives every expansion fresh slots; the particle filter, every round
    after a resample (here after each step)."""
    from decodekit.search.steps import StepSearch

    model = random_bigram(4, eos_logit=0.0)
    used: list[list[int]] = []
    expand = StepSearch.expand
    monkeypatch.setattr(StepSearch, "expand", lambda self, ctx, node, rows, slots, cap=None: (
        used.append(list(slots)), expand(self, ctx, node, rows, slots, cap))[1])
    for method, options in (("step-beam", {"n": 2, "expand": 3}), ("particle", {"n": 4, "ess_threshold": 1.0})):
        used.clear()
        build_decoder(method, delimiter=" ", **options).generate(model, request(model, "p", seed=2, max_new=25))
        slots = [s for call in used for s in call]
        assert len(used) > 2 and len(slots) == len(set(slots)), (method, used)


def test_bad_options_raise_one_line_errors():
    with pytest.raises(InvalidParameter):
        build_decoder("beam", n=0)
    with pytest.raises(InvalidParameter, match="no option"):
        build_decoder("self-consistency", width=3)
    with pytest.raises(InvalidParameter):
        build_decoder("best-of-n", scorer="bogus")
    with pytest.raises(InvalidParameter):
        build_decoder("particle", ess_threshold=2)
    assert build_decoder("beam", n="3").width == 3  # CLI strings are accepted when they parse


@pytest.mark.parametrize("method, options, message", [
    ("self-consistency", {"answer": lambda text: [text]}, "the answer callable must return a string or None"),
    ("best-of-n", {"answer_start": lambda text: "x"}, "the answer_start callable must return an offset"),
    ("best-of-n", {"answer_start": lambda text: len(text) + 1}, "the answer_start callable must return an offset"),
    ("mbr", {"utility": lambda hyp, ref: "x"}, "the utility callable must return a finite number"),
    ("mbr", {"utility": lambda hyp, ref: math.nan}, "the utility callable must return a finite number"),
    ("best-of-n", {"scorer": lambda text: "x"}, "the scorer callable must return a finite number"),
    ("best-of-n", {"scorer": lambda text: True}, "the scorer callable must return a finite number"),
    ("best-of-n", {"scorer": lambda text: 10**400}, "the scorer callable must return a finite number"),  # no float
    ("mbr", {"utility": lambda hyp, ref: 10**400}, "the utility callable must return a finite number"),
])
def test_a_python_callable_returning_the_wrong_thing_is_one_line(tiny, method, options, message):
    with pytest.raises(InvalidParameter, match=message):
        Engine(tiny).generate("hello", method=method, n=2, max_new_tokens=4, chat=False, seed=1, **options)


def test_particle_weight_temperature_is_its_own_option(tiny_model):
    # `temperature` belongs to the sampler; the weight temperature must still be reachable
    engine = Engine(tiny_model)
    out = engine.generate("ab", method="particle", n=2, weight_temperature=0.5, temperature=0.8, seed=0,
                          max_new_tokens=6, chat=False)
    assert out.tokens
    with pytest.raises(InvalidParameter, match="weight_temperature"):
        engine.generate("ab", method="particle", weight_temperature=0.0, max_new_tokens=4, chat=False)


def test_astar_gives_every_expansion_its_own_seeds(tiny, monkeypatch):
    """Draws are keyed by seed and position: two nodes expanded at the same position with the
    same slot seeds would get coupled samples, so each expansion takes fresh slots."""
    from decodekit.search.steps import StepSearch

    used: list[tuple[int, ...]] = []
    original = StepSearch.expand

    def spy(self, ctx, node, rows, slots, cap=None):
        used.append(tuple(rows.sampler(s).seed for s in slots))
        return original(self, ctx, node, rows, slots, cap)

    monkeypatch.setattr(StepSearch, "expand", spy)
    Engine(tiny).generate("hello", method="astar", n=3, token_budget=60, delimiter="e", max_step_tokens=6,
                          max_new_tokens=60, chat=False, seed=1)
    seeds = [s for expansion in used for s in expansion]
    assert len(used) > 1 and len(set(seeds)) == len(seeds)



def test_self_consistency_returns_the_first_sample_with_the_winning_answer():
    from decodekit.search.select import SelfConsistency

    answers = ["b", "a", "b", "a", "a", "b", "a"]
    index, _ = SelfConsistency(n=len(answers)).choose(None, [None] * len(answers), answers)
    assert index == 1  # "a" wins 4 to 3; its first sample is the second


def test_best_of_n_loglik_is_the_sum_of_the_samples_token_logprobs(tiny):
    """Recomputed independently: each candidate's tokens teacher-forced through the model."""
    g = Engine(tiny).generate("abc", method="best-of-n", n=4, temperature=1.0, seed=3, max_new_tokens=12, chat=False)
    prompt = TOK.encode("abc")
    for candidate in g.extra["candidates"]:
        tokens = TOK.encode(candidate["text"])
        assert len(tokens) == candidate["tokens"]
        if candidate["finish_reason"] == "eos":
            tokens = tokens + [min(TOK.eos_token_ids)]
        tiny.backend.reset(1)
        rows = tiny.backend.append(torch.tensor([prompt + tokens]))
        logprobs = torch.log_softmax(rows.logits[0, len(prompt) - 1 : -1].float(), dim=-1)
        total = logprobs.gather(-1, torch.tensor(tokens)[:, None]).sum().item()
        assert candidate["score"] == pytest.approx(total, abs=1e-3)
        assert candidate["loglik"] == pytest.approx(total, abs=1e-3)  # the candidate's record: the sum too


def test_every_search_stops_at_the_step_its_should_stop_says_so(tiny):
    """A search asks ``should_stop`` at every step, as the decode loop does (a server's client that
    went away frees its slot there), and ends "cancelled" with no text: it has no answer before its end."""
    from decodekit.engine import available_methods

    engine = Engine(tiny)
    searches = sorted(n for n, s in available_methods().items() if s.family == "search")
    assert len(searches) >= 10
    for method in searches:
        asked = []
        # seeded: a sample drawn with fresh entropy may end on EOS at once (first-finish then ends there)
        out = engine.generate("hello", method=method, n=2, max_new_tokens=40, chat=False, seed=0,
                              should_stop=lambda: asked.append(1) or len(asked) >= 3)
        assert (out.finish_reason, out.text, out.tokens, len(asked)) == ("cancelled", "", [], 3), method
        assert engine.generate("hello", method=method, n=2, max_new_tokens=40, chat=False).finish_reason != "cancelled"


@pytest.mark.parametrize("method", ["step-beam", "particle", "astar"])
def test_a_stop_string_across_steps_ends_a_step_search_there(tiny, method):
    """A step search decodes each step after the steps before it: a stop string that begins in one
    step and ends in the next (steps of four one-character tokens here: characters 3 and 4) ends
    the answer where it begins, as in plain decoding, and the step it ends in stops there."""
    engine = Engine(tiny)
    kw = dict(method=method, n=1, max_new_tokens=20, seed=3, temperature=1.0, max_step_tokens=4, chat=False)
    if method == "step-beam":
        kw["expand"] = 1
    free = engine.generate("hello", **kw).text
    assert len(free) >= 7
    stop = free[3:5]
    out = engine.generate("hello", stop=[stop], **kw)
    assert (out.text, out.finish_reason) == (free[: free.index(stop)], "stop")
    assert len(out.tokens) == len(TOK.encode(out.text))
    assert out.stats.extra["tokens_spent"] == len(out.tokens) + len(stop)  # it stopped there, not at the end


@pytest.mark.parametrize("method", ["best-of-n", "self-consistency", "mbr", "first-finish", "weighted-vote", "particle"])
def test_more_samples_than_memory_holds_is_one_line_before_anything_is_built(tiny, method):
    """A search over n sequences at once refuses an n whose cache cannot fit, before it makes
    anything per sequence (a sampler per row, a particle per slot: millions of objects first)."""
    with pytest.raises(InvalidParameter, match="sequences of .* need a .* KV cache"):
        Engine(tiny).generate("hello", method=method, n=3 * 10**6, max_new_tokens=4, chat=False)


def test_a_particle_filter_too_large_for_memory_is_refused_before_its_first_particle(tiny, monkeypatch):
    """The particle filter asks for its n rows before it makes a particle per slot (the check that
    the first step's decode would make, millions of particles later)."""
    from decodekit.search import steps

    def built(cls):
        raise AssertionError("a particle was built before the rows were checked")

    monkeypatch.setattr(steps.Sample, "empty", classmethod(built))
    with pytest.raises(InvalidParameter, match="sequences of .* need a .* KV cache"):
        Engine(tiny).generate("hello", method="particle", n=3 * 10**6, max_new_tokens=4, chat=False)


# Step searches' rules, checked against what each step search saw -----------------------------------


def test_step_values_aggregate_as_named():
    from decodekit.search.steps import aggregate

    scores = [1.0, 3.0, 2.0]
    assert {how: aggregate(scores, how) for how in ("mean", "last", "min", "sum")} == {
        "mean": 2.0, "last": 2.0, "min": 1.0, "sum": 6.0}
    assert aggregate([], "mean") == -math.inf


def spy_expansions(monkeypatch) -> list[tuple[object, list]]:
    """Every StepSearch.expand call: the node expanded and the children it gave."""
    from decodekit.search.steps import StepSearch

    calls: list[tuple[object, list]] = []
    original = StepSearch.expand

    def spy(self, ctx, node, rows, slots, cap=None):
        children = original(self, ctx, node, rows, slots, cap)
        calls.append((node, children))
        return children

    monkeypatch.setattr(StepSearch, "expand", spy)
    return calls


def letters_score(text: str) -> float:
    """A step scorer that tells steps apart: each 'a' is worth 1, each 'b' costs 0.5."""
    return text.count("a") - 0.5 * text.count("b")


@pytest.mark.parametrize("bigram, seed", [(4, 3), (6, 4)])  # runs where beams finish at different rounds
def test_step_beam_keeps_the_best_children_and_shrinks_as_beams_finish(monkeypatch, bigram, seed):
    model = random_bigram(bigram, eos_logit=-0.3)
    calls = spy_expansions(monkeypatch)
    n, expand = 3, 2
    g = build_decoder("step-beam", n=n, expand=expand, delimiter=" ", scorer=letters_score, aggregate="sum").generate(
        model, request(model, "p", seed=seed, max_new=24))
    beams, finished, rounds, shrunk = [calls[0][0]], [], 0, False
    while beams:  # a round: each beam expanded into `expand` children, the best n - finished kept
        batch, calls[: len(beams)] = calls[: len(beams)], []
        assert [id(node) for node, _ in batch] == [id(b) for b in beams]
        assert all(len(children) == expand for _, children in batch)
        children = [c for _, kids in batch for c in kids]
        kept = sorted(children, key=lambda p: p.value("sum"), reverse=True)[: n - len(finished)]
        finished += [c for c in kept if c.done]
        beams, rounds = [c for c in kept if not c.done], rounds + 1
        shrunk = shrunk or (beams and finished)
    assert not calls and shrunk  # some round ran with fewer beams because others had finished
    assert rounds > 1
    assert sorted(c["value"] for c in g.extra["candidates"]) == pytest.approx(sorted(c.value("sum") for c in finished))
    assert g.extra["uncertainty"]["value"] == pytest.approx(max(c.value("sum") for c in finished))


def test_astar_always_expands_the_most_valuable_node_it_has(monkeypatch):
    model = random_bigram(6, eos_logit=-2.0)
    calls = spy_expansions(monkeypatch)
    build_decoder("astar", n=3, token_budget=120, delimiter=" ", scorer=letters_score, max_step_tokens=4).generate(
        model, request(model, "p", seed=3, max_new=40))
    assert len(calls) > 2
    waiting = []  # every node produced and not yet expanded
    for node, children in calls:
        if waiting:
            assert node.value("mean") == max(w.value("mean") for w in waiting)
            waiting.remove(next(w for w in waiting if w is node))
        waiting += children


def test_particle_log_weights_add_up_between_resamples(monkeypatch):
    model = bigram_model(FORK_RULES)
    seen = []
    monkeypatch.setattr(ParticleFilter, "_should_resample",
                        lambda self, log_w: seen.append(list(log_w)) or False)  # never resample
    g = fork_filter(4, weight_temperature=0.5).generate(model, request(model, "p", seed=0, max_new=10))
    texts = [c["text"] for c in g.extra["candidates"]]
    assert set(texts) == {"x", "y z"} and len(seen) == 2
    # "x" weighs its final score at both steps; "y " weighs 0 then "y z" its score
    final = {"x": 2 * FORK_SCORES["x"] / 0.5, "y z": FORK_SCORES["y z"] / 0.5}
    assert seen[-1] == pytest.approx([final[t] for t in texts])


class PieceTokenizer(CharTokenizer):
    """CharTokenizer plus tokens of several characters (ids from 96 on), so that a stop string can
    end inside a token."""

    PIECES = ["Hello", " world", ","]

    def decode(self, ids):
        return "".join(self.PIECES[i - 96] if i >= 96 else CharTokenizer.decode(self, [i]) for i in ids)


@pytest.mark.parametrize("method, options", [("greedy", {}), ("best-of-n", {"n": 2}), ("beam", {"n": 2}),
                                             ("step-beam", {"n": 2, "expand": 2}), ("particle", {"n": 2}),
                                             ("astar", {"n": 2})])
@pytest.mark.parametrize("stop, text", [("o", "Hell"), ("world", "Hello "), (",", "Hello world")])
def test_a_stop_inside_a_token_keeps_the_text_before_it_in_every_method(method, options, stop, text):
    """The model writes "Hello", " world", ",", "Hello", ...: with steps split at ",", a stop string
    ending inside a token cuts the text there, whatever method decoded it."""
    table = torch.full((99, 99), -30.0)
    table[:, 0] = -40.0  # EOS below the tied rest: a beam's second candidate is never an end
    order = [cid("p"), 96, 97, 98]
    for a, b in zip(order, order[1:] + [96]):
        table[a, b] = 5.0
    model = LoadedModel(BigramBackend(table), PieceTokenizer(96), "pieces")
    engine = Engine(model)
    g = engine.generate("p", method=method, stop=stop, max_new_tokens=12, chat=False, seed=0,
                        **({"delimiter": ","} if method in ("step-beam", "particle", "astar") else {}), **options)
    assert (g.text, g.finish_reason) == (text, "stop")
    assert model.tokenizer.decode(g.tokens) == text[: len(model.tokenizer.decode(g.tokens))]  # whole tokens before the cut
    assert g.stats.new_tokens == len(g.tokens)  # the tokens handed back, not those the stop cut off


@pytest.mark.parametrize("method", ["step-beam", "particle", "astar"])
def test_a_step_search_stops_at_max_new_tokens_even_within_a_step(method):
    """A step is cut at the tokens the request has left: a model that never writes the delimiter nor
    EOS gives exactly max_new_tokens, however long max_step_tokens allows a step to be."""
    model = bigram_model({"p": {"a": 0.0}, "a": {"a": 0.0}})
    g = build_decoder(method, n=2, delimiter=" ", max_step_tokens=128).generate(model, request(model, "p", max_new=5))
    assert (g.text, g.finish_reason) == ("aaaaa", "length")


def test_step_beam_gives_each_beam_of_a_round_its_own_seeds(monkeypatch):
    """Draws are keyed by seed and position: beams of one round expanded with the same slot seeds
    would get coupled children, so beam b samples with slots b·expand .. (b + 1)·expand - 1."""
    from decodekit.search.steps import StepSearch

    rounds: dict[int, list[tuple[int, ...]]] = {}
    original = StepSearch.expand

    def spy(self, ctx, node, rows, slots, cap=None):
        rounds.setdefault(len(node.scores), []).append(tuple(rows.sampler(s).seed for s in slots))
        return original(self, ctx, node, rows, slots, cap)

    monkeypatch.setattr(StepSearch, "expand", spy)
    model = random_bigram(4, eos_logit=-3.0)
    build_decoder("step-beam", n=3, expand=2, delimiter=" ").generate(model, request(model, "p", seed=2, max_new=20))
    assert any(len(beams) > 1 for beams in rounds.values())
    for beams in rounds.values():
        seeds = [s for beam in beams for s in beam]
        assert len(set(seeds)) == len(seeds)


def test_particle_filter_never_expands_a_finished_particle(monkeypatch):
    """A finished particle keeps its text (and weighs its final value); only live ones take a step."""
    model = bigram_model(FORK_RULES)
    calls = spy_expansions(monkeypatch)
    for seed in range(0, 30, 6):
        fork_filter(4).generate(model, request(model, "p", seed=seed, max_new=10))
    assert any(c.done for _, children in calls for c in children) and len(calls) > 5
    assert not any(node.done for node, _ in calls)


def test_particle_threshold_one_resamples_even_equal_weights():
    """ess_threshold=1.0 resamples after every step (the reference's schedule), equal weights
    included; below 1.0 a constant scorer never resamples."""
    model = random_bigram(2, eos_logit=-0.5)
    opts = dict(n=4, scorer=lambda text: 0.0, delimiter=" ", max_step_tokens=5)
    req = lambda: request(model, "p", seed=0, max_new=30)  # noqa: E731
    assert build_decoder("particle", ess_threshold=1.0, **opts).generate(model, req()).extra["resamples"] >= 1
    assert build_decoder("particle", ess_threshold=0.99, **opts).generate(model, req()).extra["resamples"] == 0


def test_astar_out_of_budget_returns_its_best_partial_solution():
    """With the budget spent and nothing finished, the best partial solution (the one popped last)
    is returned: "p" always writes "y " (one step of 2 tokens), and a budget of 2 allows no more."""
    model = bigram_model({"p": {"y": 0.0}, "y": {" ": 0.0}, " ": {"z": 0.0}, "z": {"": 0.0}})
    g = build_decoder("astar", n=1, token_budget=2, delimiter=" ").generate(model, request(model, "p", max_new=10))
    assert (g.text, g.finish_reason, g.extra["budget_exhausted"]) == ("y ", "length", True)


def test_astar_out_of_budget_prefers_a_finished_solution_to_a_better_partial_one():
    """The module's rule: when the budget is spent, the best finished solution seen, else the best
    partial one. "x" (finished, value 0) loses to "y " (partial, value 1) on value, yet is returned."""
    model = bigram_model(FORK_RULES)
    scores = {"x": 0.0, "y ": 1.0, "y z": 2.0}
    decoder = build_decoder("astar", n=2, token_budget=4, delimiter=" ", aggregate="last",
                            scorer=lambda text: scores[text])
    runs = [decoder.generate(model, request(model, "p", seed=seed, max_new=10)) for seed in range(0, 40, 3)]
    forked = [g for g in runs if {c["text"] for c in g.extra["candidates"]} == {"x", "y "}]
    assert forked, "some seed should give one child of each kind"
    for g in forked:
        assert g.extra.get("budget_exhausted") and (g.text, g.finish_reason) == ("x", "eos")


def test_astar_reports_every_child_it_expanded_as_a_candidate():
    """A*'s candidates are all the children its expansions gave (n each), finished or not, each
    marked done as its text ended: "x" and "y z" end on EOS, "y " stops at the delimiter."""
    model = bigram_model(FORK_RULES)
    scores = {"x": 0.0, "y ": 1.0, "y z": 2.0}
    decoder = build_decoder("astar", n=2, token_budget=64, delimiter=" ", aggregate="last",
                            scorer=lambda text: scores[text])
    runs = [decoder.generate(model, request(model, "p", seed=seed, max_new=10)) for seed in range(0, 12, 3)]
    for g in runs:
        cands = g.extra["candidates"]
        assert len(cands) == 2 * g.extra["expansions"] and g.text in [c["text"] for c in cands]
        assert all(c["done"] == (c["text"] != "y ") for c in cands)
    assert any(c["text"] == "y " for g in runs for c in g.extra["candidates"]), "some seed should step through 'y '"


def test_beam_spends_a_token_per_live_beam_per_step():
    """tokens_spent counts every row decoded: from "p" one row (EOS finishes, "a" and "b" go on),
    then two rows, whose EOS ends the search: 1 + 2 = 3."""
    model = bigram_model({"p": {"": 2.0, "a": 1.0, "b": 0.0}, "a": {"": 10.0}, "b": {"": 10.0}})
    assert beam(model).stats.extra["tokens_spent"] == 3


def test_beam_mean_logprob_is_its_log_probability_per_token():
    """A hypothesis's per-token log-probs sum to its logP: "aa" (logP -0.408 over 2 tokens, no EOS)
    has mean log-prob logP / 2."""
    model = bigram_model({"p": {"a": 2.0, "": 1.0, "b": 0.0}, "a": {"a": 10.0, "": -50.0}, "b": {"b": 10.0, "": -50.0}})
    g = beam(model, max_new=2)
    logp = 2.0 - math.log(math.exp(2) + math.exp(1) + 1)
    assert g.extra["candidates"][0]["logp"] == pytest.approx(logp, abs=1e-3)
    assert g.extra["uncertainty"]["mean_logprob"] == pytest.approx(logp / 2, abs=1e-3)
    # an answer that ended on EOS: its EOS is one of its choices, counted once ("a" + EOS: logP / 2)
    ended = beam(bigram_model({"p": {"a": 1.0, "b": 0.0}, "a": {"": 10.0}, "b": {"": 10.0}}))
    best = ended.extra["candidates"][0]
    assert (best["text"], best["finish_reason"]) == ("a", "eos")
    assert ended.extra["uncertainty"]["mean_logprob"] == pytest.approx(best["logp"] / 2, abs=1e-3)


# Batched decoding's promises, pinned one by one ------------------------------------------------------


def test_row_seeds_wrap_around_at_the_seed_limit(tiny):
    """Row i is seeded (seed + i) mod SEED_LIMIT: a request seeded with the last seed there
    draws its second row as the sequential sample seeded 0."""
    from decodekit.samplers.params import SEED_LIMIT

    samples = decode_batch(tiny, request(tiny, "hello", seed=SEED_LIMIT - 1, max_new=12), 2)
    engine = Engine(tiny)
    for sample, seed in zip(samples, (SEED_LIMIT - 1, 0)):
        assert sample.tokens == engine.generate("hello", method="sample", seed=seed, max_new_tokens=12, chat=False).tokens


def test_batch_rows_with_penalties_are_sequential_samples_with_their_own_seed(tiny):
    """A row's penalties read its whole history, the prompt included (the repetition penalty
    counts it), as plain sampling's do: row i is still the sample seeded seed + i."""
    params = dict(repetition_penalty=3.0, frequency_penalty=1.0, temperature=1.0)
    samples = decode_batch(tiny, request(tiny, "hello hello", seed=5, max_new=16, **params), 3)
    engine = Engine(tiny)
    for i, sample in enumerate(samples):
        assert sample.tokens == engine.generate("hello hello", method="sample", seed=5 + i, max_new_tokens=16,
                                                chat=False, **params).tokens


def test_a_step_decoded_after_earlier_steps_counts_their_tokens_as_generated():
    """Frequency and presence penalties count the generated ids, not the prompt's: a step search's
    earlier steps were generated, so the step after them is penalised for their tokens.
    After "a": logits a 1.0, b 0.5; "a" generated once, frequency penalty 1: a 0.0 < b 0.5."""
    from decodekit.search.batch import SearchContext

    model = bigram_model({"a": {"a": 1.0, "b": 0.5}, "b": {"": 5.0}})
    req = Request(TOK.encode("a"), make_sampler("greedy", {"frequency_penalty": 1.0}), 5)
    ctx = SearchContext(model, req)
    [step] = ctx.decode(ctx.prompt + [cid("a")], ctx.greedy_rows(), [0], 3)
    assert step.tokens == [cid("b")] and step.finish_reason == "eos"


def test_step_done_reads_whitespace_before_a_leading_delimiter_as_no_content():
    """Only content before the delimiter ends a step: blanks and delimiters before it do not."""
    assert not step_done(" \n\n", "\n\n")
    assert not step_done("\t\n\n\n\n", "\n\n")
    assert step_done(" \n\nStep one.\n\n", "\n\n")


def test_a_step_that_begins_with_a_stop_string_keeps_none_of_its_tokens():
    """A stop string beginning at a step's first token is cut within the step: the step keeps no
    token and the stop's tokens are its cut-off (only a stop begun in the steps before leaves the
    step whole, for finalize to cut)."""
    from decodekit.search.batch import SearchContext

    model = bigram_model({"a": {"c": 5.0}, "c": {"d": 5.0}, "d": {"e": 5.0}})
    ctx = SearchContext(model, Request(TOK.encode("p"), make_sampler("greedy", {}), 10, stop="cd"))
    [step] = ctx.decode(ctx.prompt + [cid("a")], ctx.greedy_rows(), [0], 5)
    assert (step.tokens, step.cut_off, step.finish_reason, step.text) == ([], [cid("c"), cid("d")], "stop", "")


def test_a_search_reports_a_sample_cut_by_steps_or_the_batch_as_ending_at_the_length_limit(tiny):
    """A Generation ends on eos, stop or length: a chosen sample that stopped at a step delimiter
    or was left unfinished by the batch is reported as "length"."""
    from decodekit.search.batch import SearchContext

    ctx = SearchContext(tiny, request(tiny, "hello", max_new=4))
    for reason, want in (("step", "length"), ("unfinished", "length"), ("length", "length"), ("eos", "eos")):
        sample = Sample([cid("a")], [-0.1], [0.0], [0.0], [[-0.1]], reason, "a")
        assert ctx.finalize(sample, {}).finish_reason == want, reason


def test_a_search_refuses_a_request_past_the_context_before_decoding(tiny):
    """A search checks that the prompt and max_new_tokens fit the context first, in one line, as
    plain decoding does (not once the cache overflows mid-search)."""
    from decodekit.errors import PromptTooLong

    too_long = request(tiny, "hello", max_new=tiny.backend.info.max_length)
    for method in ("best-of-n", "step-beam"):
        with pytest.raises(PromptTooLong, match="exceeds the model's context"):
            build_decoder(method, n=2).generate(tiny, too_long)


def test_a_row_ending_on_eos_records_one_statistic_per_kept_token():
    """The EOS step's statistics are kept apart (eos_logprob): certainty, margin and top-K hold one
    entry per token, as the log-probs do."""
    model = bigram_model({"p": {"a": 2.0, "b": 1.0}, "a": {"": 3.0, "c": 0.0}})
    [s] = decode_batch(model, request(model, "p", method="greedy", max_new=5), 1)
    assert s.finish_reason == "eos" and s.eos_logprob is not None
    assert len(s.tokens) == len(s.logprobs) == len(s.certainty) == len(s.margin) == len(s.topk) == 1


def test_a_search_judged_by_its_own_model_uses_its_own_prefix_cache(tiny):
    """cache_for: the request's own model is read on the request's own prefix cache (what the
    search already read is reused), never on a judge's clone."""
    from decodekit.search.batch import SearchContext

    ctx = SearchContext(tiny, request(tiny, "hello"))
    assert ctx.cache_for(tiny) is ctx.cache
    assert ctx.cache_for(LoadedModel(tiny.backend, TOK, "the same backend")) is ctx.cache
    assert not any(isinstance(k, tuple) and k[0] == "judge.clone" for k in tiny.backend.__dict__.get("_memory", {}))


def test_decode_batch_samples_a_greedy_request_at_the_temperature_given(tiny):
    """decode_batch's temperature makes a greedy request's rows samples at that temperature: row i
    is the sequential sample seeded seed + i."""
    samples = decode_batch(tiny, request(tiny, "hello", method="greedy", seed=7, max_new=16), 3, temperature=1.0)
    engine = Engine(tiny)
    for i, sample in enumerate(samples):
        assert sample.tokens == engine.generate("hello", method="sample", seed=7 + i, temperature=1.0,
                                                max_new_tokens=16, chat=False).tokens


# Selection's promises, pinned one by one --------------------------------------------------------------


def test_a_greedy_requests_samples_are_drawn_at_the_sample_temperature(tiny):
    """The module's rule: a greedy request's n samples are drawn at sample_temperature from the same
    processed distribution, sample i being the sequential sample seeded seed + i."""
    g = Engine(tiny).generate("hello", method="best-of-n", n=3, seed=7, sample_temperature=1.0, max_new_tokens=12,
                              chat=False)
    engine = Engine(tiny)
    want = [engine.generate("hello", method="sample", seed=7 + i, temperature=1.0, max_new_tokens=12, chat=False).text
            for i in range(3)]
    assert [c["text"] for c in g.extra["candidates"]] == want


def test_mbr_ties_go_to_the_first_sample_and_one_sample_is_chosen_alone():
    """MBR picks the highest expected utility, ties to the first sample (the selection module's
    sample-order rule); with one sample there is nothing to compare and it is chosen."""
    same = lambda h, r: float(h == r)  # noqa: E731
    index, expected = mbr_select(["x", "y", "x", "y"], same)
    assert expected == [1 / 3] * 4 and index == 0

    def never(h, r):
        raise AssertionError("no other sample to compare with")

    assert mbr_select(["alone"], never)[0] == 0


def test_weighted_vote_takes_zero_weights_and_an_all_zero_vote_ties_to_the_first_answer(tiny):
    """Weights need only be non-negative: zero is a weight, and when all are zero every answer
    ties, which goes to the answer seen first."""
    g = Engine(tiny).generate("hello", method="weighted-vote", n=4, scorer=lambda text: 0.0,
                              answer=lambda t: t[:1] or None, max_new_tokens=4, chat=False, seed=0)
    answers = [c["answer"] for c in g.extra["candidates"]]
    first = next(a for a in answers if a is not None)
    assert g.extra["answer"] == first and g.extra["chosen"] == answers.index(first)


def test_a_vote_with_no_answer_to_count_returns_the_first_sample():
    """Samples with no extractable answer do not vote: with none voting, the first sample is
    returned (sample order), whatever the weights."""
    from types import SimpleNamespace

    from decodekit.search.select import SelfConsistency, WeightedVote

    samples = [Sample(TOK.encode(t), [], [], [], [], "length", t) for t in ("a", "bb", "c")]
    assert SelfConsistency(n=3).choose(None, samples, [None] * 3)[0] == 0
    ctx = SimpleNamespace(tokenizer=TOK)
    index, weights = WeightedVote(n=3, scorer=lambda text: float(len(text))).choose(ctx, samples, [None] * 3)
    assert weights == [1.0, 2.0, 1.0] and index == 0


def best_of_n_where(tiny, wanted, why: str):
    """A best-of-4 generation (answers: first characters) whose candidates' answers and chosen index
    satisfy ``wanted(answers, chosen)``, the first of 40 seeds that gives one."""
    answer = lambda t: t[:1] or None  # noqa: E731
    for seed in range(40):
        g = Engine(tiny).generate("hello", method="best-of-n", n=4, seed=seed, answer=answer, max_new_tokens=6,
                                  chat=False)
        answers = [c["answer"] for c in g.extra["candidates"]]
        if wanted(answers, g.extra["chosen"]):
            return g, answers
    pytest.fail(f"no seed chose {why}")


def test_agreement_is_the_share_of_samples_agreeing_with_the_chosen_answer(tiny):
    """The agreement signal counts the samples whose answer is the chosen sample's, not the first's."""
    g, answers = best_of_n_where(tiny, lambda a, chosen: a.count(a[chosen]) != a.count(a[0]),
                                 "a sample whose answer is less or more common than the first's")
    assert g.extra["uncertainty"]["agreement"] == answers.count(answers[g.extra["chosen"]]) / 4


def test_a_candidates_token_count_leaves_out_its_eos():
    """A candidate's "tokens" are its text's tokens: the EOS a row ended on is no token of it."""
    model = random_bigram(0, eos_logit=0.5)
    g = build_decoder("best-of-n", n=6).generate(model, request(model, "p", seed=1, max_new=40))
    candidates = g.extra["candidates"]
    assert any(c["finish_reason"] == "eos" for c in candidates)
    assert all(c["tokens"] == len(TOK.encode(c["text"])) for c in candidates)


def test_first_finish_scores_each_candidate_by_the_steps_it_took():
    """First-finish's score is the steps a row took: its tokens and, where it ended on EOS, that choice."""
    model = random_bigram(1, eos_logit=0.0)
    g = build_decoder("first-finish", n=6).generate(model, request(model, "p", seed=4, max_new=40))
    candidates = g.extra["candidates"]
    assert g.finish_reason == "eos"
    assert [c["score"] for c in candidates] == [c["tokens"] + (c["finish_reason"] == "eos") for c in candidates]


def test_a_weighted_vote_adds_each_samples_own_weight_to_its_answer():
    """Weights stay with their samples when some samples have no answer (those do not vote)."""
    answers = ["a", None, "b", "a", None, "b"]
    weights = [1.0, 9.0, 3.0, 1.5, 7.0, 0.25]
    reference: dict[str, float] = {}
    for a, w in zip(answers, weights):
        if a is not None:
            reference[a] = reference.get(a, 0.0) + w
    winner, totals = majority_vote(answers, weights)
    assert totals == pytest.approx(reference) and winner == max(reference, key=reference.get) == "b"


def test_weighted_vote_returns_the_first_sample_with_the_winning_answer_not_its_heaviest():
    """The returned text is the first sample carrying the winning answer (the module's rule), whatever
    the weights of the later samples carrying it."""
    from types import SimpleNamespace

    from decodekit.search.select import WeightedVote

    texts = ["x", "yy", "xxx", "y"]
    samples = [Sample(TOK.encode(t), [], [], [], [], "length", t) for t in texts]
    answers = [t[:1] for t in texts]
    index, weights = WeightedVote(n=4, scorer=lambda text: float(len(text))).choose(
        SimpleNamespace(tokenizer=TOK), samples, answers)
    assert weights == [1.0, 2.0, 3.0, 1.0]
    assert majority_vote(answers, weights)[0] == "x" and index == answers.index("x") == 0


def test_the_reported_answer_is_the_chosen_samples(tiny):
    """extra['answer'] is the answer of the sample returned (extra['chosen']), read from its text."""
    g, answers = best_of_n_where(tiny, lambda a, chosen: a[chosen] != a[0], "a sample whose answer differs from the first's")
    assert g.extra["answer"] == answers[g.extra["chosen"]] == g.text[:1]


def test_particle_filter_particles_of_equal_length_keep_their_own_text():
    """Particles whose steps differ in text but not in length are expanded from their own prefix:
    with a constant scorer (no resample below ess_threshold 1), particle i keeps its first step, so
    different first steps survive to the end."""

    model = bigram_model({"p": {"a": 0.0, "b": 0.0}, "a": {" ": 0.0}, "b": {" ": 0.0},
                          " ": {"c": 0.0, "d": 0.0}, "c": {"": 0.0}, "d": {"": 0.0}})
    decoder = build_decoder("particle", n=4, scorer=lambda text: 0.0, delimiter=" ", ess_threshold=0.5)
    firsts = set()
    for seed in range(5):
        g = decoder.generate(model, request(model, "p", seed=seed, max_new=10))
        assert g.extra["resamples"] == 0
        texts = [c["text"] for c in g.extra["candidates"]]
        assert all(len(t) == 3 for t in texts)
        firsts |= {frozenset(t[0] for t in texts)}
    assert any(len(f) == 2 for f in firsts)  # some run keeps both first steps "a " and "b "


def test_mbr_utility_is_plain_chrf():
    """The utility is chrF (character n-grams only, sacrebleu's CHRF()), not chrF++ (word n-grams)."""
    from sacrebleu.metrics import CHRF
    from decodekit.search.select import chrf_utility

    u = chrf_utility()
    hyp, ref = "the cat sat on the mat", "on the mat the cat sat"
    assert u(hyp, ref) == CHRF().sentence_score(hyp, [ref]).score
    assert u(hyp, ref) != CHRF(word_order=2).sentence_score(hyp, [ref]).score


def test_step_search_candidates_count_tokens_without_the_eos():
    """A candidate's "tokens" are its text's tokens; the EOS that finished it is not one of them."""

    model = bigram_model(FORK_RULES)
    for method in ("step-beam", "astar", "particle"):
        g = build_decoder(method, n=2, delimiter=" ").generate(model, request(model, "p", seed=1, max_new=10))
        assert any(c["done"] for c in g.extra["candidates"])
        for c in g.extra["candidates"]:
            assert c["tokens"] == len(TOK.encode(c["text"]))


def test_sequences_at_once_are_a_searchs_rows_in_one_pass():
    """What a cache of one sequence is checked against: step-beam expands its beams one after another,
    ``expand`` rows each; every other search decodes its ``n`` at once; other families one."""
    from decodekit.engine import sequences_at_once

    assert sequences_at_once("step-beam", {"n": 3, "expand": 1}) == 1
    assert sequences_at_once("step-beam", {"n": 1, "expand": 4}) == 4 == sequences_at_once("step-beam", {})
    assert sequences_at_once("beam", {"n": 3}) == 3 and sequences_at_once("particle", {"n": 5}) == 5
    assert sequences_at_once("greedy", {}) == 1 == sequences_at_once("pld", {})


def test_step_beam_of_one_row_at_a_time_runs_under_a_cache_of_one_sequence():
    """n beams expanded one child at a time (expand=1) use one row: accepted by the check before the
    model loads and by the server's, and decoded; expand=2 is refused by both."""
    from decodekit.engine.registry import build_decoder, check_model_cache
    from decodekit.serve.errors import ApiError
    from decodekit.serve.request import check_method, parse_request

    backend = tiny_llama(seed=0, hidden_size=64).with_kv_cache("int8")
    if backend.kv_policy.spec != "int8":
        pytest.skip("the int8 cache needs the compiled kernels")
    model = LoadedModel(backend, CharTokenizer(96), "tiny")
    one = {"n": 3, "expand": 1}
    check_model_cache("step-beam", one, build_decoder("step-beam", **one), "int8")
    check_method(parse_request({"prompt": "hi", "method": "step-beam", "method_options": one}, chat=False), model)
    out = Engine(model).generate("hello", method="step-beam", max_new_tokens=12, **one)
    assert 0 < len(out.tokens) == out.stats.new_tokens <= 12
    two = {"n": 3, "expand": 2}
    with pytest.raises(InvalidParameter, match="needs 2 at once"):
        check_model_cache("step-beam", two, build_decoder("step-beam", **two), "int8")
    with pytest.raises(ApiError, match="needs 2 at once"):
        check_method(parse_request({"prompt": "hi", "method": "step-beam", "method_options": two}, chat=False), model)


def test_self_certainty_does_not_depend_on_torchs_thread_count():
    """A Ray worker runs torch on one thread, a local run on several: torch splits a long row's sum
    between its threads, so each signal must be summed in one order to be the same bits in both."""
    before = torch.get_num_threads()
    logits = torch.randn(50, 49152, generator=torch.Generator().manual_seed(0)) * 5
    certainty = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            recorder = StepRecorder(topk=3)
            for row in logits:  # one row a step, as a decode step of one sequence
                recorder.add(row.view(1, -1), [0])
            certainty[threads] = torch.cat(recorder.certainty)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(certainty[1], certainty[2])
    expected = -math.log(49152) - torch.log_softmax(logits.double(), dim=-1).mean(dim=-1)
    assert torch.allclose(certainty[1].double(), expected, rtol=1e-6, atol=1e-6)
