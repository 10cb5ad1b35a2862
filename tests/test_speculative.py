"""Lossless speculative decoding on tiny random models: greedy output is plain greedy's, token for
token, for every registered speculative method; plus the drafters', controller's and bandit's
own mechanisms and the option checks."""

from __future__ import annotations

import itertools
import math
import random
import time
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import record_verified_tree_sizes, required_options
from decodekit.engine import Engine, available_methods
from decodekit.engine.core import DecodeState, GenerationStats, Request, StepDecoder
from decodekit.engine.registry import build_decoder
from decodekit.errors import InvalidParameter, UnknownMethod
from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.tiny import tiny_llama
from decodekit.samplers import Sampler
from decodekit.speculative.controller import MEASURE_CONTEXTS, MEASURE_SIZES, Controller, CostTable, node_keys
from decodekit.speculative.drafters.bandit import DiscountedUCB
from decodekit.speculative.drafters.base import Drafter
from decodekit.speculative.drafters.ngram import PromptLookup
from decodekit.speculative.drafters.suffix import SuffixAutomaton, SuffixDrafter
from decodekit.speculative.loop import SpeculativeMethod
from decodekit.speculative.tree import DraftTree, Verification, add_chain, grow_best_first, merge_into, select_nodes
from decodekit.speculative.verify import GreedyVerifier

PROMPTS = (
    "hello world hello world hello world hello",
    "abcabcabcabcabcabcabc",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "Q: 12+12? A: 24. Q: 13+13? A:",
)
OURS = ("pld", "suffix", "recycling", "lookahead", "hierarchy", "auto")
FLAT_COSTS = {1: 1.0, 64: 1.0}  # bfloat16-like: verifying many tokens costs what one does
STEEP_COSTS = {1: 1.0, 2: 2.0, 64: 64.0}  # every token costs a full pass: speculation never pays


def speculative_methods() -> list[str]:
    return sorted(n for n, spec in available_methods().items() if spec.family == "speculative")


def tiny(seed: int = 0, vocab: int = 96, **kw) -> LoadedModel:
    return LoadedModel(backend=tiny_llama(seed=seed, vocab_size=vocab, **kw), tokenizer=CharTokenizer(vocab), name="tiny")



@pytest.fixture(scope="module")
def engines() -> list[Engine]:
    return [Engine(tiny(seed)) for seed in (0, 3)]


@pytest.fixture(scope="module")
def references(engines) -> dict:
    return {
        (i, p): e.generate(p, max_new_tokens=48, chat=False).tokens for i, e in enumerate(engines) for p in PROMPTS
    }


def test_every_speculative_method_is_registered():
    assert set(OURS) <= set(speculative_methods())
    assert all(available_methods()[n].lossless for n in OURS)


@pytest.mark.parametrize("method", speculative_methods())
@pytest.mark.parametrize("options", [{"budget": 6}, {"cost_table": FLAT_COSTS}], ids=["fixed", "controller"])
def test_greedy_output_is_plain_greedy(engines, references, method, options):
    for i, engine in enumerate(engines):
        for prompt in PROMPTS:
            got = engine.generate(
                prompt, method=method, max_new_tokens=48, chat=False, **options,
                **required_options(method, engine.model.backend)
            )
            assert got.tokens == references[(i, prompt)], (method, prompt)
            extra = got.stats.extra
            assert extra["verifications"] + extra["plain_steps"] == got.stats.forward_passes


@pytest.mark.parametrize("method", ["pld", "suffix"])
def test_context_drafters_get_drafts_accepted_on_repetitive_text(engines, method):
    accepted = 0
    for engine in engines:
        for prompt in PROMPTS[:2]:
            g = engine.generate(prompt, method=method, max_new_tokens=48, chat=False, budget=8)
            accepted += sum(g.stats.extra.get("accepted_by_source", {}).values())
            assert g.stats.extra["mean_accepted"] >= 1.0
    assert accepted > 0


def test_speculation_saves_forward_passes_when_drafts_are_right(engines):
    engine = engines[0]
    plain = engine.generate(PROMPTS[1], max_new_tokens=48, chat=False)
    spec = engine.generate(PROMPTS[1], method="pld", max_new_tokens=48, chat=False, budget=8)
    assert spec.tokens == plain.tokens
    assert spec.stats.forward_passes < plain.stats.forward_passes
    assert spec.stats.extra["mean_accepted"] > 1.0


def test_greedy_with_a_history_dependent_penalty_stays_exact(engines):
    # each tree node must be judged with its own path as history
    for engine in engines:
        for prompt in PROMPTS:
            plain = engine.generate(prompt, max_new_tokens=40, chat=False, repetition_penalty=1.3)
            for method in ("pld", "recycling"):
                got = engine.generate(prompt, method=method, max_new_tokens=40, chat=False, budget=6, repetition_penalty=1.3)
                assert got.tokens == plain.tokens, (method, prompt)


def test_stop_strings_and_eos_behave_as_in_plain_decoding(engines):
    engine = engines[0]
    full = engine.generate(PROMPTS[0], max_new_tokens=40, chat=False)
    stop = full.text[10:12]
    plain = engine.generate(PROMPTS[0], max_new_tokens=40, chat=False, stop=[stop])
    spec = engine.generate(PROMPTS[0], method="pld", max_new_tokens=40, chat=False, stop=[stop], budget=8)
    assert spec.text == plain.text and spec.finish_reason == plain.finish_reason == "stop"


@pytest.mark.parametrize("method", ["pld", "suffix", "lookahead"])
def test_a_step_past_a_stop_string_bills_what_plain_decoding_generated(engines, method):
    """A speculative step may accept tokens past the one that completes a stop string: they were
    never generated by plain decoding, and are not counted (a server bills ``generated``)."""
    engine = engines[0]
    for prompt in PROMPTS[:2]:
        full = engine.generate(prompt, max_new_tokens=40, chat=False)
        for start in (3, 9, 17):
            stop = full.text[start:start + 2]
            plain = engine.generate(prompt, max_new_tokens=40, chat=False, stop=[stop])
            spec = engine.generate(prompt, method=method, max_new_tokens=40, chat=False, stop=[stop], budget=8)
            assert (spec.text, spec.tokens, spec.cut_off) == (plain.text, plain.tokens, plain.cut_off)


def test_stats_record_the_speculative_figures(engines):
    g = engines[0].generate(PROMPTS[1], method="hierarchy", max_new_tokens=30, chat=False, budget=8)
    extra = g.stats.extra
    assert {"mean_accepted", "acceptance_rate", "verifications", "draft_s", "verify_s", "drafter"} <= set(extra)
    assert extra["drafter"] == "hierarchy"
    assert 0.0 <= extra["acceptance_rate"] <= 1.0
    # produced tokens: the first (from the prefill logits) + (accepted + bonus) per verification + plain steps
    produced = 1 + round(extra["mean_accepted"] * extra["verifications"]) + extra["plain_steps"]
    assert produced >= g.stats.new_tokens
    # Spec-Bench's mean accepted tokens: accepted drafts and the bonus, per verification (plain steps are not counted)
    assert extra["plain_steps"] > 0  # (the set-up the next line needs to tell the two apart)
    assert extra["mean_accepted"] == round((extra["accepted"] + extra["verifications"]) / extra["verifications"], 3)
    assert set(extra.get("accepted_by_source", {})) <= {"pld:1", "pld:2", "pld:3", "recycling", "suffix", "suffix:corpus"}



def test_a_models_first_cost_measurement_is_not_counted_as_its_requests_prefill(monkeypatch, tmp_path):
    """A model's first speculative request times its passes for the controller (a minute on a slow
    machine, once): that is set-up, not the prompt's reading, so ``prefill_s`` leaves it out."""
    monkeypatch.setenv("DECODEKIT_COST_TABLE", str(tmp_path / "verify_cost.json"))  # nothing measured yet
    measure, measured = CostTable.measure.__func__, []

    def slow_measure(cls, backend, *args, **kwargs):
        measured.append(backend)
        time.sleep(1.0)
        return measure(cls, backend, *args, **kwargs)

    monkeypatch.setattr(CostTable, "measure", classmethod(slow_measure))
    g = Engine(tiny(5)).generate(PROMPTS[0], method="pld", max_new_tokens=4, chat=False)
    assert measured and g.stats.prefill_s < 1.0


# Options ------------------------------------------------------------------------------------------


def test_unknown_option_is_named_with_the_valid_ones(engines):
    with pytest.raises(InvalidParameter, match=r"'max_ngramz'.*valid options: .*max_ngram"):
        engines[0].generate("hi", method="pld", max_ngramz=3, chat=False)


@pytest.mark.parametrize(
    "method, options",
    [
        ("pld", {"max_ngram": 0}),
        ("pld", {"min_ngram": 4, "max_ngram": 2}),
        ("pld", {"budget": -1}),
        ("suffix", {"max_draft": 0}),
        ("suffix", {"growth": -1.0}),
        ("suffix", {"corpus": "maybe"}),
        ("recycling", {"k": 100}),
        ("lookahead", {"ngram": 1}),
        ("auto", {"discount": 1.5}),
        ("pld", {"cost_table": {2: 1.0}}),
    ],
)
def test_bad_option_values_raise_invalid_parameter(engines, method, options):
    with pytest.raises(InvalidParameter):
        engines[0].generate("hi", method=method, chat=False, max_new_tokens=4, **options)


def test_unknown_drafter_names_raise_unknown_method(engines):
    with pytest.raises(UnknownMethod, match="choose from"):
        engines[0].generate("hi", method="hierarchy", order="pld,nope", chat=False)
    # known drafters a combination cannot hold: itself, or draft (whose draft_model it would not pass on)
    for method, option, names in (("auto", "arms", ["pld", "auto"]), ("hierarchy", "order", "draft,pld"),
                                  ("auto", "arms", "draft"), ("hierarchy", "order", "auto,pld")):
        with pytest.raises(InvalidParameter, match=f"cannot be one of {option} .*choose from") as err:
            engines[0].generate("hi", method=method, chat=False, **{option: names})
        assert err.value.param == option and "draft" not in str(err.value).split("choose from: ")[1].split(", ")


def test_options_from_the_command_line_may_be_strings(engines):
    g = engines[0].generate(PROMPTS[1], method="pld", max_ngram="2", budget="4", chat=False, max_new_tokens=8)
    assert g.stats.new_tokens == 8


# Tree helpers -------------------------------------------------------------------------------------


def test_add_chain_merges_shared_prefixes():
    tree = DraftTree()
    assert add_chain(tree, [1, 2, 3]) == [0, 1, 2]
    assert add_chain(tree, [1, 2, 4]) == [0, 1, 3]
    assert tree.parents == [-1, 0, 1, 1]
    other = DraftTree.chain([1, 5, 6], "x")
    merge_into(tree, other, budget=5)
    assert tree.tokens == [1, 2, 3, 4, 5] and tree.parents[4] == 0 and tree.source[4] == "x"


def test_select_nodes_reindexes_a_subtree():
    tree = DraftTree([1, 2, 3, 4], [-1, 0, -1, 2], {2: torch.ones(3)}, ["a"] * 4)
    sub = select_nodes(tree, [2, 3, 0])
    assert sub.tokens == [1, 3, 4] and sub.parents == [-1, -1, 1] and set(sub.draft_probs) == {1}


def test_select_nodes_keeps_the_nodes_in_their_original_topological_order():
    """However the nodes are given, the subtree lists them in the tree's order (parents first), each
    under its own parent: checked on random ancestor-closed subsets of a random tree."""
    rng = random.Random(5)
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, 20)]
    tree = DraftTree([100 + i for i in range(20)], parents)
    for _ in range(200):
        chosen = set()
        for node in rng.sample(range(20), rng.randrange(1, 5)):
            while node >= 0:
                chosen.add(node)
                node = parents[node]
        sub = select_nodes(tree, list(chosen))
        assert sub.tokens == [100 + i for i in sorted(chosen)]
        for i, (token, parent) in enumerate(zip(sub.tokens, sub.parents)):
            original = parents[token - 100]
            assert parent < i and (parent == -1 if original < 0 else sub.tokens[parent] == 100 + original)


def test_best_first_growth_adds_nodes_in_score_order():
    table = {0: [(1, 0.9, 1), (2, 0.1, 2)], 1: [(3, 0.5, 3)], 2: [(4, 1.0, 4)], 3: [], 4: []}
    tree = DraftTree()
    grow_best_first(tree, table[0], lambda s: table[s], budget=3, max_depth=4, source="t")
    # scores: 1 -> 0.9, 3 -> 0.45, 2 -> 0.1, 4 -> 0.1
    assert tree.tokens == [1, 3, 2] and tree.parents == [-1, 0, -1]


def test_best_first_growth_multiplies_relative_scores_and_stops_at_max_depth():
    table = {0: [(1, 0.9, 1), (2, 0.5, 2)], 1: [(3, 0.4, 3)], 2: [(4, 0.9, 4)], 3: [(5, 1.0, 5)], 4: [], 5: []}
    tree = DraftTree()
    grow_best_first(tree, table[0], lambda s: table[s], budget=10, max_depth=4, source="t")
    # scores: 1 -> 0.9, 2 -> 0.5, 4 -> 0.45, 3 -> 0.36, 5 -> 0.36 (a child after its parent on a tie)
    assert tree.tokens == [1, 2, 4, 3, 5] and tree.parents == [-1, -1, 1, 0, 3]
    shallow = DraftTree()
    grow_best_first(shallow, table[0], lambda s: table[s], budget=10, max_depth=1, source="t")
    assert shallow.tokens == [1, 2] and shallow.depth() == 1


def test_best_first_growth_lists_no_children_for_a_full_tree():
    """A node is expanded only while the tree has room for its children (for Hydra, each listing is
    a pass of the draft network): the last node added never is."""
    table = {0: [(1, 0.9, 1), (2, 0.5, 2)], 1: [(3, 0.4, 3)], 2: [(4, 0.9, 4)], 3: [(5, 1.0, 5)], 4: [], 5: []}
    for budget in (1, 2, 3):
        expanded: list[int] = []
        tree = DraftTree()
        grow_best_first(tree, table[0], lambda s: expanded.append(s) or table[s], budget=budget, max_depth=4, source="t")
        assert len(tree) == budget and expanded == tree.tokens[: budget - 1]


def test_best_first_growth_adds_equally_scored_candidates_in_the_order_they_were_proposed():
    """On a tie the candidate proposed first is added first: siblings in their listed order, and a
    node's children after the candidates already waiting (so a budget cut keeps the earlier ones)."""
    table = {0: [(1, 0.5, 1), (2, 0.5, 2)], 1: [(3, 1.0, 3), (4, 1.0, 4)], 2: [(5, 1.0, 5), (6, 1.0, 6)],
             3: [], 4: [], 5: [], 6: []}
    tree = DraftTree()
    grow_best_first(tree, table[0], lambda s: table[s], budget=10, max_depth=4, source="t")
    assert tree.tokens == [1, 2, 3, 4, 5, 6] and tree.parents == [-1, -1, 0, 0, 1, 1]
    cut = DraftTree()
    grow_best_first(cut, table[0], lambda s: table[s], budget=3, max_depth=4, source="t")
    assert cut.tokens == [1, 2, 3]


def test_a_trees_depth_is_its_number_of_levels():
    assert DraftTree().depth() == 0
    assert DraftTree([1, 2], [-1, -1]).depth() == 1  # siblings below the root: one level
    assert DraftTree.chain([1, 2, 3]).depth() == 3
    assert DraftTree([1, 2, 3, 4], [-1, 0, -1, 2]).depth() == 2


def test_the_path_verifier_follows_the_first_of_duplicate_siblings():
    """Of two siblings with the same token the first proposed is followed, as ``child_with_token`` finds it."""

    tree = DraftTree([3, 4, 3], [-1, 0, -1])  # node 2 repeats node 0's token, with no subtree
    logits = torch.full((4, 8), -1.0)
    for row, token in enumerate([3, 4, 5, 4]):  # rows 1 and 3 follow the same tokens: the same choice
        logits[row, token] = 1.0
    state = DecodeState(None, Sampler(greedy=True), [1], GenerationStats())
    verdict = GreedyVerifier().verify(state, tree, logits)
    assert verdict.path == [0, 1] and verdict.bonus == 5


# Drafters -----------------------------------------------------------------------------------------


def state_for(tokens: list[int], vocab: int = 32) -> DecodeState:
    return DecodeState(tiny_llama(vocab_size=vocab), Sampler(greedy=True), tokens, GenerationStats())


def test_prompt_lookup_proposes_what_followed_the_longest_match():
    state = state_for([5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6])
    drafter = PromptLookup(max_ngram=2, matches=1)
    drafter.begin(state)
    tree = drafter.draft(state, 3)
    assert tree.tokens == [9, 2, 5] and tree.source == ["pld:2"] * 3  # the most recent occurrence
    several = PromptLookup(max_ngram=2, matches=2)
    several.begin(state)
    tree = several.draft(state, 8)
    assert tree.children(-1) == [0, 4] and {tree.tokens[0], tree.tokens[4]} == {9, 7}


def test_prompt_lookup_indexes_new_tokens_incrementally():
    state = state_for([1, 2, 3, 4])
    drafter = PromptLookup(max_ngram=2)
    drafter.begin(state)
    assert len(drafter.draft(state, 4)) == 0
    state.tokens.extend([1, 2])
    assert drafter.draft(state, 4).tokens == [3, 4, 1, 2]


def test_prompt_lookup_matches_the_contexts_first_token_too():
    """Every position is indexed, the first included: its one-token n-gram matches a later copy."""
    state = state_for([7, 8, 9, 7])
    drafter = PromptLookup(max_ngram=3)
    drafter.begin(state)
    assert drafter.draft(state, 3).tokens == [8, 9, 7]
    state = state_for([7, 8, 1, 7, 8])
    drafter.begin(state)
    tree = drafter.draft(state, 2)
    assert tree.tokens == [1, 7] and tree.source == ["pld:2"] * 2  # the two-token n-gram at positions 0-1


def test_prompt_lookup_with_several_matches_stays_within_the_budget():
    state = state_for([5, 1, 2, 3, 5, 4, 6, 7, 5])
    drafter = PromptLookup(max_ngram=1, matches=2)
    drafter.begin(state)
    tree = drafter.draft(state, 5)
    assert tree.tokens == [4, 6, 7, 5, 1] and tree.parents == [-1, 0, 1, 2, -1]  # the second match gets what is left
    assert [len(drafter.draft(state, b)) for b in range(1, 9)] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_prompt_lookup_with_one_match_drafts_the_most_recent_occurrence_only():
    """``matches`` bounds the occurrences drafted: with one, a short continuation leaves the rest of
    the budget unused rather than hanging an older occurrence beside it."""
    state = state_for([5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6])
    drafter = PromptLookup(max_ngram=2, matches=1)
    drafter.begin(state)
    tree = drafter.draft(state, 8)
    assert tree.tokens == [9, 2, 5, 6] and tree.parents == [-1, 0, 1, 2]  # what followed the last [5, 6]


def brute_count(text: list[int], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(text[i : i + n] == pattern for i in range(len(text) - n + 1))


def test_suffix_automaton_counts_and_longest_repeated_suffix_match_brute_force():
    rng = random.Random(0)
    sam = SuffixAutomaton()
    text: list[int] = []
    for _ in range(300):
        token = rng.choice([1, 2, 3]) if rng.random() < 0.8 else rng.choice(range(4, 9))
        sam.extend(token)
        text.append(token)
        own = sam.link[sam.last]
        longest = sam.length[own]
        # the longest suffix that also occurs earlier
        assert brute_count(text[:-1], text[len(text) - longest :]) >= 1 or longest == 0
        assert longest == len(text) or brute_count(text[:-1], text[len(text) - longest - 1 :]) == 0
    for _ in range(50):  # occurrence counts of random substrings
        i = rng.randrange(len(text))
        pattern = text[i : i + rng.randrange(1, 6)]
        state = 0
        for t in pattern:
            state = sam.next[state][t]
        assert sam.count[state] == brute_count(text, pattern)


def test_suffix_continuations_are_the_most_frequent_next_tokens():
    # After "1" in 1 2 1 2 1 3 1 2 1 5 1: "2" follows three times, "3" and "5" once each. The width keeps
    # the most frequent (ties by token id); each share is over all 5 continuations, not only those kept.
    sam = SuffixAutomaton()
    for t in [1, 2, 1, 2, 1, 3, 1, 2, 1, 5, 1]:
        sam.extend(t)
    one = sam.next[0][1]
    assert [(t, share) for t, share, _ in sam.continuations(one, 2)] == [(2, pytest.approx(3 / 5)), (3, pytest.approx(1 / 5))]
    assert [t for t, _, _ in sam.continuations(one, 1)] == [2]
    # "1 2" is followed by "1" every time
    assert [(t, share) for t, share, _ in sam.continuations(sam.next[one][2], 4)] == [(1, pytest.approx(1.0))]


def test_suffix_corpus_match_is_the_longest_suffix_of_the_context_found_in_the_corpus_brute_force():
    """The corpus match drafts as deep as ``growth`` x its length: that length is the context's
    matched text, which may be shorter than the longest string of the automaton's state (a "1"
    always preceded by "9" shares the state of "9 1")."""
    sam = SuffixAutomaton()
    for t in [9, 1, 2, 3]:
        sam.extend(t)
    state, matched = sam.advance(0, 0, 1)
    assert (sam.length[state], matched) == (2, 1)
    rng = random.Random(1)
    corpus = [rng.choice([1, 2, 3, 4]) for _ in range(200)]
    sam = SuffixAutomaton()
    for t in corpus:
        sam.extend(t)
    state, matched, context = 0, 0, []
    for _ in range(300):
        token = rng.choice([1, 2, 3, 4, 5])  # 5: never in the corpus
        context.append(token)
        state, matched = sam.advance(state, matched, token)
        longest = max(n for n in range(len(context) + 1) if n == 0 or brute_count(corpus, context[len(context) - n :]))
        assert matched == longest


def test_suffix_drafts_from_a_match_of_exactly_min_match_tokens():
    drafter = SuffixDrafter(min_match=2)
    state = state_for([1, 2, 3, 1, 2])  # "1 2" occurred before, followed by 3
    drafter.begin(state)
    assert drafter.draft(state, 1).tokens == [3]
    state = state_for([1, 2, 3, 4, 2])  # only "2" occurred before: shorter than min_match
    drafter.begin(state)
    assert drafter.draft(state, 1).tokens == []


def test_suffix_corpus_carries_earlier_outputs_across_requests():
    model = tiny(seed=5)
    engine = Engine(model)
    first = engine.generate("zq", method="suffix", corpus=True, max_new_tokens=40, chat=False, budget=8)
    # the same context again: only the corpus (earlier outputs) knows what follows it
    prompt = "zq" + first.text[:12]
    again = engine.generate(prompt, method="suffix", corpus=True, max_new_tokens=20, chat=False, budget=8)
    plain = engine.generate(prompt, max_new_tokens=20, chat=False)
    assert again.tokens == plain.tokens
    assert again.stats.extra.get("accepted_by_source", {}).get("suffix:corpus", 0) > 0


def test_the_corpus_holds_an_output_through_its_end_of_sequence_not_the_tokens_accepted_past_it():
    """A verification may accept drafts past an end-of-sequence token: the request never output them."""
    from decodekit.speculative.drafters.suffix import corpus_for

    model = tiny(seed=0)
    engine = Engine(model)
    plain = engine.generate(PROMPTS[1], max_new_tokens=40, chat=False).tokens
    for eos in sorted(set(plain)):
        model.tokenizer.eos_token_ids = frozenset({eos})
        got = engine.generate(PROMPTS[1], method="suffix", corpus=True, max_new_tokens=40, chat=False, budget=16)
        assert got.finish_reason == "eos"
        assert corpus_for(model.backend).documents[-1] == got.tokens + [eos]


def test_the_corpus_holds_an_output_up_to_its_stop_string_not_the_tokens_accepted_past_it():
    """A stop string ends the output where it begins: what a verification accepted after it was never output."""
    from decodekit.speculative.drafters.suffix import corpus_for

    model = tiny(seed=0)
    engine = Engine(model)
    plain = engine.generate(PROMPTS[1], max_new_tokens=40, chat=False, ignore_eos=True)
    stops = [plain.text[i : i + 2] for i in range(4, len(plain.text) - 8, 3)]
    cut = 0
    for stop in stops:
        got = engine.generate(PROMPTS[1], method="suffix", corpus=True, max_new_tokens=40, chat=False, budget=16,
                              ignore_eos=True, stop=[stop])
        assert got.finish_reason == "stop" and got.tokens == engine.generate(
            PROMPTS[1], max_new_tokens=40, chat=False, ignore_eos=True, stop=[stop]).tokens
        assert corpus_for(model.backend).documents[-1] == got.tokens
        cut += len(got.cut_off) > 0
    assert cut  # some verification did accept tokens past its stop string


def test_suffix_trees_are_no_deeper_than_max_depth():
    """The depth cap holds however long the match is (growth x match length would go deeper)."""
    state = state_for([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6])  # the last six tokens occurred before: a match of 6
    deep, capped = SuffixDrafter(), SuffixDrafter(max_depth=2)
    for drafter in (deep, capped):
        drafter.begin(state)
    assert deep.draft(state, 8).tokens == [1, 2, 3, 4, 5, 6]  # what followed the match, as far as it goes
    tree = capped.draft(state, 8)
    assert tree.tokens == [1, 2] and tree.parents == [-1, 0]


def test_the_longer_of_the_contexts_and_the_corpus_match_drafts_first():
    """With the corpus on, the context's own match and the corpus's compete for the budget: the
    longer match (more evidence) drafts first."""
    from decodekit.speculative.drafters.suffix import corpus_for

    state = state_for([1, 2, 3, 9, 1, 2])  # its own longest repeat is "1 2" (then 3)
    corpus_for(state.backend).add([9, 1, 2, 4])  # an earlier output holds "9 1 2" (then 4, and it ends)
    drafter = SuffixDrafter(corpus=True)
    drafter.begin(state)
    tree = drafter.draft(state, 1)
    assert (tree.tokens, tree.source) == ([4], ["suffix:corpus"])
    tree = drafter.draft(state, 2)  # the corpus has no more to say: the context's match takes the rest
    assert (tree.tokens, tree.parents, tree.source) == ([4, 3], [-1, -1], ["suffix:corpus", "suffix"])


def test_a_match_that_repeats_the_first_ones_drafts_still_fills_the_budget():
    """The second match's nodes that the first already drafted merge into them and take no room:
    the budget is filled with its new ones (growing it to only the room left left that room empty)."""
    from decodekit.speculative.drafters.suffix import corpus_for

    state = state_for([1, 2, 3, 9, 1, 2])  # its own longest repeat is "1 2": then 3, 9
    corpus_for(state.backend).add([9, 1, 2, 3, 5])  # the corpus's longer "9 1 2": then 3, 5
    drafter = SuffixDrafter(corpus=True)
    drafter.begin(state)
    tree = drafter.draft(state, 3)
    assert (tree.tokens, tree.parents, tree.source) == ([3, 5, 9], [-1, 0, 0], ["suffix:corpus", "suffix:corpus", "suffix"])


def test_a_suffix_drafter_begun_again_matches_the_new_context_in_the_corpus_afresh():
    """A drafter reused for another request forgets the last context's corpus match: the new
    context "3" is followed by 4 and by 5 in the corpus, not only by what followed "1 2 3"."""
    from decodekit.speculative.drafters.suffix import corpus_for

    first = state_for([1, 2])
    corpus = corpus_for(first.backend)
    corpus.add([1, 2, 3, 4])
    corpus.add([3, 5])
    drafter = SuffixDrafter(corpus=True)
    drafter.begin(first)
    second = DecodeState(first.backend, Sampler(greedy=True), [3], GenerationStats())
    drafter.begin(second)
    assert sorted(drafter.draft(second, 2).tokens) == [4, 5]


def test_a_full_corpus_keeps_its_newest_outputs(monkeypatch):
    """Past its size limit the corpus keeps the newest half: recent outputs are the likeliest to recur."""
    from decodekit.speculative.drafters import suffix

    monkeypatch.setattr(suffix, "CORPUS_LIMIT", 10)
    corpus = suffix.Corpus()
    corpus.add([1, 2, 3])
    corpus.add([4, 5, 6])
    corpus.add([7, 8, 9, 10])  # 4 + 4 + 5 tokens with separators: over 10, the newest that fit in 5 stay
    assert corpus.documents == [[7, 8, 9, 10]]
    sam = corpus.automaton
    assert 8 in sam.next[sam.next[0][7]] and 1 not in sam.next[0]


def test_a_full_corpus_counts_the_separators_in_the_half_it_keeps(monkeypatch):
    """The corpus's size is its automaton's, separators included: the newest half of a limit of 10 is
    5 tokens, and [4, 5, 6] + [7, 8] with their separators are 7 of them, so only [7, 8] stays."""
    from decodekit.speculative.drafters import suffix

    monkeypatch.setattr(suffix, "CORPUS_LIMIT", 10)
    corpus = suffix.Corpus()
    for doc in ([1, 2, 3], [4, 5, 6], [7, 8]):  # 4 + 4 + 3 = 11 tokens with separators: over 10
        corpus.add(doc)
    assert corpus.documents == [[7, 8]] and corpus.automaton.size == 3


def test_an_empty_output_adds_nothing_to_the_corpus():
    """A request that generated nothing leaves the corpus as it was: no empty document, no separator
    taking room under the corpus's size limit."""
    from decodekit.speculative.drafters.suffix import Corpus

    corpus = Corpus()
    corpus.add([])
    assert corpus.documents == [] and corpus.automaton.size == 0
    corpus.add([1, 2])
    corpus.add([])
    assert corpus.documents == [[1, 2]] and corpus.automaton.size == 3


def test_recycling_best_first_tree_follows_the_rank_weights():
    """The tree is grown best-first by path score, the product of the successors' rank weights
    (0.55, 0.18, ...): a first successor's first successor (0.55^2 = 0.30) before the root's second
    (0.18), and that before a third level (0.55^3 = 0.17)."""
    from decodekit.speculative.drafters.recycling import RANK_WEIGHTS, TokenRecycling

    state = state_for([1, 2, 5], vocab=64)
    drafter = TokenRecycling(k=2)
    drafter.begin(state)
    for token, row in {5: [10, 11], 10: [20, 21], 11: [30, 31], 20: [40, 41]}.items():
        drafter.matrix[token, :2] = torch.tensor(row, dtype=torch.int32)
    assert RANK_WEIGHTS[0] ** 2 > RANK_WEIGHTS[1] > RANK_WEIGHTS[0] ** 3 > RANK_WEIGHTS[0] * RANK_WEIGHTS[1]
    tree = drafter.draft(state, 4)
    assert tree.tokens == [10, 20, 11, 40] and tree.parents == [-1, 0, -1, 1]


def test_a_request_with_fewer_successors_reads_the_rows_a_wider_one_learnt():
    """The successor matrix is kept across requests; only one asking for more columns starts a wider one."""
    from decodekit.speculative.drafters.recycling import TokenRecycling

    state = state_for([1, 2, 5], vocab=64)
    wide = TokenRecycling(k=8)
    wide.begin(state)
    wide.matrix[5, :8] = torch.arange(10, 18, dtype=torch.int32)
    narrow = TokenRecycling(k=2)
    narrow.begin(state)
    assert narrow.matrix is wide.matrix
    assert narrow.draft(state, 2).tokens == [10, 11]


def test_a_narrower_request_drafts_from_only_its_own_columns_of_a_wider_matrix():
    """A request with k = 2 on the matrix a k = 8 one left reads each row's first two successors only,
    at every level: its tree is the best-first tree of the two-column table."""
    from decodekit.speculative.drafters.recycling import TokenRecycling

    state = state_for([1, 2, 5], vocab=64)
    wide = TokenRecycling(k=8)
    wide.begin(state)
    wide.matrix[5, :8] = torch.arange(10, 18, dtype=torch.int32)
    wide.matrix[10, :8] = torch.arange(20, 28, dtype=torch.int32)
    narrow = TokenRecycling(k=2)
    narrow.begin(state)
    tree = narrow.draft(state, 16)
    edges = {(token, -1 if parent < 0 else tree.tokens[parent]) for token, parent in zip(tree.tokens, tree.parents)}
    # below the root: 10 and 11 (row 5's first two); below 10: 20 and 21; rows 11, 20, 21 are empty
    assert edges == {(10, -1), (11, -1), (20, 10), (21, 10)} and len(tree) == 4


def test_a_request_with_more_successors_than_the_held_matrix_starts_a_wider_one():
    """A request asking for more columns than the backend's matrix has gets a wider one, which it
    fills and drafts from: its root's successors are the top k of the verification logits."""
    from decodekit.speculative.drafters.recycling import TokenRecycling

    state = state_for([1, 2, 5], vocab=64)
    narrow = TokenRecycling(k=2)
    narrow.begin(state)
    wide = TokenRecycling(k=4)
    wide.begin(state)
    assert wide.matrix.shape[1] >= 4
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
    wide.update(state, DraftTree(), Verification([], 0), logits)
    tree = wide.draft(state, 4)
    assert tree.parents == [-1] * 4 and tree.tokens == torch.topk(logits[0], 4).indices.tolist()


def test_recycling_matrix_is_kept_across_requests():
    engine = Engine(tiny(seed=6))
    first = engine.generate("abc", method="recycling", max_new_tokens=30, chat=False, budget=8)
    second = engine.generate("abc", method="recycling", max_new_tokens=30, chat=False, budget=8)
    # the first run starts from an empty matrix (no draft for unseen tokens: plain steps); the
    # second drafts at every step from rows the first one filled, but where one token is left
    # (a draft there would be thrown away)
    assert first.stats.extra["plain_steps"] > 1
    assert second.stats.extra["plain_steps"] <= 1 and second.tokens == first.tokens


def test_recycling_rows_a_narrower_request_refreshed_hold_no_stale_wider_columns():
    """A request with k=2 refreshed a row's first two columns only: a later k=8 request read those
    beside an older request's six, the same token twice among a node's successors (siblings must
    be distinct tokens)."""
    from decodekit.speculative.drafters.recycling import adjacency_for

    engine = Engine(tiny(seed=6))
    for k in (8, 2, 8):
        engine.generate("abcabc", method="recycling", max_new_tokens=30, chat=False, budget=8, k=k)
        if k == 2:
            matrix = adjacency_for(engine.model.backend, 8)
            for row in matrix.tolist():
                successors = [t for t in row if t >= 0]
                assert len(successors) == len(set(successors)), row


def test_recycling_proposes_token_0_and_ends_a_branch_only_at_an_unfilled_row():
    """-1 marks a row never filled; token 0 is a token like any other."""
    from decodekit.speculative.drafters.recycling import TokenRecycling

    drafter = TokenRecycling(k=2, max_depth=2)
    drafter.matrix = torch.full((5, 2), -1, dtype=torch.int32)
    drafter.matrix[4] = torch.tensor([0, 3])
    drafter.matrix[0] = torch.tensor([2, -1])
    tree = drafter.draft(state_for([1, 4]), 8)
    # after 4: 0 and 3; after 0: 2; after 3: nothing yet
    assert sorted(zip(tree.tokens, tree.parents)) == sorted([(0, -1), (3, -1), (2, tree.tokens.index(0))])


def test_lookahead_pool_feeds_accepted_drafts():
    engine = Engine(tiny(seed=0))
    g = engine.generate(PROMPTS[1], method="lookahead", max_new_tokens=60, chat=False, budget=16)
    assert g.stats.extra["mean_accepted"] > 1.0


# The drafter contract ------------------------------------------------------------------------------


def test_optional_drafter_hooks_are_no_ops_on_the_base_class():
    class Minimal(Drafter):
        def draft(self, state, budget):
            return DraftTree()

    drafter, state = Minimal(), state_for([1, 2, 3])
    drafter.begin(state)
    drafter.update(state, DraftTree(), Verification([], 0), torch.zeros(1, 32))
    drafter.observe(2, 0.1)
    drafter.finish(state)
    assert drafter.report() == {} and drafter.trimmable is True
    assert state.tokens == [1, 2, 3]


def test_the_loop_calls_every_hook_of_the_contract():
    """The loop relies on the base class's hooks, not on probing drafters for them."""
    calls: list[str] = []

    class Recording(PromptLookup):
        trimmable = False

        def observe(self, tokens, seconds):
            calls.append("observe")

        def report(self):
            return {"recorded": True}

        def finish(self, state):
            calls.append("finish")

    model = tiny(seed=0)
    method = SpeculativeMethod(Recording(), Controller(8, budget=4))
    g = StepDecoder(method).generate(model, Request(model.tokenizer.encode(PROMPTS[1]), Sampler(greedy=True), 12))
    steps = g.stats.extra["verifications"] + g.stats.extra["plain_steps"]
    assert calls == ["observe"] * steps + ["finish"] and g.stats.extra["recorded"] is True


@pytest.mark.parametrize("budget", [4, 0], ids=["speculating", "resting"])
def test_the_drafter_observes_every_token_each_step_produced(budget):
    """``observe(tokens, seconds)`` gets what each step produced (the bonus included; a plain step's one
    token, also while speculation rests): all the tokens but the first, which the prefill's logits gave."""
    observed: list[int] = []

    class Recording(PromptLookup):
        def observe(self, tokens, seconds):
            observed.append(tokens)

    model = tiny(seed=0)
    method = SpeculativeMethod(Recording(), Controller(8, budget=budget))
    g = StepDecoder(method).generate(model, Request(model.tokenizer.encode(PROMPTS[1]), Sampler(greedy=True), 24))
    assert g.finish_reason == "length" and len(g.tokens) == 24
    assert sum(observed) == len(g.tokens) - 1 and min(observed) >= 1
    if budget:
        assert g.stats.extra["accepted"] > 0 and max(observed) > 1
    else:
        assert g.stats.extra["plain_steps"] == len(observed)


def test_one_drafter_registry_with_the_shared_mechanisms_in_the_base_module():
    from decodekit.speculative import drafters
    from decodekit.speculative.drafters import base

    assert not hasattr(drafters, "DRAFTERS")
    assert set(speculative_methods()) == set(drafters.DRAFTER_SPECS)
    assert all(spec.name == name and callable(spec.factory) for name, spec in drafters.DRAFTER_SPECS.items())
    assert drafters.DRAFTER_SPECS["auto"].factory.__module__ == "decodekit.speculative.drafters.bandit"
    for shared in ("ContextDrafter", "ChainDrafter", "CompositeDrafter"):
        assert getattr(base, shared).__module__ == base.__name__


@pytest.mark.parametrize("cache", ["full", "int8"])
def test_a_verification_never_passes_more_rows_than_the_kernels_take(cache, monkeypatch):
    """A budget of 100 drafts asks for trees of 101 rows: past the kernels' 64 a pass went to torch
    (not one-token steps' bits) and the int8 cache refused it mid-request. Passes hold 64 at most."""
    from decodekit.models.kernels import MAX_ROWS
    from decodekit.models.native import NativeLlama

    rows: list[int] = []
    verify = NativeLlama.verify_tree
    monkeypatch.setattr(NativeLlama, "verify_tree", lambda self, tokens, parents: (
        rows.append(len(parents)), verify(self, tokens, parents))[1])
    backend = tiny_llama(seed=0, hidden_size=64)  # (head size 16: the int8 cache's kernels)
    engine = Engine(LoadedModel(backend if cache == "full" else backend.with_kv_cache(cache), CharTokenizer(96), "tiny"))
    asked = {"max_new_tokens": 150, "ignore_eos": True, "chat": False}
    g = engine.generate("abcabcabc", method="draft", draft_model="self-truncated:1", budget=100, max_draft=100,
                        confidence=0.0, **asked)
    assert max(rows) == MAX_ROWS and g.tokens == engine.generate("abcabcabc", **asked).tokens


def test_a_composite_with_an_all_or_nothing_part_is_all_or_nothing():
    """Lookahead's window is verified whole or not at all: inside hierarchy its merged tree is too,
    and as an arm of auto, the steps that arm drafts (the controller trimmed them node by node)."""
    from decodekit.speculative.drafters.bandit import BanditDrafter
    from decodekit.speculative.drafters.hierarchy import HierarchyDrafter

    assert HierarchyDrafter().trimmable and not HierarchyDrafter(order="pld,lookahead").trimmable
    auto = BanditDrafter(arms="pld,lookahead")
    assert auto.trimmable  # no arm chosen yet
    for arm, trimmable in (("lookahead", False), ("pld", True)):
        auto.chosen = arm
        assert auto.trimmable is trimmable


def test_a_clone_shares_the_weights_but_not_what_the_parent_learnt():
    """Backend.memory is the one home of what methods learn per model; a clone starts it empty."""
    from decodekit.speculative.drafters.bandit import BanditDrafter
    from decodekit.speculative.drafters.recycling import adjacency_for
    from decodekit.speculative.drafters.suffix import corpus_for

    engine = Engine(tiny(seed=7))
    parent = engine.model.backend
    for method, options in (("suffix", {"corpus": True}), ("recycling", {}), ("auto", {})):
        engine.generate(PROMPTS[0], method=method, max_new_tokens=24, chat=False, cost_table=FLAT_COSTS, **options)
    clone = parent.clone()
    assert clone.weights is parent.weights

    def learnt(backend) -> dict:
        ctl = Controller(8, cost_table=FLAT_COSTS)
        ctl.begin(backend, "recycling")
        auto = BanditDrafter()
        auto.begin(DecodeState(backend, Sampler(greedy=True), [1, 2, 3], GenerationStats()))
        return {
            "corpus": len(corpus_for(backend).documents),
            "recycling rows": int((adjacency_for(backend, 8) >= 0).any(dim=1).sum()),
            "controller": ctl.learnt.spec_steps + len(ctl.learnt.accept),
            "bandit": sum(auto.bandit.count.values()),
        }

    assert all(learnt(parent).values())
    assert not any(learnt(clone).values())
    # a clone decodes like a fresh backend over the same weights: recycling starts from an empty table
    again = Engine(LoadedModel(clone, engine.model.tokenizer, "tiny")).generate(
        "abc", method="recycling", max_new_tokens=24, chat=False, budget=8
    )
    assert again.tokens == engine.generate("abc", max_new_tokens=24, chat=False).tokens
    assert again.stats.extra["plain_steps"] > 0


# Controller ---------------------------------------------------------------------------------------


def test_cost_table_interpolates_and_extrapolates():
    table = CostTable({1: 1.0, 4: 2.5, 8: 3.0})
    assert table(1) == 1.0 and table(2) == pytest.approx(1.5) and table(6) == pytest.approx(2.75)
    assert table(12) == pytest.approx(3.5)


def test_a_falling_cost_table_never_prices_a_pass_at_zero_or_below():
    """A user's table may say two tokens cost less than one: extended past its last size by that
    falling slope it reached zero at 3 tokens, and the controller divided by it (ZeroDivisionError).
    Past the last size a table never falls; a request decodes."""
    table = CostTable({1: 0.010, 2: 0.005})
    assert [table(n) for n in (3, 8, 64)] == [0.005] * 3
    model = LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny")
    decoder = build_decoder("pld", cost_table={"1": 0.010, "2": 0.005})
    tokens = decoder.generate(model, Request(model.prompt_ids("abcabcabc", chat=False), Sampler(greedy=True), 40, ignore_eos=True))
    assert len(tokens.tokens) == 40


def test_a_request_starts_without_the_last_ones_pause():
    """The back-off level carries over to the next request, its pause does not: a new prompt is
    judged at its first step (an evaluation reusing one decoder began items with hundreds of plain steps)."""
    ctl = Controller(4, cost_table={1: 1.0, 2: 1.9, 4: 3.7})
    ctl.begin(tiny_llama(seed=0), "d")
    for _ in range(3):
        ctl.select(chain_tree(4))  # nothing pays at these costs: back off
    assert ctl.budget() == 0
    ctl.begin(tiny_llama(seed=0), "d")
    assert ctl.budget() > 0


def test_a_table_of_one_size_prices_n_tokens_as_n_passes():
    """Extrapolated by the last segment's slope; with the one-token cost alone, the line through zero:
    nothing known says a many-token pass is cheaper than that many one-token passes."""
    table = CostTable({1: 0.5})
    assert table(1) == 0.5 and table(4) == pytest.approx(2.0)


def test_a_short_context_never_prices_a_pass_below_a_tenth_of_its_measured_cost():
    """The context term is extrapolated down to short contexts, but a pass still reads the weights."""
    table = CostTable({1: 1.0, 2: 1.5}, at=1000, per_context={1: 0.001, 2: 0.002})
    assert table(1, 500) == pytest.approx(0.5)
    assert table(1, 0) == pytest.approx(0.1) and table(2, 0) == pytest.approx(0.15)


def test_an_observed_pass_moves_the_measured_size_nearest_in_ratio():
    """10 tokens are nearer 12 than 8 in ratio (10/8 > 12/10): a slow 10-token pass raises 12's cost."""
    table = CostTable({1: 1.0, 8: 2.0, 12: 3.0})
    table.observe(10, 1.5 * table(10))  # clamped to 1.5x, blended by 0.2: +10%
    assert table(12) == pytest.approx(3.3) and table(8) == 2.0 and table(1) == 1.0


def chain_tree(n: int, source: str = "s") -> DraftTree:
    return DraftTree.chain(list(range(1, n + 1)), source)


def test_controller_keeps_whole_chain_when_verification_is_free_and_nothing_when_it_is_not():
    flat = Controller(16, cost_table=FLAT_COSTS)
    assert len(flat.select(chain_tree(8))) == 8
    steep = Controller(16, cost_table=STEEP_COSTS)
    assert len(steep.select(chain_tree(8))) == 0
    assert steep.budget() == 0  # backs off drafting after a plain choice


def test_in_a_full_batch_the_controller_weighs_everyone_and_drafts_less():
    """SmartSpec's goodput rule: rows are nearly free up to 8 and then cost in proportion. Alone,
    a well-accepted chain of 6 pays; beside 15 sequences whose 15 rows already fill the cheap part,
    its rows would slow all 16 and it is not verified; the batcher reports the others' rows."""
    from decodekit.models.batching import PassBatcher

    costs = {1: 1.0, 8: 1.1, 16: 2.2, 64: 8.8}
    alone, batched = Controller(16, cost_table=costs), Controller(16, cost_table=costs)
    for ctl in (alone, batched):
        for _ in range(30):
            ctl.observe(chain_tree(6), Verification(list(range(6)), 0), overhead_s=0.0)
    me, batcher = object(), PassBatcher()
    batcher._last_batch = {id(me): 1, **{i: 1 for i in range(15)}}
    assert batcher.others(me) == (15, 15)
    batched._batch = lambda: batcher.others(me)
    assert len(alone.select(chain_tree(6))) == 6
    assert len(batched.select(chain_tree(6))) == 0
    batcher._last_batch = {id(me): 1, 0: 1}  # one other sequence: rows are cheap again
    assert len(batched.select(chain_tree(6))) == 6
    learning = Controller(16, cost_table=CostTable(costs))
    learning.learn_costs, learning._batch = True, batched._batch
    learning.observe_cost(1, 5.0)  # a batched pass's time is not one sequence's cost
    assert learning.pass_cost(1) == 1.0


def test_node_keys_are_source_depth_and_rank_among_the_same_parents_children():
    """Acceptance is tracked per (source, depth, sibling rank): a node's depth is its parent's plus
    one, not the previous node's, and its rank counts only its own siblings drafted before it."""
    tree = DraftTree([1, 2, 3, 4, 5], [-1, 0, 0, -1, 3], {}, ["s", "s", "s", "t", "t"])
    assert node_keys(tree) == [("s", 0, 0), ("s", 1, 0), ("s", 1, 1), ("t", 0, 1), ("t", 1, 0)]


def test_a_tree_that_cannot_be_trimmed_is_verified_whole_or_not_at_all():
    """A lookahead window is all or nothing: where its first node alone would pay but the whole
    window does not, a plain step is taken, not the first node."""
    costs = {1: 1.0, 2: 1.1, 3: 1.2, 4: 3.0}
    trimming, whole = Controller(8, cost_table=costs), Controller(8, cost_table=costs)
    for ctl in (trimming, whole):
        ctl.learnt.accept.update({("s", 0, 0): 1.0, ("s", 1, 0): 0.0})  # first node always right, the rest never
    # the first node alone: 2 tokens for cost(2) = 1.1; the window of 3: still 2 tokens, for cost(4) = 3.0
    assert len(trimming.select(chain_tree(3))) == 1
    assert len(whole.select(chain_tree(3), trimmable=False)) == 0


def test_the_verifiers_bookkeeping_is_charged_to_speculative_steps_only():
    """A speculative step costs its pass plus the verifier's bookkeeping, a plain step its pass
    alone: bookkeeping that eats the gain makes a plain step the choice, both when trimming a tree
    and when planning a costly drafter's chain."""
    flat = {1: 1.0, 64: 1.0}

    def controller(overhead: float) -> Controller:
        ctl = Controller(8, cost_table=flat)
        ctl.learnt.accept[("s", 0, 0)] = 0.3  # deeper levels borrow it
        ctl.learnt.chain_source = "s"
        ctl.observe_draft(1, 0.1)  # 0.1 of a plain step per drafted node: drafting is planned
        ctl.overhead = overhead
        return ctl

    # no bookkeeping: one node gives 1.3 tokens per pass (select), or 1.3 / 1.1 when drafted (planned)
    assert len(controller(0.0).select(chain_tree(8))) > 0 and controller(0.0).best_chain_depth() > 0
    # 0.5 s of it: at most (1 + 0.3 / 0.7) / 1.5 = 0.95 tokens per second against plain decoding's 1 / 1.0
    assert len(controller(0.5).select(chain_tree(8))) == 0
    assert controller(0.5).best_chain_depth() == 0 and controller(0.5).budget() == 0


def test_drafting_is_costly_by_the_cost_of_a_call_not_of_a_node():
    """A lookup costs the same whether it finds a node or none: a call at 1% of a plain step is
    cheap even when most calls find nothing (per node it would look dear), and a drafter paying
    1.5% per node is costly when a call drafts 8."""
    lookup = Controller(8, cost_table={1: 1.0, 8: 1.5})
    lookup.observe_draft(1, 0.01)
    for _ in range(40):
        lookup.observe_draft(0, 0.01)  # mostly no match: about 0.002 nodes per call
    assert lookup.draft_node_s > 1.0 and not lookup.costly_drafting()
    assert lookup.budget() == 8  # drafts the whole budget; select() trims
    model = Controller(8, cost_table={1: 1.0, 8: 1.5})
    model.observe_draft(8, 8 * 0.015)
    assert model.draft_node_s == pytest.approx(0.015) and model.costly_drafting()


def test_the_controller_verifies_the_most_probable_nodes_not_the_first_drafted():
    """The kept subset maximises expected tokens per second, so nodes are taken by their estimated
    probability: where one node pays, it is the likelier sibling even if it was drafted second."""
    ctl = Controller(8, cost_table={1: 1.0, 2: 1.0, 3: 2.0})
    ctl.learnt.accept.update({("s", 0, 0): 0.2, ("s", 0, 1): 0.6})
    tree = DraftTree()
    tree.add(10, -1, "s")
    tree.add(11, -1, "s")
    kept = ctl.select(tree)
    assert kept.tokens == [11] and kept.parents == [-1]


def test_controller_learns_acceptance_per_depth():
    ctl = Controller(16, cost_table={1: 1.0, 2: 1.05, 4: 1.15, 8: 1.4, 16: 2.0})
    tree = chain_tree(8)
    before = len(ctl.select(tree))
    for _ in range(30):  # drafts always right: every depth accepted
        ctl.observe(tree, Verification(list(range(8)), 0), overhead_s=0.0)
    assert len(ctl.select(tree)) == 8 > before
    for _ in range(60):  # now always wrong at depth 0
        ctl.observe(tree, Verification([], 0), overhead_s=0.0)
    assert len(ctl.select(tree)) == 0


def test_controller_explores_after_backing_off():
    ctl = Controller(16, cost_table=STEEP_COSTS)
    chosen = []
    for _ in range(40):
        budget = ctl.budget()
        chosen.append(len(ctl.select(chain_tree(4))) if budget else 0)
    assert 0 < sum(1 for c in chosen if c) <= 6  # a few single-node probes, mostly plain steps
    assert max(chosen) == 1


def test_costly_drafting_is_planned_before_drafting():
    """A drafter that costs half a forward pass per node (layer skipping, a draft model) is only
    asked for the chain depth that pays, and not at all when acceptance is too low."""
    costs = {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.6, 16: 2.2}
    good, poor = Controller(8, cost_table=costs), Controller(8, cost_table=costs)
    for ctl, accepted in ((good, list(range(8))), (poor, [])):
        ctl.observe_draft(8, 8 * 0.5)
        for _ in range(60):
            ctl.observe(chain_tree(8, ""), Verification(accepted, 0), overhead_s=0.0)
    depth = good.budget()
    assert 1 < depth <= 8
    # the chosen depth really is the best of every depth under the controller's own model
    def rate(d: int) -> float:
        reach = [math.prod(good._accept(("", j, 0)) for j in range(i + 1)) for i in range(d)]
        return (1 + sum(reach)) / (d * 0.5 + good.cost(d + 1))
    assert rate(depth) >= max(rate(d) for d in range(1, 9)) - 1e-9 and rate(depth) > 1.1
    budgets = []  # mostly plain steps without drafting,
    for _ in range(40):
        budgets.append(poor.budget())
        if budgets[-1]:
            poor.select(chain_tree(budgets[-1], ""))
    assert budgets[0] == 0 and set(budgets) == {0, 1} and budgets.count(1) <= 5  # a few 1-node probes
    cheap = Controller(8, cost_table=costs)
    cheap.observe_draft(8, 1e-6)
    assert cheap.budget() == 8  # nearly free drafting: draft the whole budget, trim later


def test_a_first_draft_call_that_found_nothing_counts_as_one_node():
    """Its time is spread over one node, not over none (which would price drafting too dear ever to
    plan): a drafter whose chains are accepted is still asked for a chain."""
    costs = {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.6}
    ctl = Controller(8, cost_table=costs)
    ctl.observe_draft(0, 0.1)
    assert ctl.draft_node_s == pytest.approx(0.1)
    for _ in range(30):
        ctl.observe(chain_tree(4, ""), Verification([0, 1, 2, 3], 0), overhead_s=0.0)
    assert ctl.budget() > 0


def test_drafting_costs_carry_over_to_the_next_request_on_the_same_backend():
    """A costly drafter that did not pay in one request is not drafted from at the start of the next."""
    backend = tiny_llama(seed=0)
    costs = {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.6}
    first = Controller(8, cost_table=costs)
    first.begin(backend, "slow-drafter")
    first.observe_draft(4, 4 * 0.6)
    for _ in range(40):
        first.observe(chain_tree(4, ""), Verification([], 0), overhead_s=0.0)
    second = Controller(8, cost_table=costs)
    second.begin(backend, "slow-drafter")
    assert second.draft_node_s == pytest.approx(0.6) and second.budget() == 0
    fresh = Controller(8, cost_table=costs)
    fresh.begin(tiny_llama(seed=1), "slow-drafter")  # another backend knows nothing yet: drafts to measure
    assert fresh.budget() == 8


def probes(ctl: Controller, steps: int, draft_s_per_node: float = 0.0) -> int:
    """Run the loop's decisions for ``steps`` steps with drafts (chains of up to 4) that always
    fail; count the verifications."""
    count = 0
    for _ in range(steps):
        budget = ctl.budget()
        if budget:
            ctl.observe_draft(budget, budget * draft_s_per_node)
            tree = ctl.select(chain_tree(min(budget, 4)))
            if len(tree):
                count += 1
                ctl.observe(tree, Verification([], 0), overhead_s=0.0)  # the probe fails
    return count


def test_probes_are_rarer_when_they_cost_more():
    cheap = Controller(16, cost_table={1: 1.0, 2: 1.02, 64: 3.0})
    dear = Controller(16, cost_table=STEEP_COSTS)
    for ctl in (cheap, dear):  # learn first that these drafts fail
        for _ in range(40):
            ctl.observe(chain_tree(4), Verification([], 0), overhead_s=0.0)
    assert probes(cheap, 400) > 3 * probes(dear, 400) > 0


def test_never_slower_than_plain_with_wrong_drafts_and_costly_verification():
    engine = Engine(tiny(seed=0))
    g = engine.generate("hello there", method="recycling", k=1, max_new_tokens=80, chat=False, cost_table=STEEP_COSTS)
    plain = engine.generate("hello there", max_new_tokens=80, chat=False)
    assert g.tokens == plain.tokens
    assert g.stats.extra["verifications"] <= 0.2 * g.stats.forward_passes


def test_cost_table_measurement_restores_the_cache():
    backend = tiny_llama(seed=0)
    backend.prefill([1, 2, 3])
    table = CostTable.measure(backend, sizes=(1, 4), rounds=1)
    assert backend.length == 3 and table.sizes == [1, 4] and all(c > 0 for c in table.costs)


def test_the_per_context_term_is_fitted_on_the_sizes_timed_at_both_contexts():
    """A size with no room at the long context (a short model's context) says nothing of its
    per-context term: it used to count as a term of zero, halving the fitted term of the sizes that
    were timed at both; and with no size timed at both there is no term at all."""
    table = CostTable.from_rows({0: {1: 1.0, 8: 2.0}, 1000: {1: 2.0}})
    assert table(1, 1000) == pytest.approx(2.0) and table(8, 1000) == pytest.approx(3.0)  # one point: flat
    alone = CostTable.from_rows({0: {1: 1.0, 8: 2.0}, 1000: {16: 9.0}})
    assert alone(1, 1000) == alone(1, 0) == 1.0


def test_a_size_is_timed_over_a_run_of_its_own_passes_its_first_untimed(monkeypatch):
    """A pass right after passes of another size can cost far more than in a run of its own size:
    each size runs for RUN_S (two passes at least) and the fastest pass after the first is kept,
    in every round. Here a run's passes cost 0.5 units a token (never timed, whatever it costs), then
    5, 4, 3, 2, 1, 1, ..."""
    from decodekit.speculative import controller

    clock, appended = [0.0], []

    class Scripted:
        length, info = 7, SimpleNamespace(max_length=100)

        def append(self, tokens):
            n = tokens.shape[1]
            run = sum(1 for _ in itertools.takewhile(lambda m: m == n, reversed(appended)))
            appended.append(n)
            clock[0] += (0.5 if run == 0 else max(1, 6 - run)) * n

        def truncate(self, length):
            assert length == 7

    monkeypatch.setattr(controller.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(controller, "RUN_S", 15)
    best = CostTable._time_passes(Scripted(), (1, 40, 200), rounds=2)
    assert best == {1: 1, 40: 40 * 5}  # 200 does not fit the context
    runs = [len(list(group)) for _, group in itertools.groupby(appended)]
    assert runs == [6, 2, 6, 2]  # 0.5+5+4+3+2+1 units fill a run of 15; 40's first pass alone (20) overruns it


def test_a_table_measured_after_a_long_prompt_also_has_the_short_contexts(monkeypatch):
    """Measured at the prompt's length alone, a table would price every pass of a later short
    request at the long prompt's cost: the standard contexts are measured on an empty twin, the
    prompt's length in place, and the cache is left as it was."""
    backend = tiny_llama(seed=0, max_position=4096)
    backend.prefill([i % 95 + 1 for i in range(1499)])
    logits = backend.step(torch.tensor([5]))
    backend.truncate(1499)
    timed, time_passes = [], CostTable._time_passes

    def spy(measured, sizes, rounds):  # which passes ran, not their timings
        timed.append((measured is backend, measured.length))
        return time_passes(measured, sizes, rounds)

    monkeypatch.setattr(CostTable, "_time_passes", staticmethod(spy))
    table = CostTable.measure(backend, sizes=(1, 4), rounds=1)
    assert timed == [(False, MEASURE_CONTEXTS[0]), (False, MEASURE_CONTEXTS[1]), (True, 1499)]  # the twin, then in place
    assert table.at == MEASURE_CONTEXTS[0]
    assert backend.length == 1499 and torch.equal(backend.step(torch.tensor([5])), logits)


@pytest.mark.parametrize("cache", ["int4:group=8,residual=64", "sink:2,window:40"])
def test_a_cache_that_cannot_roll_back_far_is_measured_on_its_twin_and_keyed_apart(cache):
    """The standard contexts would evict (StreamingLLM) or quantise (int4) entries that rolling
    back to the cache's length needs: they are timed on an empty twin, an empty cache included."""
    backend = tiny_llama(seed=0, hidden_size=64, max_position=4096).with_kv_cache(cache)
    table = CostTable.measure(backend, sizes=(1, 32), rounds=1)
    assert table.sizes == [1, 32] and backend.length == 0
    prompt = [i % 95 + 1 for i in range(1499)]
    backend.prefill(prompt)
    logits = backend.step(torch.tensor([5]))
    backend.truncate(1499)
    table = CostTable.measure(backend, sizes=(1, 32), rounds=1)
    assert table.sizes == [1, 32] and backend.length == 1499 and torch.equal(backend.step(torch.tensor([5])), logits)
    assert CostTable.key(backend) != CostTable.key(tiny_llama(seed=0, hidden_size=64))


def test_cost_table_follows_observed_pass_times():
    table = CostTable({1: 1.0, 8: 2.0, 32: 4.0})
    for _ in range(40):
        table.observe(8, 6.0)  # the machine is now three times slower at 8 tokens
    assert table(8) == pytest.approx(6.0, rel=0.01) and table(1) == 1.0


def test_one_stalled_pass_moves_the_cost_table_by_at_most_ten_percent():
    table = CostTable({1: 1.0, 8: 2.0})
    table.observe(1, 50.0)  # another process took the CPU for this pass
    assert table(1) == pytest.approx(1.1)
    table.observe(1, 0.01)
    assert table(1) == pytest.approx(1.1 - 0.2 * (1.1 - 1.1 / 1.5))


def test_a_pass_costs_more_after_a_longer_context():
    table = CostTable.from_rows({100: {1: 1.0, 2: 1.2}, 1100: {1: 2.0, 2: 3.2}})
    assert table.at == 100 and table(1, 100) == 1.0 and table(2, 1100) == pytest.approx(3.2)
    assert table(2, 600) == pytest.approx(2.2) and table(1, 0) == pytest.approx(0.9)
    assert table(2) == 1.2  # no context given: the costs as measured at the shorter one


def test_a_measured_table_never_prices_a_pass_above_a_longer_one():
    """Another process only ever adds time: a size measured dearer than a larger one (a stalled
    pass) takes the larger one's cost, at every measured context."""
    table = CostTable.from_rows({256: {1: 1.0, 2: 3.0, 4: 2.0, 8: 4.0}, 1024: {1: 2.0, 2: 2.5, 4: 9.0, 8: 5.0}})
    assert [table(n, 256) for n in (1, 2, 4, 8)] == [1.0, 2.0, 2.0, 4.0]
    costs = [table(n, 1024) for n in (1, 2, 4, 8)]
    assert costs == sorted(costs)


def test_the_context_term_is_one_line_through_the_sizes():
    """Every row of a pass reads the context (a) and attends to it (b per row): the per-context
    term is a + b n, fitted to all sizes, so one noisy size does not decide the price of long
    prompts; on a line it is recovered exactly; never negative."""
    near = {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7}
    on_line = {n: cost + 1000 * (2e-3 + 1e-3 * n) for n, cost in near.items()}
    table = CostTable.from_rows({0: near, 1000: on_line})
    for n in near:
        assert table(n, 6000) == pytest.approx(near[n] + 6000 * (2e-3 + 1e-3 * n))
    noisy = {**on_line, 2: on_line[2] + 1.0}  # one size's far pass stalled
    table = CostTable.from_rows({0: near, 1000: noisy})
    terms = [table(n, 1000) - table(n, 0) for n in (1, 2, 4, 8)]
    assert terms[2] - terms[1] == pytest.approx(2 * (terms[1] - terms[0]))  # collinear in n
    assert terms[3] - terms[2] == pytest.approx(4 * (terms[1] - terms[0]))
    falling = CostTable.from_rows({0: near, 1000: {1: 3.0, 2: 3.0, 4: 3.1, 8: 3.2}})  # terms fall with n: flat
    flat = [falling(n, 1000) - falling(n, 0) for n in near]
    assert min(flat) >= 0 and max(flat) == pytest.approx(min(flat))


def test_a_context_term_that_would_start_below_zero_is_a_line_through_zero():
    """Terms (0, 1, 2) ms per token of context for 1, 2, 3 rows: the least-squares line 1 n - 1 would
    price one row below zero, so the line through zero is fitted instead: b = sum(n t) / sum(n^2) = 8 / 14."""
    table = CostTable.from_rows({0: {1: 1.0, 2: 1.0, 3: 1.0}, 1000: {1: 1.0, 2: 2.0, 3: 3.0}})
    for n in (1, 2, 3):
        assert table(n, 1000) - table(n, 0) == pytest.approx(1000 * n * 8e-3 / 14)


def test_observed_pass_times_are_compared_at_their_own_context():
    table = CostTable.from_rows({0: {1: 1.0, 8: 2.0}, 1000: {1: 2.0, 8: 6.0}})
    for _ in range(40):
        table.observe(1, 2.0, context=1000)  # just as the table predicts
        table.observe(8, 9.0, context=1000)  # 1.5x the prediction: the machine got slower
    assert table(1, 1000) == pytest.approx(2.0) and table(1, 0) == pytest.approx(1.0)
    assert table(8, 1000) == pytest.approx(9.0, rel=0.01) and table(8, 0) == pytest.approx(3.0, rel=0.01)


def test_the_controller_prices_each_step_at_the_requests_length():
    """Every row of a pass attends to the whole context, so a node worth verifying after a short
    prompt (one more row costs 20% of a step) is not worth it after a long one (80%)."""
    table = CostTable.from_rows({0: {1: 1.0, 2: 1.2, 4: 1.6}, 1000: {1: 2.0, 2: 3.6, 4: 6.0}})
    ctl = Controller(4, cost_table=table)
    for accepted in [[0], []] * 30:  # accepted half the time
        ctl.observe(chain_tree(1), Verification(accepted, 0), overhead_s=0.0)
    ctl.context = 10
    assert len(ctl.select(chain_tree(1))) == 1
    ctl.context = 1000
    assert len(ctl.select(chain_tree(1))) == 0


def test_a_node_is_verified_only_for_a_gain_beyond_the_margin():
    """Estimates err both ways: a node whose expected gain over a plain step is under GAIN_MARGIN
    (5%) is not worth the risk of a slower step."""
    from decodekit.speculative.controller import GAIN_MARGIN

    def keeps(p: float) -> int:
        ctl = Controller(4, cost_table={1: 1.0, 2: 1.2, 4: 1.6})
        ctl.learnt.accept[("s", 0, 0)] = p
        return len(ctl.select(chain_tree(1)))

    assert GAIN_MARGIN == 0.05
    assert keeps(0.24) == 0  # (1 + 0.24) / 1.2 = 1.033x plain: under the margin
    assert keeps(0.30) == 1  # 1.083x plain


def test_the_loop_tells_the_controller_the_requests_length(engines):
    engine = engines[0]
    seen: list[int] = []
    original = Controller.budget

    def spy(self):
        seen.append(self.context)
        return original(self)

    Controller.budget = spy
    try:
        ids = engine.model.prompt_ids("abc", chat=False)
        engine.generate("abc", method="pld", max_new_tokens=6, chat=False, budget=2)
    finally:
        Controller.budget = original
    assert seen and seen[0] == len(ids) + 1 and seen == sorted(seen)


def test_cost_table_is_measured_at_two_contexts_and_cached_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    monkeypatch.setenv("DECODEKIT_COST_TABLE", str(tmp_path / "verify_cost.json"))
    backend = tiny_llama(seed=0)  # 512 positions: the longer context is cut to what fits
    contexts: list[int] = []
    timed = CostTable._time_passes

    def spy(backend, sizes, rounds):
        contexts.append(backend.length)
        return timed(backend, sizes, rounds)

    monkeypatch.setattr(CostTable, "_time_passes", staticmethod(spy))
    table = CostTable.cached(backend)
    assert contexts == [MEASURE_CONTEXTS[0], 512 - max(MEASURE_SIZES) - 1]  # not timings: which passes ran
    assert backend.length == 0 and table.at == MEASURE_CONTEXTS[0] and len(table.slopes) == len(MEASURE_SIZES)
    again = CostTable.cached(backend)
    assert (again.at, again.costs, again.slopes) == (table.at, table.costs, table.slopes)


def test_a_cost_table_that_cannot_be_kept_says_so(tmp_path, monkeypatch, capsys):
    """The notice names where the table will be kept; where it cannot be, one more line says so."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("DECODEKIT_COST_TABLE", str(tmp_path / "a-file" / "verify_cost.json"))
    monkeypatch.setattr(CostTable, "_time_passes", staticmethod(lambda backend, sizes, rounds: {n: 1e-3 * n for n in sizes}))
    table = CostTable.cached(tiny_llama(seed=0))
    assert table.costs
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "kept in" in lines[0]
    assert lines[1].startswith(f"decodekit: the verify costs could not be kept in {tmp_path / 'a-file' / 'verify_cost.json'} (")
    assert f": {tmp_path / 'a-file'}" in lines[1]  # the reason names the path in the way
    assert lines[1].endswith("they are measured again by the next process")


def test_requests_share_the_backends_cost_table_and_timings_are_not_written_to_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    monkeypatch.setenv("DECODEKIT_COST_TABLE", str(tmp_path / "verify_cost.json"))
    backend = tiny_llama(seed=0)
    backend.prefill([1, 2, 3])
    first, second = Controller(8), Controller(8)
    first.begin(backend, "a")
    second.begin(backend, "b")
    assert first.cost is second.cost
    saved = CostTable._path().read_text()
    first.observe_cost(1, first.cost(1) * 1.4)
    assert second.cost(1) == first.cost(1)
    assert CostTable._path().read_text() == saved


def test_a_cached_table_without_the_sizes_measured_now_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    monkeypatch.setenv("DECODEKIT_COST_TABLE", str(tmp_path / "verify_cost.json"))
    backend = tiny_llama(seed=0)
    backend.prefill([1, 2, 3])
    CostTable({1: 1.0, 4: 2.0}).save(backend)  # written by an older version
    assert CostTable.cached(backend).sizes == list(MEASURE_SIZES)


def test_the_back_off_carries_over_to_the_next_request():
    """A drafter that did not pay keeps its long pause level in the next request (it used to start
    again from one plain step, judged by the optimistic prior: seven probes in every 128-token
    request for lookahead decoding)."""
    backend = tiny_llama(seed=0)
    first = Controller(8, cost_table={1: 1.0, 2: 1.3, 64: 64.0})
    first.begin(backend, "hopeless")
    probes(first, 300, draft_s_per_node=0.05)  # costly enough to be planned before drafting
    level = first.learnt.backoff
    second = Controller(8, cost_table={1: 1.0, 2: 1.3, 64: 64.0})
    second.begin(backend, "hopeless")
    assert level >= 16 and probes(second, level, draft_s_per_node=0.05) <= 1


def test_cost_table_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    monkeypatch.setenv("DECODEKIT_COST_TABLE", str(tmp_path / "verify_cost.json"))
    backend = tiny_llama(seed=0)
    backend.prefill([1, 2, 3])
    first = CostTable.cached(backend)
    monkeypatch.setattr(CostTable, "measure", classmethod(lambda cls, *a, **k: pytest.fail("measured twice")))
    again = CostTable.cached(backend)
    assert again.as_dict() == pytest.approx(first.as_dict())
    assert CostTable._path().is_file()


def test_injected_cost_tables_are_not_rewritten_by_timings():
    ctl = Controller(8, cost_table={1: 1.0, 8: 2.0})
    ctl.observe_cost(8, 100.0)
    assert ctl.cost(8) == 2.0


# Cold start ---------------------------------------------------------------------------------------

#: Float32 on this project's CPU (ratios to a 1-token pass): a second token costs 17%, five cost 2.4x.
CPU_COSTS = {1: 1.0, 2: 1.17, 3: 1.36, 4: 1.6, 5: 2.37, 6: 2.69, 7: 2.9, 8: 3.12, 12: 4.48, 16: 5.8, 24: 8.5, 32: 11.2}


def best_first_tree(n: int = 32) -> DraftTree:
    """A recycling-like tree: four candidates per node, grown best-first."""
    tree = DraftTree()
    grow_best_first(tree, [(t, 0.5 ** t, t) for t in range(1, 5)], lambda p: [(p * 10 + t, 0.5 ** t, p * 10 + t) for t in range(1, 5)],
                    n, 8, "recycling")
    return tree


def test_with_nothing_learnt_a_guess_does_not_buy_a_verification():
    ctl = Controller(32, cost_table=CPU_COSTS)
    assert len(best_first_tree()) == 32 and len(ctl.select(best_first_tree())) == 0
    assert len(ctl.select(chain_tree(8))) == 0  # nor a chain: the prior is below what one node costs


def test_probes_are_one_node_for_every_drafter_also_an_all_or_nothing_tree():
    for trimmable in (True, False):
        ctl, verified = Controller(32, cost_table=CPU_COSTS), []
        for _ in range(60):
            budget = ctl.budget()
            if budget:
                tree = ctl.select(chain_tree(14).truncated(budget), trimmable=trimmable)  # a lookahead window
                if len(tree):
                    verified.append(len(tree))
                    ctl.observe(tree, Verification([], 0), overhead_s=0.0)
        assert verified and set(verified) == {1}, trimmable
        assert len(verified) <= 6  # and rare: the back-off doubles after each failed probe


class _SourceChain(Drafter):
    """Proposes the chain ``tokens`` (cut to the budget) every step, under source "s"."""

    def __init__(self, tokens: list[int], trimmable: bool = True):
        self.tokens, self.trimmable = tokens, trimmable

    def draft(self, state, budget):
        return DraftTree.chain(self.tokens[:budget], "s")


@pytest.mark.parametrize("trimmable", [True, False])
def test_the_loop_lets_the_controller_trim_only_trimmable_drafters_trees(trimmable):
    """Two of a six-node chain pay (three rows cost what one does), the whole chain does not: a
    trimmable drafter's tree is cut to its first two nodes, an all-or-nothing one's is not verified."""
    ctl = Controller(8, cost_table={1: 1.0, 3: 1.0, 7: 10.0})
    for depth in range(6):
        ctl.learnt.accept[("s", depth, 0)] = 0.9
    method = SpeculativeMethod(_SourceChain([1, 2, 3, 4, 5, 6], trimmable), ctl)
    method.verifier = GreedyVerifier()  # (what begin() gives a greedy request)
    tree = method._draft(state_for([1, 2, 3]), 8)
    assert tree.tokens == ([1, 2] if trimmable else [])


def test_the_controller_is_told_each_passs_rows_and_only_drafted_steps_as_speculative(monkeypatch):
    """A verification's pass carries the root's row besides the tree's nodes (a plain step's, one
    row); a step whose drafter proposed nothing is a plain step, not a speculative one whose
    realised speed the controller measures."""
    costs: list[int] = []
    monkeypatch.setattr(Controller, "observe_cost", lambda self, n, seconds: costs.append(n))
    for chain in ([7, 8, 9], []):
        model, ctl = tiny(seed=0), Controller(3, cost_table=FLAT_COSTS)  # a model each: what controllers learn is kept on it
        costs.clear()
        g = StepDecoder(SpeculativeMethod(_SourceChain(chain), ctl)).generate(
            model, Request(model.tokenizer.encode(PROMPTS[1]), Sampler(greedy=True), 9))
        steps, plain, drafted = (g.stats.extra[k] for k in ("verifications", "plain_steps", "drafted"))
        assert len(costs) == steps + plain and sum(costs) == drafted + steps + plain
        assert ctl.learnt.spec_steps == steps and (steps > 0) == bool(chain)


def test_a_fixed_budget_leaves_the_acceptance_estimates_to_adaptive_requests():
    """A fixed budget verifies what it is told whatever the estimates say: its outcomes are not
    learnt (they would be shared with later adaptive requests of the drafter); its overhead is."""
    ctl = Controller(8, budget=4)
    ctl.observe(chain_tree(3), Verification([0, 1], 0), overhead_s=0.5)
    assert ctl.learnt.accept == {} and ctl.learnt.seen == {} and ctl.overhead == 0.5


def test_a_fixed_budgets_realised_speed_is_not_shared_with_adaptive_requests():
    """What a fixed budget's steps realise is the budget's, not the controller's choice: kept out of
    the drafter's shared record, where it could veto a later adaptive request's speculation."""
    engine = Engine(tiny(seed=5))
    records = engine.model.backend.memory("speculative.records", dict)
    engine.generate(PROMPTS[1], method="pld", max_new_tokens=30, chat=False, budget=8)
    fixed = records["pld"]
    assert fixed.spec_steps == 0 and fixed.step_seconds == 0.0
    adaptive = engine.generate(PROMPTS[1], method="pld", max_new_tokens=30, chat=False, cost_table=FLAT_COSTS)
    assert adaptive.stats.extra["verifications"] > 0 and records["pld"].spec_steps == adaptive.stats.extra["verifications"]


def test_first_outcomes_move_the_estimate_fast_and_deeper_levels_borrow_it():
    ctl = Controller(32, cost_table=CPU_COSTS)
    ctl.observe(chain_tree(1), Verification([0], 0), overhead_s=0.0)  # one accepted probe
    assert ctl._accept(("s", 0, 0)) == pytest.approx(0.4)  # (2 x prior 0.1 + 1) / 3
    assert ctl._accept(("s", 3, 0)) == pytest.approx(0.4)  # depths never verified borrow it
    assert ctl._accept(("other", 0, 0)) == pytest.approx(0.1) and ctl._accept(("s", 0, 1)) == pytest.approx(0.05)
    assert len(ctl.select(chain_tree(8))) >= 1  # one success is enough to verify the node again
    for _ in range(5):  # then five failures: about the mean of the outcomes and the prior's two, 1.2 / 8
        ctl.observe(chain_tree(1), Verification([], 0), overhead_s=0.0)
    assert 0.14 < ctl._accept(("s", 0, 0)) < 0.16 and len(ctl.select(chain_tree(8))) == 0


def test_acceptance_is_learnt_only_from_nodes_whose_parent_was_accepted():
    """The estimates are P(accepted | parent accepted): a node below a rejected one was never
    judged, so it teaches nothing, and its depth keeps borrowing the level above."""
    ctl = Controller(32, cost_table=CPU_COSTS)
    ctl.observe(chain_tree(3), Verification([0], 0), overhead_s=0.0)  # first accepted, second rejected, third unreached
    assert ctl._accept(("s", 0, 0)) == pytest.approx(0.4)  # (2 x prior 0.1 + 1) / 3
    assert ctl._accept(("s", 1, 0)) == pytest.approx(0.8 / 3)  # (2 x borrowed 0.4 + 0) / 3
    assert ctl._accept(("s", 2, 0)) == pytest.approx(0.8 / 3)  # never reached: borrows depth 1, unchanged
    fresh = Controller(32, cost_table=CPU_COSTS)
    fresh.observe(chain_tree(2), Verification([], 0), overhead_s=0.0)  # rejected at once
    assert fresh._accept(("s", 0, 0)) == pytest.approx(0.2 / 3) == fresh._accept(("s", 1, 0))


def test_a_planned_chain_prices_its_first_node_by_the_first_levels_acceptance():
    """Costly drafting: a chain of depth d reaches its nodes with the product of the acceptances
    of levels 0 .. d - 1; a drafter right at its first node and wrong below is asked for one node."""
    costs = {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.6, 16: 2.2}
    ctl = Controller(8, cost_table=costs)
    ctl.observe_draft(8, 8 * 0.3)  # 0.3 of a plain step per drafted node
    for _ in range(60):
        ctl.observe(chain_tree(2, ""), Verification([0], 0), overhead_s=0.0)
    assert ctl._accept(("", 0, 0)) > 0.99 and ctl._accept(("", 1, 0)) < 0.01
    # depth 1: (1 + ~1) / (0.3 + cost(2) 1.1) = ~1.43 tokens per second against plain decoding's 1;
    # depth 2 adds ~0 tokens for 0.3 + 0.1 more seconds
    assert ctl.best_chain_depth() == 1 and ctl.budget() == 1


def test_the_cost_table_is_measured_at_set_up_not_in_the_first_request(tmp_path, monkeypatch):
    from decodekit.speculative import prepare

    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    monkeypatch.setenv("DECODEKIT_COST_TABLE", str(tmp_path / "verify_cost.json"))
    model = tiny(seed=8)
    model.backend.reset(1)
    table = prepare(model.backend)  # an empty cache: measured after a dummy context, left empty
    assert model.backend.length == 0 and table.sizes == list(MEASURE_SIZES)
    assert CostTable._path().is_file()
    monkeypatch.setattr(CostTable, "measure", classmethod(lambda cls, *a, **k: pytest.fail("measured in a request")))
    g = Engine(model).generate(PROMPTS[1], method="pld", max_new_tokens=8, chat=False)
    assert g.stats.new_tokens == 8 and CostTable.shared(model.backend) is table


# Bandit -------------------------------------------------------------------------------------------


def test_discounted_ucb_tries_every_arm_then_prefers_the_fastest():
    bandit = DiscountedUCB(["a", "b", "c"], discount=0.99, exploration=0.5)
    speed = {"a": 10.0, "b": 30.0, "c": 20.0}
    rng = random.Random(1)
    picks = []
    for _ in range(200):
        arm = bandit.choose()
        picks.append(arm)
        bandit.reward(arm, speed[arm] + rng.uniform(-2, 2))
    assert set(picks[:3]) == {"a", "b", "c"}
    assert picks[100:].count("b") > 80


def test_auto_shares_the_drafters_its_hierarchy_arm_is_made_of():
    from decodekit.speculative.drafters.bandit import BanditDrafter

    auto = BanditDrafter(arms="hierarchy,pld,recycling")
    hierarchy, pld, recycling = auto.parts
    assert pld is hierarchy.parts[0] and recycling is hierarchy.parts[1]
    assert len(auto.leaves()) == len(hierarchy.parts)  # each leaf begins/updates once per step


def test_a_composite_drafter_begins_updates_and_finishes_each_of_its_drafters_once(tiny_model):
    """begin, update and finish reach each leaf drafter once a call, also one that two parts share
    (as auto's hierarchy arm and its pld arm): going through the parts would reach a shared leaf
    twice (its context indexed twice, a verification learnt twice)."""
    from collections import Counter

    from decodekit.speculative.drafters.base import CompositeDrafter

    class Counting(PromptLookup):
        def __init__(self):
            super().__init__()
            self.calls = Counter()

        def begin(self, state):
            self.calls["begin"] += 1
            super().begin(state)

        def update(self, state, tree, verdict, logits):
            self.calls["update"] += 1

        def finish(self, state):
            self.calls["finish"] += 1

    class First(CompositeDrafter):
        name = "first"

        def __init__(self, parts):
            self.parts = parts

        def draft(self, state, budget):
            return self.parts[0].draft(state, budget)

    shared, other = Counting(), Counting()
    drafter = First([First([shared, other]), shared])
    assert drafter.leaves() == [shared, other]
    # greedy: a request sampled without a seed drew other tokens each run, and in some runs the
    # drafts never matched them, so no verification ran (a flaky test)
    request = Request(tiny_model.tokenizer.encode("abcabcabcabc"), Sampler(greedy=True), max_new_tokens=20,
                      ignore_eos=True)
    g = StepDecoder(SpeculativeMethod(drafter, Controller(8, budget=4))).generate(tiny_model, request)
    steps = g.stats.extra["verifications"] + g.stats.extra["plain_steps"]
    assert g.stats.extra["verifications"] > 0
    for leaf in (shared, other):
        assert leaf.calls == Counter(begin=1, update=steps, finish=1)


def test_auto_reports_its_arm_pulls(engines):
    g = engines[0].generate(PROMPTS[1], method="auto", max_new_tokens=30, chat=False, budget=6)
    assert sum(g.stats.extra["arm_pulls"].values()) >= max(1, g.stats.extra["verifications"])  # a draft each


class _ClockedDrafter(Drafter):
    """Proposes token 1 twice; each call takes ``seconds`` of the fake clock the test gives the loop."""

    name = "clocked"

    def __init__(self, clock: SimpleNamespace, seconds: float):
        self.clock, self.seconds = clock, seconds

    def draft(self, state, budget):
        self.clock.now += self.seconds
        return DraftTree.chain([1] * min(budget, 2), self.name)


def test_speculation_times_drafting_and_verification_apart(monkeypatch):
    """On a clock that only drafting moves: the draft time is every draft call's, the verification
    time none of it, and each step the controller judges (tokens per second against plain decoding)
    costs its draft and its verification together."""
    import decodekit.speculative.loop as loop_module

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(loop_module, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    controller, steps = Controller(4, budget=4), []
    observe_step = controller.observe_step
    monkeypatch.setattr(controller, "observe_step", lambda tokens, seconds: (steps.append(seconds), observe_step(tokens, seconds)))
    method = SpeculativeMethod(_ClockedDrafter(clock, 100.0), controller)
    g = StepDecoder(method).generate(tiny(3), Request(list(range(1, 9)), Sampler(greedy=True), 12))
    extra = g.stats.extra
    assert extra["verifications"] > 0 and extra["draft_s"] == 100.0 * extra["verifications"]
    assert extra["verify_s"] == 0.0
    assert steps == [100.0] * extra["verifications"]


def test_the_drafting_cost_is_a_moving_average_of_the_calls():
    controller = Controller(8, cost_table={1: 1.0, 2: 1.1})
    controller.observe_draft(4, 0.4)
    controller.observe_draft(4, 0.0)  # one fast call does not make drafting look free
    assert controller.learnt.draft_seconds == pytest.approx(0.4 + controller.ema * (0.0 - 0.4))
    assert controller.learnt.draft_calls == 2


def test_realised_speed_below_plain_decoding_vetoes_drafting_until_it_pays_again():
    """The per-node model may be optimistic; what speculative steps actually deliver decides."""
    ctl = Controller(8, cost_table={1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})  # verification looks free
    for _ in range(20):
        ctl.observe(chain_tree(4), Verification([0, 1], 0), overhead_s=0.0)  # and drafts look good
    assert ctl.budget() == 8 and len(ctl.select(chain_tree(8))) > 0
    for _ in range(10):  # yet each speculative step delivered 2 tokens in 3 plain steps' time
        ctl.observe_step(2, 3.0)
    assert not ctl.speculation_pays()
    budgets = []
    for _ in range(60):  # as the loop runs it: a granted budget is drafted and selected from
        budgets.append(ctl.budget())
        if budgets[-1]:
            ctl.select(chain_tree(budgets[-1]))
    drafted = [b for b in budgets if b]
    assert budgets[0] == 0 and 0 < len(drafted) <= 6  # mostly plain steps, a few probes
    for _ in range(20):  # probes now deliver 3 tokens per plain step's time
        ctl.observe_step(3, 1.0)
    assert ctl.speculation_pays()
    ctl._skip = 0
    assert ctl.budget() == 8


def test_realised_speed_vetoes_from_the_eighth_measured_step_and_equal_speed_pays():
    """Speculation must realise at least plain decoding's tokens per second, judged once
    MIN_REALISED_STEPS (8) speculative steps are measured; exactly plain decoding's speed is enough."""
    from decodekit.speculative.controller import MIN_REALISED_STEPS

    assert MIN_REALISED_STEPS == 8
    ctl = Controller(8, cost_table={1: 1.0, 8: 1.0})
    for _ in range(7):
        ctl.observe_step(1, 2.0)  # half plain decoding's speed
    assert ctl.speculation_pays()  # seven steps: still assumed
    ctl.observe_step(1, 2.0)
    assert not ctl.speculation_pays()
    even = Controller(8, cost_table={1: 1.0, 8: 1.0})
    for _ in range(8):
        even.observe_step(2, 2.0)  # two tokens in two plain steps' time
    assert even.speculation_pays()


def test_in_a_batch_realised_speed_is_compared_with_a_plain_step_of_the_whole_batch():
    """A plain step in a batch runs the other sequences' rows too (SmartSpec's goodput): its time is
    cost(others' rows + 1), not cost(1)."""
    ctl = Controller(8, cost_table={1: 1.0, 8: 1.1, 16: 2.2})
    ctl._batch = lambda: (15, 15)
    assert ctl.plain_step_s() == pytest.approx(2.2)
    for _ in range(8):
        ctl.observe_step(1, 2.0)  # slower than a plain step alone, faster than one beside 15 others
    assert ctl.speculation_pays()


def test_a_chain_depth_that_only_ties_a_shallower_one_is_not_chosen():
    """Depths are compared by expected tokens per second; a deeper chain must do better, not as well
    (it drafts and risks more). Acceptance 0.5 then 0.75: depth 1 gives 1.5 tokens in a 2-row pass
    costing 1.0, depth 2 gives 1.875 in a 3-row pass costing 1.25: both 1.5 tokens per second."""
    ctl = Controller(2, cost_table={1: 1.0, 2: 1.0, 3: 1.25})
    ctl.learnt.accept.update({("", 0, 0): 0.5, ("", 1, 0): 0.75})
    assert ctl.draft_node_s == 0.0
    assert ctl.best_chain_depth() == 1


def test_realised_speed_carries_over_to_the_next_request():
    backend = tiny_llama(seed=0)
    costs = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
    first = Controller(8, cost_table=costs)
    first.begin(backend, "optimistic-drafter")
    first.observe_draft(4, 1e-6)
    for _ in range(10):
        first.observe_step(1, 2.0)
    second = Controller(8, cost_table=costs)
    second.begin(backend, "optimistic-drafter")
    assert not second.speculation_pays() and second.budget() == 0


def test_cost_table_bounds_are_inclusive_and_booleans_are_not_token_counts():
    """Values run from a nanosecond to an hour, both ends included; True is an int to Python but
    not a token count (it would silently stand for the cost of 1 token)."""
    table = CostTable({1: 1e-9, 2: 3600.0})
    assert table(1) == 1e-9 and table(2) == 3600.0
    with pytest.raises(InvalidParameter, match="keys must be token counts >= 1, got True"):
        CostTable({True: 1.0})


def test_per_context_costs_of_zero_are_valid_and_other_sizes_are_not():
    """A context that adds nothing (a pass as fast after 1,000 tokens as after none) is a measured
    term of zero, not a damaged one; per-context costs for sizes the table lacks (or lacking one of
    its sizes) are refused rather than read as zero."""
    same = {1: 1.0, 2: 1.2, 4: 1.5}
    table = CostTable.from_rows({0: same, 1000: same})
    assert table(2, 5000) == pytest.approx(1.2)
    assert CostTable({1: 1.0, 2: 1.2}, per_context={1: 0.0, 2: 0.0})(2, 100) == pytest.approx(1.2)
    with pytest.raises(InvalidParameter, match="same sizes"):
        CostTable({1: 1.0, 2: 1.2}, per_context={1: 1e-3})


def test_context_terms_that_fall_with_the_size_are_priced_at_their_mean():
    """Terms falling with n (noise: a row more cannot make the context cheaper) give a flat term, the
    mean of the measured ones, not none at all: long prompts still cost more. Here (2.0, 1.9, 1.8,
    1.5) ms per 1,000 tokens: 1.8 for every size."""
    near = {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7}
    falling = CostTable.from_rows({0: near, 1000: {1: 3.0, 2: 3.0, 4: 3.1, 8: 3.2}})
    for n in near:
        assert falling(n, 1000) - falling(n, 0) == pytest.approx(1.8)


def test_a_size_not_measured_at_the_long_context_does_not_cancel_the_others_terms():
    """A size that does not fit after the long context is not timed there; it adds no evidence on
    the context term, rather than a term of minus its whole cost per token of context."""
    table = CostTable.from_rows({0: {1: 1.0, 8: 2.0}, 1000: {1: 2.0}})
    assert table(1, 1000) > 1.0 and table(8, 1000) > 2.0


def test_cost_tables_are_keyed_by_the_thread_count():
    """A pass with 4 threads costs about twice one with 8: a table measured under one thread count
    must not be read back under another."""
    from decodekit.models.threads import GOVERNOR

    backend = tiny_llama(seed=0)
    counts = iter([4, 8])
    keys = []
    for _ in range(2):
        count = next(counts)
        original = GOVERNOR.full_count
        GOVERNOR.full_count = lambda count=count: count
        try:
            keys.append(CostTable.key(backend))
        finally:
            GOVERNOR.full_count = original
    assert keys[0] != keys[1] and "threads=4" in keys[0]


def test_saving_a_table_keeps_the_other_models_tables(tmp_path, monkeypatch):
    """One file holds the tables of every model/dtype/thread count/cache policy: saving one must
    not drop the others (each would be measured again at its next start)."""
    monkeypatch.setenv("DECODEKIT_COST_TABLE", str(tmp_path / "verify_cost.json"))
    small = tiny_llama(seed=0, hidden_size=64)
    large = tiny_llama(seed=0, hidden_size=64).with_kv_cache("int4:group=8,residual=64")
    assert CostTable.key(small) != CostTable.key(large)
    CostTable({n: 1.0 * n for n in MEASURE_SIZES}).save(small)
    CostTable({n: 2.0 * n for n in MEASURE_SIZES}).save(large)
    monkeypatch.setattr(CostTable, "measure", classmethod(lambda cls, *a, **k: pytest.fail("measured again")))
    assert CostTable.cached(small)(1) == 1.0 and CostTable.cached(large)(1) == 2.0


def test_a_twin_measured_beside_a_batched_backend_runs_its_passes_alone():
    """The twin a measurement times is a copy of the backend; a batched backend's copy would send
    its passes through the batch (waiting for, and timed with, other requests' rows)."""
    from decodekit.models.batching import PassBatcher
    from decodekit.speculative.controller import _twin

    backend = tiny_llama(seed=0)
    batcher = backend.batcher = PassBatcher()
    twin = _twin(backend)
    assert twin.batcher is None and backend.batcher is batcher


def test_a_fixed_budget_measures_no_cost_table_and_a_measured_table_learns(monkeypatch):
    """A fixed budget prices nothing, so its request measures no table; a measured (shared) table
    follows observed pass times, while a table given by the caller is kept as given."""
    backend = tiny_llama(seed=0)
    monkeypatch.setattr(CostTable, "cached", classmethod(lambda cls, b: pytest.fail("measured for a fixed budget")))
    fixed = Controller(8, budget=4)
    fixed.begin(backend)
    assert fixed.cost is None and not fixed.learn_costs
    monkeypatch.setattr(CostTable, "cached", classmethod(lambda cls, b: CostTable({1: 1.0, 8: 2.0})))
    measured = Controller(8)
    measured.begin(backend)
    measured.observe_cost(1, 1.4)
    assert measured.learn_costs and measured.pass_cost(1) > 1.0
    given = Controller(8, cost_table={1: 1.0, 8: 2.0})
    given.begin(backend)
    given.observe_cost(1, 1.4)
    assert given.pass_cost(1) == 1.0


def test_a_planned_chain_that_pays_ends_the_back_off():
    """For a costly drafter budget() decides: once a chain depth pays again, the back-off level
    returns to zero, so the next losing stretch pauses one step first, not twice the old pause."""
    costs = {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.6, 16: 2.2}
    ctl = Controller(8, cost_table=costs)
    ctl.observe_draft(8, 8 * 0.05)
    assert ctl.costly_drafting()
    for _ in range(30):
        ctl.observe(chain_tree(8, ""), Verification(list(range(8)), 0), overhead_s=0.0)
    ctl.learnt.backoff = 64  # left over from a stretch that did not pay
    assert ctl.budget() > 0 and ctl.learnt.backoff == 0
    ctl._back_off()
    assert ctl._skip == 1


def test_a_draft_call_at_exactly_two_percent_of_a_plain_step_is_planned():
    """CHEAP_DRAFT: a call *under* 2% of a plain step needs no depth planning; at 2% it does."""
    ctl = Controller(8, cost_table={1: 0.5, 8: 1.0})
    ctl.observe_draft(1, 0.01)
    assert ctl.costly_drafting()
    ctl.observe_draft(1, 0.0)
    assert not ctl.costly_drafting()


def test_an_empty_draft_is_no_choice_and_starts_no_back_off():
    """A drafter that finds no match proposes nothing, and nothing is verified: that is not the
    controller choosing a plain step, so it does not pause drafting (the next step may match)."""
    ctl = Controller(8, cost_table=FLAT_COSTS)
    assert len(ctl.select(DraftTree())) == 0
    assert ctl.budget() == 8 and ctl.learnt.backoff == 0


def test_the_first_back_off_pauses_one_step_and_probes_are_bounded(monkeypatch):
    """The pause starts at one plain step; the longest pause is the probe's expected extra cost over
    1%, never under 4 steps nor over MAX_BACKOFF (512), and a probe's extra cost counts its drafting
    and takes off the tokens its node is expected to add."""
    ctl = Controller(8, cost_table=STEEP_COSTS)
    assert len(ctl.select(chain_tree(4))) == 0 and ctl._skip == 1
    assert Controller(8, cost_table=FLAT_COSTS)._max_backoff() == 4  # a probe costs nothing: still 4
    assert Controller(8, cost_table={1: 1.0, 2: 10.0, 64: 640.0})._max_backoff() == 512  # 900 capped
    drafting = Controller(8, cost_table=FLAT_COSTS)
    drafting.observe_draft(1, 0.5)  # half a plain step per drafted node: a probe costs 1.5 steps
    assert 40 <= drafting._max_backoff() <= 41  # for 1.1 tokens (the prior's 0.1 for its node)
    drafting.learnt.accept[("", 0, 0)] = 0.45  # for 1.45 tokens: 0.05 steps lost
    assert 5 <= drafting._max_backoff() <= 6


def test_realised_speed_starts_from_the_first_step_not_from_zero():
    """The first speculative step starts the averages (as the first draft call does): averaged
    with zeros, a fast first step would be forgotten. 8 tokens in 1 s, then 7 steps of 1 token in
    2 s: the averages are about 3.2 tokens per 1.7 s, faster than plain decoding (1 per 1 s)."""
    ctl = Controller(8, cost_table={1: 1.0, 8: 1.0})
    ctl.observe_step(8, 1.0)
    assert (ctl.learnt.step_tokens, ctl.learnt.step_seconds) == (8.0, 1.0)
    for _ in range(7):
        ctl.observe_step(1, 2.0)
    assert ctl.speculation_pays()


def test_the_first_steps_bookkeeping_is_taken_whole_and_charged_to_speculation():
    """The verifier's bookkeeping starts at the first step's (not averaged with zero) and is added
    to a speculative step's time, not taken off a plain step's: one node accepted 3 times in 10
    beats plain decoding by 5% with 0.2 s of it (1.3 / 1.2 > 1.05), not once it is wrongly moved."""
    ctl = Controller(8, cost_table=FLAT_COSTS)
    ctl.observe(DraftTree(), Verification([], 0), overhead_s=0.2)
    assert ctl.overhead == pytest.approx(0.2)
    ctl.learnt.accept[("s", 0, 0)] = 0.3
    assert len(ctl.select(chain_tree(1))) == 1


def test_the_chain_source_is_the_first_nodes_and_survives_an_empty_draft():
    """A costly drafter's chain is planned with the acceptance of the source of the last tree's
    first node; a step whose drafter proposed nothing tells nothing about it and leaves it."""
    ctl = Controller(8, cost_table=FLAT_COSTS)
    tree = DraftTree([1, 2], [-1, -1], {}, ["a", "b"])
    ctl.observe(tree, Verification([0], 0), overhead_s=0.0)
    assert ctl.learnt.chain_source == "a"
    ctl.observe(DraftTree(), Verification([], 0), overhead_s=0.0)
    assert ctl.learnt.chain_source == "a"


def test_node_keys_cap_depth_and_rank():
    """Deep and late siblings pool their evidence under the last tracked depth (15) and rank (7)."""
    chain = chain_tree(20)
    assert [key[1] for key in node_keys(chain)] == list(range(16)) + [15] * 4
    wide = DraftTree(list(range(10)), [-1] * 10, {}, ["s"] * 10)
    assert [key[2] for key in node_keys(wide)] == list(range(8)) + [7, 7]


def test_a_size_is_timed_where_it_exactly_fills_the_context_and_its_fastest_pass_is_kept(monkeypatch):
    """A pass of exactly the room left fits; the fastest timed pass is kept, not the last one
    (another process only ever adds time). Passes cost what the script says: 9 (untimed) then the
    listed seconds, two passes a run (RUN_S = 0), two rounds."""
    from decodekit.speculative import controller

    clock = [0.0]
    script = {1: [9, 2, 9, 5], 4: [9, 3, 9, 1]}

    class Scripted:
        length, info = 7, SimpleNamespace(max_length=11)

        def append(self, tokens):
            clock[0] += script[tokens.shape[1]].pop(0)

        def truncate(self, length):
            assert length == 7

    monkeypatch.setattr(controller.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(controller, "RUN_S", 0)
    assert CostTable._time_passes(Scripted(), (1, 4, 5), rounds=2) == {1: 2, 4: 1}  # 5 does not fit



def test_a_costly_drafter_measured_to_pay_keeps_drafting_when_its_estimates_lag():
    """Acceptance estimates start from a low prior and learn from one-node probes; where the
    speculative steps measured so far (MIN_REALISED_STEPS of them) realised plain decoding's speed
    and the 5% margin besides, a costly drafter keeps drafting one node a step (and learning)
    instead of backing off on the estimates alone. Below the margin, or on fewer steps, it backs off."""
    def controller(steps: int, tokens: float) -> Controller:
        ctl = Controller(8, cost_table={1: 1.0, 2: 1.2, 4: 1.4, 8: 1.8})
        ctl.observe_draft(1, 0.4)  # 1.1 tokens (the prior) for 1.6 s: no depth pays by the estimates
        for _ in range(steps):
            ctl.observe_step(tokens, 1.0)  # each speculative step: `tokens` in a plain step's time
        return ctl
    assert controller(8, 1.0).best_chain_depth() == 0
    pays = controller(8, 1.06)
    pays.learnt.backoff = 16
    assert pays.budget() == 1 and pays.learnt.backoff == 0
    assert controller(8, 1.04).budget() == 0  # within the margin
    assert controller(7, 1.5).budget() == 0  # not yet measured enough


def test_a_costly_drafters_probe_that_verifies_keeps_its_back_off_level():
    """Once drafted, a probe's node is worth verifying (select() weighs verification only), but for a
    costly drafter budget() decides whether drafting pays: the probe must not end the back-off, or a
    drafter too dear to pay would be probed after one plain step again."""
    ctl = Controller(8, cost_table={1: 1.0, 2: 1.1, 4: 1.3, 8: 1.6})
    ctl.observe_draft(1, 0.5)  # half a plain step per node: 1.3 tokens for 1.6 s never beats 1 for 1 s
    ctl.learnt.accept[("", 0, 0)] = 0.3  # 1.3 tokens for a 1.1 s pass once drafted: verified
    ctl.learnt.backoff, ctl._explore = 16, True  # a probe at the end of a 16-step pause
    assert ctl.budget() == 1 and len(ctl.select(chain_tree(1, ""))) == 1
    assert ctl.learnt.backoff == 16


# Seeded sampling ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", speculative_methods())
def test_a_seed_gives_plain_samplings_tokens_with_every_speculative_method(engines, method):
    """Keyed draws fix the token at each position before any drafting: with a seed, every
    speculative method gives `sample`'s tokens, whatever its controller decides and however its
    steps are timed (an eager controller and a fixed budget alike)."""
    engine = engines[0]
    options = required_options(method, engine.model.backend)
    if method in ("draft", "layerskip"):
        options["stochastic"] = True  # drafts sampled from q with the target's keyed noise
    for prompt in PROMPTS[:2]:
        for seed in (0, 7):
            args = dict(max_new_tokens=24, chat=False, temperature=0.8, seed=seed)
            want = engine.generate(prompt, method="sample", **args).tokens
            assert engine.generate(prompt, method=method, cost_table=FLAT_COSTS, **args, **options).tokens == want
            assert engine.generate(prompt, method=method, budget=3, **args, **options).tokens == want



def test_recycling_refreshes_the_row_of_every_scored_node(engines):
    """After a verification, the root and every tree node (accepted or not) gets the top-k of its
    own logits: the rejected candidates are what the method recycles."""
    from decodekit.engine.core import DecodeState, GenerationStats
    from decodekit.samplers import Sampler
    from decodekit.speculative.drafters.recycling import TokenRecycling

    backend = engines[0].model.backend.clone()
    state = DecodeState(backend, Sampler(greedy=True), [5, 6, 7], GenerationStats())
    drafter = TokenRecycling(k=3)
    drafter.begin(state)
    tree = DraftTree([11, 12, 13], [-1, 0, -1])
    logits = torch.randn(4, backend.info.vocab_size, generator=torch.Generator().manual_seed(0))
    drafter.update(state, tree, Verification([0], 9), logits)
    for token, row in zip([7, 11, 12, 13], logits):
        assert drafter.matrix[token, :3].tolist() == torch.topk(row, 3).indices.tolist()


# Composite and Jacobi drafters' rules, on hand-made states ------------------------------------------


def test_discounted_ucb_decays_every_arm_and_ranks_by_its_index():
    bandit = DiscountedUCB(["a", "b"], discount=0.5, exploration=1.0)
    for arm, value in (("a", 4.0), ("b", 2.0), ("a", 6.0)):
        bandit.reward(arm, value)
    # each reward first discounts every arm's statistics, the unpulled ones too
    assert bandit.count == pytest.approx({"a": 0.25 + 1.0, "b": 0.5})
    assert bandit.total == pytest.approx({"a": 1.0 + 6.0, "b": 1.0})

    def index(bandit: DiscountedUCB, arm: str) -> float:  # the docstring's rule, written out
        n = sum(bandit.count.values())
        mean = sum(bandit.total.values()) / n
        spread = math.sqrt(sum(bandit.squares.values()) / n - mean * mean)
        bonus = math.sqrt(2 * math.log(n) / bandit.count[arm])
        return bandit.total[arm] / bandit.count[arm] + bandit.exploration * spread * bonus

    rng = random.Random(3)
    bandit = DiscountedUCB(["a", "b", "c"], discount=0.95, exploration=0.3)
    for _ in range(60):
        arm = bandit.choose()
        if min(bandit.count.values()) > 0:
            assert arm == max(bandit.arms, key=lambda a: index(bandit, a))
        bandit.reward(arm, {"a": 10.0, "b": 9.0, "c": 5.0}[arm] + rng.uniform(-1, 1))
    # the runner-up, pulled less, is still tried now and then: its bonus is its own count's
    assert 0 < bandit.count["b"] < bandit.count["a"]


class _FixedChain(Drafter):
    """Proposes `budget` tokens from `first` on, and remembers the budgets it was given."""

    def __init__(self, first: int):
        self.first, self.asked = first, []

    def draft(self, state, budget):
        self.asked.append(budget)
        return DraftTree.chain(list(range(self.first, self.first + budget)), f"from{self.first}")


def test_hierarchy_gives_each_level_half_of_what_is_left_and_the_last_the_rest():
    from decodekit.speculative.drafters.hierarchy import HierarchyDrafter

    hierarchy = HierarchyDrafter(order="pld,recycling,suffix")
    hierarchy.parts = [_FixedChain(100), _FixedChain(200), _FixedChain(300)]
    tree = hierarchy.draft(None, 10)
    assert [part.asked for part in hierarchy.parts] == [[5], [2], [3]]
    assert tree.source == ["from100"] * 5 + ["from200"] * 2 + ["from300"] * 3


def test_hierarchy_reads_its_order_as_written_with_its_suffix_level_on_the_corpus():
    """Names around commas may be spaced; a blank one is refused as naming nothing. The statistics
    level (suffix) drafts from earlier outputs too, as the suffix drafter alone does only when asked."""
    from decodekit.speculative.drafters.hierarchy import HierarchyDrafter

    hierarchy = HierarchyDrafter(order=" pld , suffix")
    assert [part.name for part in hierarchy.parts] == ["pld", "suffix"]
    assert hierarchy.parts[1].use_corpus and not SuffixDrafter().use_corpus
    with pytest.raises(InvalidParameter, match="^order must name drafters, got 'pld,,suffix'$"):
        HierarchyDrafter(order="pld,,suffix")


def test_a_drafter_named_twice_in_a_hierarchy_is_one_level_and_adds_each_output_to_the_corpus_once():
    from decodekit.speculative.drafters.suffix import corpus_for

    engine = Engine(tiny(seed=2))
    plain = engine.generate(PROMPTS[1], max_new_tokens=20, chat=False)
    got = engine.generate(PROMPTS[1], method="hierarchy", order="pld,suffix,suffix", max_new_tokens=20, chat=False,
                          budget=8)
    assert got.tokens == plain.tokens
    assert corpus_for(engine.model.backend).documents == [got.tokens]


def test_hierarchy_gives_the_first_level_the_only_node_of_a_budget_of_one():
    """Each level but the last gets half of what is left, at least one node: with one node to give,
    the highest-priority level (the context) drafts it."""
    from decodekit.speculative.drafters.hierarchy import HierarchyDrafter

    hierarchy = HierarchyDrafter(order="pld,recycling,suffix")
    hierarchy.parts = [_FixedChain(100), _FixedChain(200), _FixedChain(300)]
    tree = hierarchy.draft(None, 1)
    assert [part.asked for part in hierarchy.parts] == [[1], [], []]
    assert tree.tokens == [100] and tree.source == ["from100"]


def test_auto_rewards_only_the_steps_its_arm_drafted():
    """A plain step the controller took (no draft) is no pull of the arm chosen before it."""
    from decodekit.speculative.drafters.bandit import BanditDrafter

    auto = BanditDrafter(arms="pld,suffix")
    auto.parts = [_FixedChain(100), _FixedChain(200)]
    auto.bandit, auto.pulls, auto.chosen = DiscountedUCB(auto.names), {n: 0 for n in auto.names}, None
    auto.draft(None, 3)  # the first untried arm: pld
    auto.observe(4, 1.0)  # its step: 4 tokens in a second
    auto.observe(1, 0.5)  # then a plain step, drafted by no arm
    assert auto.bandit.count == {"pld": 1.0, "suffix": 0.0} and auto.bandit.total == {"pld": 4.0, "suffix": 0.0}
    assert auto.pulls == {"pld": 1, "suffix": 0}


class _Tokens:
    """The part of a DecodeState the lookahead drafter reads."""

    def __init__(self, tokens: list[int], prompt_len: int):
        self.tokens, self.prompt_len = tokens, prompt_len


def test_lookahead_jacobi_step_collects_diagonals_and_keeps_the_newest_ngrams():
    from decodekit.speculative.drafters.lookahead import LookaheadDrafter

    drafter = LookaheadDrafter(window=3, ngram=3, guesses=2)
    state = _Tokens([5, 6, 7], 3)
    drafter.begin(state)
    drafter.levels, drafter.window = [[10, 11, 12]], [20, 21, 22]
    drafter.pool = {10: {(1, 2): None, (3, 4): None}}  # full (guesses=2), oldest first
    # a step that verified the whole window: the argmax after the root, 20, 21, 22 is 30, 31, 32, 33
    logits = torch.full((4, 64), -1.0)
    for row, guess in enumerate((30, 31, 32, 33)):
        logits[row, guess] = 1.0
    drafter.update(state, DraftTree.chain([20, 21, 22], "lookahead:window"), Verification([], 30), logits)
    # Jacobi: guess i + 1 is the argmax after window token i (new[0]: after the root)
    assert drafter.window == [30, 31, 32] and drafter.levels == [[20, 21, 22]]
    # the diagonal n-gram (levels[0][0], window[1], new[2]) enters the pool; the oldest one leaves
    assert list(drafter.pool[10]) == [(3, 4), (21, 32)]
    drafter.pool[7] = {(1, 2): None, (3, 4): None, (5, 6): None}
    assert drafter.draft(state, 4).tokens == [5, 6, 3, 4]  # root 7: the newest n-grams first


def test_lookahead_ngram_found_again_becomes_the_newest():
    """The pool keeps the ``guesses`` most *recent* distinct n-grams per key: one collected again
    moves to the newest end, so it is the last to be evicted and the first verified."""
    from decodekit.speculative.drafters.lookahead import LookaheadDrafter

    drafter = LookaheadDrafter(window=3, ngram=3, guesses=2)
    state = _Tokens([5, 6, 7], 3)
    drafter.begin(state)
    drafter.levels, drafter.window = [[10, 11, 12]], [20, 21, 22]
    drafter.pool = {10: {(21, 32): None, (3, 4): None}}  # (21, 32) is the older one
    logits = torch.full((4, 64), -1.0)
    for row, guess in enumerate((30, 31, 32, 33)):
        logits[row, guess] = 1.0
    drafter.update(state, DraftTree.chain([20, 21, 22], "lookahead:window"), Verification([], 30), logits)
    # the diagonal (levels[0][0], window[1], new[2]) = (10, 21, 32) is collected again: now the newest
    assert list(drafter.pool[10]) == [(3, 4), (21, 32)]


def test_lookahead_runs_no_jacobi_step_after_a_draft_without_its_window():
    """The window's next iterate comes from the logits after the window's own tokens: a step whose
    tree holds only pool n-grams (or another's draft) computed none, so the window stays as it is."""
    from decodekit.speculative.drafters.lookahead import LookaheadDrafter

    drafter = LookaheadDrafter(window=3, ngram=3, guesses=2)
    state = _Tokens([5, 6, 7], 3)
    drafter.begin(state)
    drafter.levels, drafter.window = [[10, 11, 12]], [20, 21, 22]
    logits = torch.full((3, 64), -1.0)
    logits[:, 40] = 1.0
    drafter.update(state, DraftTree.chain([8, 9], "lookahead"), Verification([], 30), logits)
    assert drafter.window == [20, 21, 22] and drafter.levels == [[10, 11, 12]]


def test_lookahead_window_fills_the_budget_left_by_the_pool():
    """The tree is the pool's n-grams and then as much of the Jacobi window as the budget leaves."""
    from decodekit.speculative.drafters.lookahead import LookaheadDrafter

    drafter = LookaheadDrafter(window=4, ngram=3, guesses=2)
    state = _Tokens([5, 6, 7], 3)
    drafter.begin(state)
    drafter.window = [20, 21, 22, 23]
    assert drafter.draft(state, 3).tokens == [20, 21, 22]  # no n-gram for root 7: the window alone
    drafter.pool[7] = {(1, 2): None}
    tree = drafter.draft(state, 4)
    assert tree.tokens == [1, 2, 20, 21] and tree.source == ["lookahead"] * 2 + ["lookahead:window"] * 2


def test_lookahead_bigrams_pair_each_window_token_with_its_next_iterate():
    """With ``ngram=2`` no earlier iterates are kept: every Jacobi step adds the bigrams
    (window[j - 1], new[j]) of the window it verified, not of an older one."""
    from decodekit.speculative.drafters.lookahead import LookaheadDrafter

    drafter = LookaheadDrafter(window=3, ngram=2, guesses=4)
    state = _Tokens([5, 6, 7], 3)
    drafter.begin(state)
    drafter.window = [20, 21, 22]
    for guesses in ((30, 31, 32, 33), (40, 41, 42, 43)):  # the argmax after the root and each window token
        logits = torch.full((4, 64), -1.0)
        for row, guess in enumerate(guesses):
            logits[row, guess] = 1.0
        drafter.update(state, DraftTree.chain(list(drafter.window), "lookahead:window"), Verification([], 0), logits)
        assert drafter.levels == [] and drafter.window == list(guesses[:3])
    assert {key: list(bucket) for key, bucket in drafter.pool.items()} == {
        20: [(31,)], 21: [(32,)], 30: [(41,)], 31: [(42,)]}


def test_a_cost_table_entry_with_an_infinite_term_is_measured_again():
    """What a damaged or another version's file holds is measured again, never run: an infinite
    per-context term or anchor (a NaN or an overflow later, in a request) counts as damaged."""
    sizes = [str(n) for n in MEASURE_SIZES]
    good = {"at": 256, "costs": dict.fromkeys(sizes, 1e-3), "per_context": dict.fromkeys(sizes, 1e-6)}
    assert CostTable.from_entry(good) is not None
    assert CostTable.from_entry({**good, "per_context": dict.fromkeys(sizes, math.inf)}) is None
    assert CostTable.from_entry({**good, "at": math.inf}) is None
    assert CostTable.from_entry({"at": 256, "costs": good["costs"]}) is None  # an older version's: no term


def test_the_suffix_corpus_keeps_a_requests_output_not_its_prompt():
    """The corpus holds earlier *outputs* of the model (SuffixDecoding's output corpus), not prompts."""
    from decodekit.speculative.drafters.suffix import corpus_for

    state = state_for([1, 2, 3])
    drafter = SuffixDrafter(corpus=True)
    drafter.begin(state)
    state.tokens += [4, 5]
    drafter.finish(state)
    assert corpus_for(state.backend).documents == [[4, 5]]


@pytest.mark.parametrize("growth, tokens", [(1.5, [2]), (0.5, [2]), (3.0, [2, 3, 1])])
def test_suffix_tree_depth_is_growth_times_the_match_length_rounded_down_and_at_least_one(growth, tokens):
    """The depth cap is floor(growth x match length), at least 1: the context's last "1" matched once
    (length 1), followed there by 2, 3, 1."""
    state = state_for([1, 2, 3, 1])
    drafter = SuffixDrafter(growth=growth)
    drafter.begin(state)
    assert drafter.draft(state, 8).tokens == tokens


def test_discounted_ucb_discounts_the_squares_too():
    """Every statistic of every arm decays by ``discount`` per pull, the squared rewards (the spread's)
    as well: a: 16 · 0.25 + 36, b: 4 · 0.5."""
    bandit = DiscountedUCB(["a", "b"], discount=0.5, exploration=1.0)
    for arm, value in (("a", 4.0), ("b", 2.0), ("a", 6.0)):
        bandit.reward(arm, value)
    assert bandit.squares == pytest.approx({"a": 40.0, "b": 2.0})


def test_auto_counts_an_arm_named_twice_once():
    """An arm listed twice is one arm: one drafter, one set of statistics decayed once per pull."""
    from decodekit.speculative.drafters.bandit import BanditDrafter

    auto = BanditDrafter(arms="pld,suffix,pld")
    assert auto.names == ["pld", "suffix"] and len(auto.parts) == 2


def test_auto_takes_no_reward_from_a_step_timed_at_zero_seconds():
    """tokens / seconds is no speed when no time was measured: such a step is no pull."""
    from decodekit.speculative.drafters.bandit import BanditDrafter

    auto = BanditDrafter(arms="pld,suffix")
    auto.parts = [_FixedChain(100), _FixedChain(200)]
    auto.bandit, auto.pulls, auto.chosen = DiscountedUCB(auto.names), {n: 0 for n in auto.names}, None
    auto.draft(None, 3)
    auto.observe(4, 0.0)
    assert auto.bandit.count == {"pld": 0.0, "suffix": 0.0} and auto.chosen is None


def test_discounted_ucb_reports_each_pulled_arms_discounted_mean_reward():
    """The report is each arm's mean reward under the same discount as its index: a's 4 (weight
    0.5^2) and 6 (weight 1) average to 5.6; an arm never pulled has no figure."""
    bandit = DiscountedUCB(["a", "b", "c"], discount=0.5, exploration=1.0)
    for arm, value in (("a", 4.0), ("b", 2.0), ("a", 6.0)):
        bandit.reward(arm, value)
    assert bandit.report() == {"a": round((0.25 * 4.0 + 6.0) / 1.25, 2), "b": 2.0}


def test_discounted_ucb_still_explores_when_every_reward_was_the_same():
    """With no spread among the rewards the bonus falls back to the mean's scale (or 1 when that is
    0): the arm pulled less, its mean tied, is tried next instead of the first arm forever."""
    for value in (2.0, 0.0):
        bandit = DiscountedUCB(["a", "b"], discount=0.5, exploration=1.0)
        for arm in ("a", "b", "a"):
            bandit.reward(arm, value)
        assert bandit.count["b"] < bandit.count["a"]
        assert bandit.choose() == "b"


def test_auto_keeps_one_bandit_per_discount_and_exploration_and_at_most_kept_bandits():
    """The bandit's statistics live in the backend's memory under the request's settings: the same
    settings share one, another discount or exploration weight gets its own (with that setting), and
    only the KEPT_BANDITS most recently used settings are kept."""
    from decodekit.speculative.drafters.bandit import KEPT_BANDITS, BanditDrafter

    state = state_for([1, 2, 3, 1, 2])

    def bandit(**options) -> DiscountedUCB:
        auto = BanditDrafter(arms="pld,suffix", **options)
        auto.begin(state)
        return auto.bandit

    first = bandit(discount=0.9)
    assert first.discount == 0.9 and bandit(discount=0.9) is first
    other = bandit(discount=0.8)
    assert other is not first and other.discount == 0.8
    bolder = bandit(discount=0.9, exploration=2.0)
    assert bolder is not first and bolder.exploration == 2.0 and bolder.discount == 0.9
    for i in range(KEPT_BANDITS - 3):
        bandit(discount=0.7 - 0.01 * i)
    assert bandit(discount=0.9) is first  # KEPT_BANDITS settings used: all still kept
    for i in range(KEPT_BANDITS):
        bandit(discount=0.5 - 0.05 * i)
    assert bandit(discount=0.9) is not first  # pushed out by KEPT_BANDITS later settings


def test_a_context_drafter_indexes_each_token_once_and_forgets_the_last_request():
    """ContextDrafter's contract: begin() resets and indexes the prompt, later calls index only the
    tokens added since; a new request starts from an empty index."""
    from decodekit.speculative.drafters.base import ContextDrafter

    class Recorder(ContextDrafter):
        def reset(self):
            self.indexed = []

        def push(self, tokens, position):
            self.indexed.append(tokens[position])

        def draft(self, state, budget):
            self.sync(state)
            return DraftTree()

    drafter = Recorder()
    state = state_for([1, 2, 3])
    drafter.begin(state)
    state.tokens += [4]
    drafter.draft(state, 2)
    drafter.draft(state, 2)
    assert drafter.indexed == [1, 2, 3, 4]
    drafter.begin(state_for([7, 8]))
    assert drafter.indexed == [7, 8]


class _Overeager(Drafter):
    """Proposes ``size`` tokens of plain greedy's continuation whatever budget it is given, and
    records the budgets it was given and the trees verified."""

    def __init__(self, reference: list[int], size: int):
        self.reference, self.size, self.asked, self.verified = reference, size, [], []

    def draft(self, state, budget):
        self.asked.append(budget)
        done = len(state.tokens) - state.prompt_len
        return DraftTree.chain(self.reference[done:done + self.size])

    def update(self, state, tree, verdict, logits):
        if len(tree):
            self.verified.append(len(tree))


@pytest.mark.parametrize("options", [{"budget": 8}, {"cost_table": FLAT_COSTS}], ids=["fixed", "controller"])
def test_a_draft_larger_than_its_budget_is_cut_to_the_budget(engines, options):
    """A drafter's tree is verified within the budget it was granted (the context's and the
    request's room included), however many nodes it proposed."""
    from decodekit.speculative.loop import make_controller

    engine = engines[0]
    prompt = engine.model.tokenizer.encode(PROMPTS[1])
    reference = engine.generate(PROMPTS[1], max_new_tokens=12, chat=False).tokens
    drafter = _Overeager(reference, 10)
    method = SpeculativeMethod(drafter, make_controller(dict(options)))
    got = StepDecoder(method).generate(engine.model, Request(list(prompt), Sampler(greedy=True), 6))
    assert got.tokens == reference[:6]
    assert drafter.verified and all(n <= budget for n, budget in zip(drafter.verified, drafter.asked)), (
        drafter.asked, drafter.verified)


def test_max_draft_caps_a_fixed_budget_too(engines, monkeypatch):
    """``max_draft`` caps the draft-tree nodes per step, a fixed ``budget`` above it included."""
    verified = record_verified_tree_sizes(monkeypatch)
    got = engines[0].generate(PROMPTS[1], method="pld", budget=10, max_draft=4, max_new_tokens=30, chat=False)
    assert got.tokens == engines[0].generate(PROMPTS[1], max_new_tokens=30, chat=False).tokens
    assert max(verified) == 4, verified

def test_recycling_trees_are_no_deeper_than_max_depth():
    """A chain of filled rows (5 -> 10 -> 20 -> 30 -> 40) drafts only ``max_depth`` levels of it,
    however much budget is left."""
    from decodekit.speculative.drafters.recycling import TokenRecycling

    state = state_for([1, 2, 5], vocab=64)
    for depth in (1, 2, 3):
        drafter = TokenRecycling(k=1, max_depth=depth)
        drafter.begin(state)
        drafter.matrix.fill_(-1)
        for token, successor in ((5, 10), (10, 20), (20, 30), (30, 40)):
            drafter.matrix[token, 0] = successor
        tree = drafter.draft(state, 8)
        assert tree.tokens == [10, 20, 30, 40][:depth] and tree.parents == list(range(-1, depth - 1))


def test_suffix_width_bounds_the_continuations_followed_at_every_node():
    """``width`` continuations are followed below the root and below every deeper node alike:
    the most frequent ones, ties by token id."""
    # "1" is followed by 3, 4, 5 (once each); the last "1" (after 9, never seen before) matches "1"
    state = state_for([1, 3, 1, 4, 1, 5, 9, 1])
    drafter = SuffixDrafter(width=2)
    drafter.begin(state)
    tree = drafter.draft(state, 8)
    assert sorted(tree.tokens[c] for c in tree.children(-1)) == [3, 4]
    assert 5 not in tree.tokens
    # "1" is followed by 2 three times; "1 2" by 3, 4, 5 once each: depth 2 (growth 2 x match 1)
    state = state_for([1, 2, 3, 1, 2, 4, 1, 2, 5, 7, 1])
    for width, below in ((1, [3]), (2, [3, 4]), (3, [3, 4, 5])):
        drafter = SuffixDrafter(width=width)
        drafter.begin(state)
        tree = drafter.draft(state, 8)
        assert [tree.tokens[c] for c in tree.children(-1)] == [2]
        assert sorted(tree.tokens[c] for c in tree.children(0)) == below


def test_a_rebuilt_corpus_keeps_its_documents_oldest_first(monkeypatch):
    """Past its size limit the corpus keeps the newest outputs in the order they came: the newest
    stays the last document (the next rebuild again keeps from that end)."""
    from decodekit.speculative.drafters import suffix

    monkeypatch.setattr(suffix, "CORPUS_LIMIT", 10)
    corpus = suffix.Corpus()
    for doc in ([1, 2, 3, 4, 5], [6], [7]):  # 6 + 2 + 2 = 10 tokens with separators: at the limit
        corpus.add(doc)
    assert corpus.automaton.size == 10
    corpus.add([8])  # 12: over it; the newest that fit in 5 stay: [8], [7], [6] with their separators
    assert corpus.documents == [[6], [7], [8]] and corpus.automaton.size == 6


def test_a_full_corpus_keeps_only_its_newest_outputs_not_an_older_one_that_fits(monkeypatch):
    """The kept half is the newest run of outputs: an older short one that would fit beside them is
    not kept once a newer one did not fit."""
    from decodekit.speculative.drafters import suffix

    monkeypatch.setattr(suffix, "CORPUS_LIMIT", 10)
    corpus = suffix.Corpus()
    for doc in ([1], [2, 3, 4, 5], [6, 7, 8]):  # 2 + 5 + 4 = 11 tokens with separators: over 10
        corpus.add(doc)
    # [6, 7, 8] takes 4 of the 5; [2, 3, 4, 5] does not fit beside it, so neither does anything older
    assert corpus.documents == [[6, 7, 8]] and 1 not in corpus.automaton.next[0]


def test_suffix_counts_walk_at_most_count_walk_states_per_token():
    """Each token counts at most COUNT_WALK states along its suffix-link path: in a run of one token
    repeated, the n-th token counts the strings of lengths n, n - 1, ..., n - COUNT_WALK + 1, so a
    string of length m is counted by the tokens m .. m + COUNT_WALK - 1 only (the short ones undercounted)."""
    from decodekit.speculative.drafters.suffix import COUNT_WALK

    sam = SuffixAutomaton()
    length = COUNT_WALK + 20
    for _ in range(length):
        sam.extend(1)
    state = 0
    for m in range(1, length + 1):
        state = sam.next[state][1]
        assert sam.count[state] == min(length, m + COUNT_WALK - 1) - m + 1, m
    # only the short strings are undercounted: the long ones have their true counts
    state = 0
    for m in range(1, length + 1):
        state = sam.next[state][1]
        if m > length - COUNT_WALK:
            assert sam.count[state] == length - m + 1


def test_a_context_match_as_long_as_the_corpus_match_drafts_first():
    """Of two matches of the same length, the request's own context (the nearer evidence, as in
    hierarchy drafting's temporal locality) drafts before the earlier outputs."""
    from decodekit.speculative.drafters.suffix import corpus_for

    state = state_for([1, 2, 3, 9, 1, 2])  # its own longest repeat is "1 2" (then 3)
    corpus_for(state.backend).add([5, 1, 2, 4])  # the corpus's longest match is "1 2" too (then 4)
    drafter = SuffixDrafter(corpus=True)
    drafter.begin(state)
    tree = drafter.draft(state, 1)
    assert (tree.tokens, tree.source) == ([3], ["suffix"])


def test_a_context_term_of_zero_for_one_size_leaves_the_others_terms():
    """A per-context term may be zero for some sizes only (a cached or given table): the other
    sizes still pay for the context. Here 2 tokens cost 2.0 + 1,000 x 0.001 after 1,000 tokens."""
    table = CostTable({1: 1.0, 2: 2.0}, per_context={1: 0.0, 2: 0.001})
    assert table(1, 1000) == pytest.approx(1.0)
    assert table(2, 1000) == pytest.approx(3.0) and table(2, 500) == pytest.approx(2.5)


def test_per_context_costs_keyed_by_digits_are_read_as_their_sizes():
    """JSON writes keys as digits: per-context costs given so are the same terms as integer keys."""
    table = CostTable({1: 1.0, 2: 2.0}, per_context={"1": 0.001, "2": 0.002})
    assert table.slopes == [0.001, 0.002]
    assert table(1, 1000) == pytest.approx(2.0) and table(2, 1000) == pytest.approx(4.0)


def test_realised_speed_sets_the_longest_pause_from_the_eighth_measured_step():
    """Verifying is free here, so a probe's estimated loss is nothing and the pause is the floor of 4;
    once MIN_REALISED_STEPS (8) speculative steps are measured, each 1 token in 2 plain steps' time,
    a probe loses one plain step: the pause is 1 / EXPLORE_SHARE = 100 steps, from the eighth on."""
    ctl = Controller(8, cost_table={1: 1.0, 2: 1.0})
    for _ in range(7):
        ctl.observe_step(1, 2.0)
    assert ctl._max_backoff() == 4
    ctl.observe_step(1, 2.0)
    assert ctl._max_backoff() == 100


def test_realised_tokens_and_seconds_are_moving_averages_of_the_steps():
    """The first speculative step sets both averages; later ones move them by ema (0.15)."""
    ctl = Controller(8, cost_table={1: 1.0, 2: 1.1})
    ctl.observe_step(4, 1.0)
    assert (ctl.learnt.step_tokens, ctl.learnt.step_seconds) == (4.0, 1.0)
    ctl.observe_step(1, 3.0)
    assert ctl.learnt.step_tokens == pytest.approx(4.0 + 0.15 * (1 - 4.0))  # 3.55
    assert ctl.learnt.step_seconds == pytest.approx(1.0 + 0.15 * (3.0 - 1.0))  # 1.3
    assert ctl.learnt.spec_steps == 2


def test_the_verifiers_bookkeeping_is_a_moving_average_of_the_steps():
    ctl = Controller(8, cost_table={1: 1.0, 2: 1.1})
    ctl.observe(DraftTree.chain([1], "s"), Verification([0], 0), overhead_s=0.1)
    assert ctl.overhead == pytest.approx(0.1)
    ctl.observe(DraftTree.chain([1], "s"), Verification([0], 0), overhead_s=0.3)
    assert ctl.overhead == pytest.approx(0.1 + 0.15 * (0.3 - 0.1))  # 0.13


def test_a_selected_subtree_keeps_each_nodes_own_source():
    from decodekit.speculative.tree import select_nodes

    tree = DraftTree([1, 2, 3, 4], [-1, -1, -1, 2], {}, ["a", "b", "c", "d"])
    kept = select_nodes(tree, [3, 2, 0])
    assert kept.tokens == [1, 3, 4] and kept.parents == [-1, -1, 1] and kept.source == ["a", "c", "d"]


def test_a_residual_with_no_mass_anywhere_is_uniform():
    """Rejecting the only token p allows (a rejection of probability 0, by rounding) leaves nothing
    of p: the residual falls back to the uniform distribution, never to NaN."""
    import torch

    from decodekit.speculative.verify import residual

    out = residual(torch.tensor([1.0, 0.0, 0.0, 0.0]), None, 0)
    assert torch.equal(out, torch.full((4,), 0.25))
    out = residual(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]), 1)
    assert torch.equal(out, torch.full((2,), 0.5))


def test_accepted_by_source_counts_the_accepted_drafts_only():
    """Each accepted draft token is credited to the drafter that proposed it; rejected ones to none:
    the counts add up to the run's accepted drafts, fewer than it drafted."""
    from decodekit.engine import Engine
    from decodekit.models import CharTokenizer, LoadedModel
    from decodekit.models.tiny import tiny_llama

    engine = Engine(LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny"))
    extra = engine.generate("abcabcabcabcabcabcabc", method="hierarchy", max_new_tokens=30, chat=False, budget=8).stats.extra
    assert 0 < extra["accepted"] < extra["drafted"]
    assert sum(extra["accepted_by_source"].values()) == extra["accepted"]
