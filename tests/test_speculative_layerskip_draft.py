"""Layer-skipping (self-speculative) and draft-model drafters: exactness through the loop, cache
hygiene, the adaptive skip-set rule, draft-cache sync, and exact speculative sampling."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from test_speculative_sampling import chi_square_passes, marginal, sample_outcomes

from decodekit.engine import Engine
from decodekit.engine.core import DecodeState, GenerationStats
from decodekit.errors import DecodeKitError, InvalidParameter
from decodekit.models import CharTokenizer, LoadedModel
from decodekit.models.hf import HFBackend
from decodekit.models.tiny import tiny_hf_model, tiny_llama
from decodekit.samplers import Sampler
from decodekit.speculative.controller import Controller
from decodekit.speculative.drafters.base import ChainDrafter
from decodekit.speculative.drafters.draft_model import DraftModelDrafter, fit_vocab
from decodekit.speculative.drafters.layerskip import (
    GROW_ACCEPT,
    SHRINK_ACCEPT,
    WINDOW,
    LayerSkipDrafter,
    SkipSearch,
    initial_skip_set,
    layer_importance,
)
from decodekit.speculative.loop import SpeculativeMethod
from decodekit.speculative.tree import DraftTree, Verification

LAYERS = 6
PROMPTS = ("hello world hello world", "The quick brown fox jumps", "abcabcabc", "Q: 7*6=? A:")



def tiny(seed: int = 0, vocab: int = 96, layers: int = LAYERS, **kw) -> LoadedModel:
    backend = tiny_llama(seed=seed, vocab_size=vocab, num_layers=layers, scale=2.0, **kw)
    return LoadedModel(backend, CharTokenizer(vocab), "tiny")


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny(seed=1))


@pytest.fixture(scope="module")
def references(engine) -> dict[str, list[int]]:
    return {p: engine.generate(p, max_new_tokens=40, chat=False).tokens for p in PROMPTS}


def generate(engine: Engine, prompt: str, method: str, **options):
    return engine.generate(prompt, method=method, max_new_tokens=40, chat=False, **options)


# Greedy exactness through the colleague's loop ---------------------------------------------------

CASES = {
    "layerskip": ("layerskip", {}),
    "layerskip-half": ("layerskip", {"skip_ratio": 0.5, "confidence": 0.0}),
    "layerskip-fixed": ("layerskip", {"adapt": False, "confidence": 0.0}),
    "draft-other-seed": ("draft", {"draft_model": tiny_llama(seed=7, num_layers=2, scale=2.0)}),
    "draft-wider-vocab": ("draft", {"draft_model": tiny_llama(seed=1, vocab_size=112, num_layers=LAYERS, scale=2.0)}),
    "self-truncated": ("draft", {"draft_model": "self-truncated:2", "confidence": 0.0}),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("control", [{"budget": 5}, {"cost_table": {1: 1.0, 64: 1.0}}], ids=["fixed", "controller"])
def test_greedy_output_is_plain_greedy(engine, references, case, control):
    method, options = CASES[case]
    for prompt in PROMPTS:
        got = generate(engine, prompt, method, **options, **control)
        assert got.tokens == references[prompt], (case, prompt)


def test_identical_draft_model_accepts_everything(engine, references):
    twins = [tiny_llama(seed=1, num_layers=LAYERS, scale=2.0), f"self-truncated:{LAYERS}"]
    for twin in twins:
        for prompt in PROMPTS:
            got = generate(engine, prompt, "draft", draft_model=twin, confidence=0.0, budget=4)
            assert got.tokens == references[prompt]
            assert got.stats.extra["acceptance_rate"] == 1.0
            assert got.stats.extra["plain_steps"] == 0


def test_layerskip_with_nothing_skipped_accepts_everything(engine, references):
    for prompt in PROMPTS:
        got = generate(engine, prompt, "layerskip", skip_ratio=0.0, confidence=0.0, budget=4)
        assert got.tokens == references[prompt]
        assert got.stats.extra["acceptance_rate"] == 1.0
        assert got.stats.extra["skip_layers"] == []


# Drafting against a hand-built DecodeState --------------------------------------------------------


def pending_state(backend, prompt: list[int], root: int, sampler: Sampler | None = None) -> DecodeState:
    """Prompt prefilled, ``root`` chosen and pending (what the loop hands a drafter)."""
    state = DecodeState(backend, sampler or Sampler(greedy=True), prompt, GenerationStats())
    state.prefill()
    return state


def test_layerskip_leaves_the_target_cache_as_found():
    prompt, root = [5, 17, 33, 2, 9, 40, 11], 21
    drafted = tiny_llama(seed=2, num_layers=LAYERS, scale=2.0)
    untouched = tiny_llama(seed=2, num_layers=LAYERS, scale=2.0)
    state = pending_state(drafted, prompt, root)
    drafter = LayerSkipDrafter(skip_ratio=0.5, confidence=0.0)
    drafter.begin(state)  # runs the layer-importance probe, then rolls it back
    state.commit([root])
    tree = drafter.draft(state, 5)
    assert len(tree) == 5 and drafter.skip_layers
    assert drafted.length == len(prompt)
    untouched.prefill(prompt)
    after_draft = drafted.step(torch.tensor([root]))
    assert torch.equal(after_draft, untouched.step(torch.tensor([root])))


def test_layerskip_draft_is_the_greedy_chain_of_the_skipped_model():
    prompt, root = [3, 14, 15, 92, 65], 35
    backend = tiny_llama(seed=3, num_layers=LAYERS, scale=2.0)
    state = pending_state(backend, prompt, root)
    drafter = LayerSkipDrafter(skip_ratio=0.5, confidence=0.0, adapt=False)
    drafter.begin(state)
    state.commit([root])
    tree = drafter.draft(state, 4)
    reference = tiny_llama(seed=3, num_layers=LAYERS, scale=2.0)
    reference.prefill(prompt)
    token, chain = root, []
    for _ in range(4):
        token = int(reference.append(torch.tensor([[token]]), skip_layers=drafter.skip_layers).logits[0, -1].argmax())
        chain.append(token)
    assert tree.tokens == chain and tree.parents == [-1, 0, 1, 2]


def test_confidence_threshold_stops_drafting():
    backend = tiny_llama(seed=3, num_layers=LAYERS, scale=2.0)
    state = pending_state(backend, [3, 14, 15, 92, 65], 35)
    state.commit([35])
    for confidence, expected in ((0.0, 6), (1.0, 0)):  # a top-1 probability of 1 is never reached
        drafters = (LayerSkipDrafter(confidence=confidence), DraftModelDrafter(draft_model="self-truncated:3", confidence=confidence))
        for drafter in drafters:
            drafter.begin(state)
            assert len(drafter.draft(state, 6)) == expected
            assert backend.length == 5


def test_a_draft_token_exactly_as_confident_as_the_threshold_is_kept():
    """The stop is before a token whose top-1 probability is *below* ``confidence`` (SWIFT's rule)."""
    from decodekit.speculative.drafters.base import ChainDrafter

    class Even(ChainDrafter):  # two equally likely tokens at every step: top-1 probability exactly 0.5
        name = "even"
        logits = torch.tensor([0.0, 0.0] + [-float("inf")] * 30)

        def _start(self, state, budget):
            return self.logits, budget

        def _advance(self, token):
            return self.logits

    state = DecodeState(tiny_llama(vocab_size=32), Sampler(greedy=True), [1, 2, 3], GenerationStats())
    assert len(Even(max_draft=None, confidence=0.5, stochastic=False).draft(state, 4)) == 4
    assert len(Even(max_draft=None, confidence=0.51, stochastic=False).draft(state, 4)) == 0



class _Fixed(ChainDrafter):
    """A chain drafter whose draft model always gives the same logits (token 0 a little ahead of 1)."""

    name = "fixed"
    logits = torch.tensor([0.5, 0.0] + [-float("inf")] * 30)

    def _start(self, state, budget):
        return self.logits, budget

    def _advance(self, token):
        return self.logits


def test_a_chain_draft_penalises_the_tokens_drafted_before_it_but_not_the_prompt():
    """The request's presence penalty counts generated ids only (the prompt's 0 is not one) and every
    token drafted earlier in the chain: 0 (0.5), then 1 (0 beats 0.5 - 1), then 0 (-0.5 beats -1)."""
    sampler = Sampler.from_params(greedy=True, presence_penalty=1.0)
    state = DecodeState(tiny_llama(vocab_size=32), sampler, [0, 5], GenerationStats())
    assert _Fixed(max_draft=None, confidence=0.0, stochastic=False).draft(state, 3).tokens == [0, 1, 0]


def test_a_chain_drafter_keeps_to_its_own_cap():
    """``max_draft`` caps a chain below the budget the controller grants."""
    state = DecodeState(tiny_llama(vocab_size=32), Sampler(greedy=True), [1, 2, 3], GenerationStats())
    assert len(_Fixed(max_draft=2, confidence=0.0, stochastic=False).draft(state, 5)) == 2
    assert len(_Fixed(max_draft=None, confidence=0.0, stochastic=False).draft(state, 5)) == 5


def test_draft_model_keeps_its_cache_in_sync_and_catches_up_in_one_pass():
    target = tiny_llama(seed=4, num_layers=2, scale=2.0)
    draft = tiny_llama(seed=5, num_layers=2, scale=2.0)
    calls: list[int] = []
    state = pending_state(target, [1, 2, 3, 4, 5], 6)
    drafter = DraftModelDrafter(draft_model=draft, confidence=0.0)
    drafter.begin(state)  # nothing yet: the first draft runs the prompt
    assert drafter.backend is not draft  # a clone the target keeps: draft may be decoding a request of its own
    real_append = drafter.backend.append

    def spy(tokens, **kw):
        calls.append(tokens.shape[1])
        return real_append(tokens, **kw)

    drafter.backend.append = spy
    state.commit([6])
    catch_up = 6  # the prompt and the root, in one pass
    for accepted in (0, 4, 2, 4, 1):
        calls.clear()
        tree = drafter.draft(state, 4)
        assert calls == [catch_up, 1, 1, 1]
        bonus = 7 if accepted == 4 else (tree.tokens[accepted] + 1) % 96  # a rejection
        state.commit(tree.tokens[:accepted] + [bonus])
        # all accepted: the last draft token (never fed to the draft model) and the bonus, together
        catch_up = 2 if accepted == 4 else 1
    fresh = tiny_llama(seed=5, num_layers=2, scale=2.0)
    expected = int(fresh.append(torch.tensor([state.tokens])).logits[0, -1].argmax())
    assert drafter.draft(state, 1).tokens == [expected]


def test_last_steps_counts_the_draft_passes_of_the_latest_draft_only():
    """``last_steps`` (documented on the chain drafters) is the number of forward passes the draft
    model ran in the latest ``draft``: the catch-up pass and one per further chain token, counted
    afresh by every draft, not summed over a request's drafts."""
    target = tiny_llama(seed=4, num_layers=2, scale=2.0)
    state = pending_state(target, [1, 2, 3, 4, 5], 6)
    drafter = DraftModelDrafter(draft_model=tiny_llama(seed=5, num_layers=2, scale=2.0), confidence=0.0)
    drafter.begin(state)
    state.commit([6])
    calls: list[int] = []
    real_append = drafter.backend.append
    drafter.backend.append = lambda tokens, **kw: calls.append(tokens.shape[1]) or real_append(tokens, **kw)
    for budget in (4, 2, 3):
        calls.clear()
        tree = drafter.draft(state, budget)
        assert len(tree) == budget
        assert drafter.last_steps == len(calls) == budget  # one pass per chain token, the first catching up
        state.commit(tree.tokens[:1] + [(tree.tokens[1] + 1) % 96])  # one accepted, then a rejection


def test_a_new_request_starts_the_draft_cache_afresh():
    """``begin`` empties the draft cache: the next request's first draft runs its whole context, even
    where it shares a prefix with the last request's, and drafts what a fresh draft model would."""
    target = tiny_llama(seed=4, num_layers=2, scale=2.0)
    drafter = DraftModelDrafter(draft_model=tiny_llama(seed=5, num_layers=2, scale=2.0), confidence=0.0)
    for prompt in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 9, 8]):
        target.reset(1)
        state = pending_state(target, prompt, 6)
        drafter.begin(state)
        state.commit([6])
        calls = []
        real_append = drafter.backend.append
        drafter.backend.append = lambda tokens, **kw: calls.append(tokens.shape[1]) or real_append(tokens, **kw)
        tree = drafter.draft(state, 1)
        drafter.backend.append = real_append
        fresh = tiny_llama(seed=5, num_layers=2, scale=2.0)
        assert calls == [len(prompt) + 1]
        assert tree.tokens == [int(fresh.append(torch.tensor([state.tokens])).logits[0, -1].argmax())]


def test_fit_vocab_cuts_or_pads_with_minus_infinity():
    logits = torch.arange(5.0)
    assert fit_vocab(logits, 3).tolist() == [0.0, 1.0, 2.0]
    assert fit_vocab(logits, 7).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, float("-inf"), float("-inf")]


def test_a_draft_model_of_another_tokenizer_is_refused_in_one_line():
    """A vocabulary smaller than the target's by more than a padding is another tokenizer's (its
    ids mean other tokens, and the target's largest ones are past its embedding table); a token
    past the draft's vocabulary, one of the target's padding, is refused where it comes."""
    target = LoadedModel(tiny_llama(seed=0, vocab_size=3000), CharTokenizer(96), "tiny")
    small = tiny_llama(seed=1, vocab_size=96)
    with pytest.raises(InvalidParameter, match="vocabulary \\(96 tokens\\) is not the target's \\(3000\\)") as err:
        Engine(target).generate("hello", method="draft", draft_model=small, max_new_tokens=8, chat=False)
    assert err.value.param == "draft_model"
    with pytest.raises(InvalidParameter, match="vocabulary \\(3000 tokens\\) is not the target's \\(96\\)"):
        Engine(LoadedModel(small, CharTokenizer(96), "tiny")).generate(
            "hello", method="draft", draft_model=tiny_llama(seed=2, vocab_size=3000), max_new_tokens=8, chat=False)
    padded = LoadedModel(tiny_llama(seed=0, vocab_size=96 + 64), CharTokenizer(96), "tiny")
    drafter = DraftModelDrafter(draft_model=tiny_llama(seed=1, vocab_size=96))
    state = DecodeState(padded.backend, Sampler(greedy=True), [1, 2, 96 + 7], GenerationStats())
    drafter.begin(state)  # a padding apart: taken
    with pytest.raises(InvalidParameter, match="token 103 is past the draft model's vocabulary of 96"):
        drafter.draft(state, 2)


def test_a_draft_vocabulary_exactly_a_padding_apart_is_taken_and_its_first_missing_id_refused():
    """A draft model may differ from the target's vocabulary by up to ``VOCAB_PADDING`` ids (a padding);
    the first id past the draft's vocabulary (its size) is one it cannot read."""
    from decodekit.speculative.drafters.draft_model import VOCAB_PADDING

    target = tiny_llama(seed=0, vocab_size=96 + VOCAB_PADDING)
    drafter = DraftModelDrafter(draft_model=tiny_llama(seed=1, vocab_size=96))
    state = DecodeState(target, Sampler(greedy=True), [1, 2, 3], GenerationStats())
    drafter.begin(state)  # exactly a padding apart: taken
    assert len(drafter.draft(state, 2)) <= 2
    state = DecodeState(target, Sampler(greedy=True), [1, 2, 96], GenerationStats())
    drafter.begin(state)
    with pytest.raises(InvalidParameter, match="token 96 is past the draft model's vocabulary of 96"):
        drafter.draft(state, 2)


def test_self_truncated_zero_is_refused_when_the_drafter_is_made():
    """``self-truncated:N`` needs a positive layer count, checked with the options, before any model runs."""
    with pytest.raises(InvalidParameter, match="N a positive layer count"):
        DraftModelDrafter(draft_model="self-truncated:0")


# The adaptive skip-set rule, pinned with fake acceptance signals ----------------------------------


def feed(search: SkipSearch, accepted: int, passes: int, rounds: int = WINDOW) -> None:
    for _ in range(rounds):
        search.record(accepted, passes)


def test_mostly_wrong_drafts_trigger_a_shrink_trial_dropped_when_worse_kept_when_better():
    search = SkipSearch(12, initial_skip_set(12, 8))
    start = search.current
    feed(search, 0, 4)  # nothing accepted: score 1 / (4 * 4/12 + 1) < 1, per pass 0 < SHRINK_ACCEPT
    assert search.trial and search.current < start and len(search.current) == 6  # a quarter fewer
    feed(search, 0, 4)  # the trial is no better (dearer passes, still nothing accepted): back
    assert not search.trial and search.current == start
    feed(search, 0, 4)
    shrunk = search.current
    feed(search, 3, 4)  # this time the trial scores better: kept
    assert not search.trial and search.best == shrunk == search.current
    assert search.changes == 3


def test_half_right_drafts_that_do_not_pay_trigger_a_swap():
    search = SkipSearch(12, initial_skip_set(12, 5))
    start = search.current
    feed(search, 2, 4)  # per pass 0.5: between SHRINK_ACCEPT and GROW_ACCEPT; score 3 / (4 * 7/12 + 1) < 1
    assert SHRINK_ACCEPT <= 0.5 < GROW_ACCEPT and search.speed(2, 4, 1, 5) < 1
    assert search.trial and len(search.current) == 5 and len(search.current - start) == 1


def test_an_empty_skip_set_has_nothing_to_swap_and_is_kept():
    """Half-right drafts from the full model (nothing skipped: a skip ratio rounded to zero) ask for
    a swap; with no skipped layer to swap out the set stays empty and no trial starts."""
    search = SkipSearch(12, frozenset())
    feed(search, 2, 4)  # per pass 0.5, score 3 / (4 + 1) < 1
    assert search.current == frozenset() and not search.trial and search.changes == 0

def test_a_trial_that_only_ties_the_best_set_is_dropped():
    """A trial is kept if it scores better (the module docstring); one that does as well as the set
    it replaced is not, so the set does not wander among equals."""
    search = SkipSearch(12, initial_skip_set(12, 5))
    start = search.current
    feed(search, 2, 4)  # a swap trial: the same number of skipped layers
    assert search.trial and len(search.current) == 5 and search.current != start
    feed(search, 2, 4)  # the same signals: the same score as the best set's
    assert not search.trial and search.current == start and search.changes == 2


def test_good_acceptance_keeps_the_skip_set():
    search = SkipSearch(12, initial_skip_set(12, 5))
    start = search.current
    feed(search, 4, 4, rounds=5 * WINDOW)  # every draft pass accepted: score > 1
    assert search.current == start and search.changes == 0


def test_drafts_that_are_right_but_do_not_pay_grow_the_skip_set():
    search = SkipSearch(12, initial_skip_set(12, 1))
    feed(search, 4, 5)  # per pass 0.8, but one skipped layer of 12 saves too little
    assert 4 / 5 >= GROW_ACCEPT and search.speed(4, 5, 1, 1) < 1
    assert search.trial and len(search.current) == 2 and search.current > initial_skip_set(12, 1)


def test_trials_use_the_least_important_layers():
    importance = [9.0, 0.5, 0.1, 0.2, 0.3, 0.4, 0.6, 0.7, 0.8, 9.0]
    assert initial_skip_set(10, 3, importance) == {2, 3, 4}
    assert initial_skip_set(10, 99) == frozenset(range(1, 9))  # never the first or last layer
    search = SkipSearch(10, initial_skip_set(10, 3, importance), importance)
    feed(search, 0, 3)
    assert search.current == {2, 3}  # shrink: layer 4 is the most important skipped
    feed(search, 0, 3)  # no better: back to {2, 3, 4}
    feed(search, 2, 3)  # per pass 2/3: a swap
    added = search.current - {2, 3, 4}
    assert len(added) == 1 and added <= {1, 5, 6, 7}  # one of the 4 least important kept layers
    trial = search.current
    feed(search, 0, 0, rounds=3 * WINDOW)  # rounds without draft passes carry no signal
    assert search.trial and search.current == trial


def test_skip_set_speed_counts_a_draft_pass_at_its_share_of_the_layers():
    """The score is (accepted + rounds) / (draft passes * (1 - skipped/L) + rounds): a pass with half
    the layers skipped costs half a verification, so 2 accepted of 4 such passes per round is exactly
    plain decoding's speed and starts no search."""
    search = SkipSearch(12, initial_skip_set(12, 6))
    assert search.speed(2, 4, 1, 6) == pytest.approx(3 / (4 * 0.5 + 1)) == pytest.approx(1.0)
    assert search.speed(0, 3, 2, 9) == pytest.approx(2 / (3 * 0.25 + 2))
    start = search.current
    feed(search, 2, 4)  # score 1: not below plain decoding
    assert not search.trial and search.current == start and search.changes == 0


def test_a_trial_is_judged_against_the_best_sets_latest_score():
    """Each window re-measures the best set on the current text (the module docstring), and the next
    trial must beat that fresh score, not an older, higher one from other text."""
    search = SkipSearch(12, initial_skip_set(12, 8))
    feed(search, 0, 4)  # score 1 / (4 * 4/12 + 1) < 1, nothing accepted: a shrink trial to 6 layers
    six = search.current
    assert search.trial and len(six) == 6
    feed(search, 3, 4)  # the trial scores 4 / (4 * 6/12 + 1) = 4/3: kept
    assert not search.trial and search.best == six
    feed(search, 0, 4)  # the text changed: the best set now scores 1 / 3, a shrink trial to 5 layers
    five = search.current
    assert search.trial and len(five) == 5 and five < six
    feed(search, 1, 4)  # 2 / (4 * 7/12 + 1) = 0.6: better than 1/3 (though not than the old 4/3): kept
    assert not search.trial and search.best == five == search.current


def test_layer_importance_is_one_minus_the_cosine_of_a_layers_input_and_output():
    """Block influence (ShortGPT): 1 - cos(h_i, h_i+1) averaged over the probe's positions; a layer
    that leaves its input unchanged scores 0 and is skipped first; the probe is rolled back."""
    states = [[[1.0, 0.0], [1.0, 0.0]],  # input
              [[1.0, 0.0], [1.0, 0.0]],  # layer 0 changes nothing: 1 - 1 = 0
              [[0.0, 1.0], [0.0, 1.0]],  # layer 1 turns it by 90 degrees: 1 - 0 = 1
              [[0.0, -1.0], [0.0, -1.0]],  # layer 2 reverses it: 1 - (-1) = 2
              [[0.0, -1.0], [1.0, 0.0]]]  # layer 3: cosines 1 and 0, so 1 - 1/2
    hidden = [torch.tensor([h]) for h in states]

    class Probed:
        length = 3
        info = SimpleNamespace(num_layers=4, max_length=64)
        kv_policy = None

        def append(self, tokens, hidden_layers):
            assert list(hidden_layers) == list(range(5)) and tokens.tolist() == [[8, 9]]
            self.length += tokens.shape[1]
            return SimpleNamespace(hidden=hidden)

        def truncate(self, length):
            self.length = length

    backend = Probed()
    importance = layer_importance(backend, [7, 8, 9][-2:])
    assert importance == pytest.approx([0.0, 1.0, 2.0, 0.5]) and backend.length == 3
    assert initial_skip_set(4, 1, importance) == {1}  # of layers 1 and 2, the less influential


def test_the_starting_skip_set_is_the_skip_ratio_of_the_layers_rounded():
    """``round(skip_ratio * L)`` layers skipped at the start (the module docstring): 0.3 of 6 is 1.8, so 2."""
    backend = tiny_llama(seed=3, num_layers=LAYERS, scale=2.0)
    state = pending_state(backend, [3, 14, 15, 92, 65], 35)
    drafter = LayerSkipDrafter(skip_ratio=0.3)
    drafter.begin(state)
    assert len(drafter.skip_layers) == round(0.3 * LAYERS) == 2


def test_the_skip_search_counts_only_the_accepted_tokens_layer_skipping_drafted():
    """In a tree of several drafters (hierarchy), the skip set is judged by its own drafts: accepted
    nodes another drafter proposed say nothing about the skipped layers."""
    drafter = LayerSkipDrafter(skip_ratio=0.5)
    recorded = []
    drafter.search = SimpleNamespace(record=lambda accepted, passes: recorded.append((accepted, passes)))
    tree = DraftTree()
    for token, parent, source in ((5, -1, "layerskip"), (6, 0, "pld"), (7, 1, "pld"), (8, -1, "layerskip")):
        tree.add(token, parent, source)
    drafter.last_steps = 2
    drafter.update(None, tree, Verification([0, 1, 2], 0), None)
    assert recorded == [(1, 2)] and drafter.last_steps == 0


def test_the_drafter_changes_its_skip_set_when_nothing_is_accepted():
    backend = tiny_llama(seed=3, num_layers=LAYERS, scale=2.0)
    state = pending_state(backend, [3, 14, 15, 92, 65], 35)
    state.commit([35])
    drafter = LayerSkipDrafter(skip_ratio=0.5, confidence=0.0)
    drafter.begin(state)
    start = drafter.skip_layers
    for _ in range(WINDOW):
        tree = drafter.draft(state, 4)
        drafter.update(state, tree, Verification([], 0), None)  # fake verdict: all rejected
    assert drafter.skip_layers < start and drafter.report()["skip_set_changes"] == 1
    fixed = LayerSkipDrafter(skip_ratio=0.5, confidence=0.0, adapt=False)
    fixed.begin(state)
    for _ in range(3 * WINDOW):
        fixed.update(state, fixed.draft(state, 4), Verification([], 0), None)
    assert fixed.skip_layers == start


# Speculative sampling stays exact ------------------------------------------------------------------


def exact_first_tokens(backend, prompt: list[int], vocab: int, length: int) -> dict[tuple, float]:
    """P(first ``length`` generated tokens) at temperature 1, EOS (0) ending a sample early."""
    out: dict[tuple, float] = {}

    def walk(prefix: tuple, p: float) -> None:
        if len(prefix) == length:
            out[prefix] = out.get(prefix, 0.0) + p
            return
        probs = torch.softmax(backend.prefill(prompt + list(prefix))[0], dim=-1)
        for t in range(vocab):
            if t == 0:
                out[prefix] = out.get(prefix, 0.0) + p * float(probs[0])
            else:
                walk(prefix + (t,), p * float(probs[t]))

    walk((), 1.0)
    return out


@pytest.mark.parametrize("which", ["draft", "layerskip"])
def test_sampled_drafts_keep_the_target_distribution(which):
    # (a prompt after which EOS is unlikely: after [1, 2, 3, 4, 5, 1] it came first 99.9% of the
    # time, and the samples ended before any draft was verified)
    vocab, n, prompt = 6, 1500, [4, 5, 4, 5]
    model = LoadedModel(tiny_llama(seed=4, vocab_size=vocab, num_layers=4, scale=1.5), CharTokenizer(vocab), "tiny")
    if which == "draft":
        drafter = DraftModelDrafter(draft_model=tiny_llama(seed=8, vocab_size=vocab, num_layers=1), confidence=0.0)
    else:
        drafter = LayerSkipDrafter(skip_ratio=0.5, confidence=0.0, stochastic=True)
    paths: Counter = Counter()
    update = drafter.update

    def counting_update(state, tree, verdict, logits):
        paths[(len(verdict.path), len(tree))] += 1
        update(state, tree, verdict, logits)

    drafter.update = counting_update
    method = SpeculativeMethod(drafter, Controller(3, budget=3))
    counts = sample_outcomes(model, method, prompt, {"temperature": 1.0}, n, 3)
    assert any(a == d > 0 for a, d in paths) and any(a < d for a, d in paths)  # accepts and rejects happen
    exact = exact_first_tokens(model.backend, prompt, vocab, 3)
    padded = {k + (None,) * (3 - len(k)): v for k, v in exact.items()}
    seen = Counter({k + (None,) * (3 - len(k)): v for k, v in counts.items()})
    for positions in (slice(0, 2), slice(1, 3)):
        ok, stat, critical = chi_square_passes(Counter(marginal(seen, positions)), marginal(padded, positions), n)
        assert ok, f"{which} tokens {positions}: chi-square {stat:.1f} >= {critical:.1f}"


def test_sampled_draft_records_its_distributions():
    backend = tiny_llama(seed=3, num_layers=LAYERS, scale=2.0)
    state = pending_state(backend, [3, 14, 15, 92, 65], 35, Sampler.from_params(temperature=0.7, top_k=5, seed=1))
    state.commit([35])
    drafter = DraftModelDrafter(draft_model="self-truncated:3", confidence=0.0)
    drafter.begin(state)
    tree = drafter.draft(state, 4)
    assert sorted(tree.draft_probs) == [-1, 0, 1, 2]
    for parent, q in tree.draft_probs.items():
        child = tree.tokens[parent + 1]
        assert abs(float(q.sum()) - 1) < 1e-5 and int((q > 0).sum()) <= 5 and q[child] > 0


def test_sampled_drafts_of_a_draft_model_identical_to_the_target_are_all_accepted(engine):
    """A sampled draft token is drawn with the target's keyed noise at the position it will take
    (``Sampler.sample_at(q, position)``), so where q equals the target's distribution the draft is
    the token plain seeded sampling draws there: a draft model with all the target's layers drafts
    exactly seeded sampling's tokens, and every draft token is accepted."""
    for prompt in PROMPTS[:2]:
        args = dict(max_new_tokens=24, chat=False, temperature=0.8, seed=3)
        want = engine.generate(prompt, method="sample", **args).tokens
        got = engine.generate(prompt, method="draft", draft_model=f"self-truncated:{LAYERS}", confidence=0.0,
                              budget=4, **args)
        assert got.tokens == want
        assert got.stats.extra["acceptance_rate"] == 1.0, prompt


def test_stochastic_false_drafts_greedily_for_a_sampled_request():
    """``stochastic=False``: a sampling request still gets greedy drafts, the top token of the
    request's processed draft distribution at each step (temperature and top-k keep the draft
    model's argmax), and no draft distributions are recorded."""
    prompt, root = [3, 14, 15, 92, 65], 35
    state = pending_state(tiny_llama(seed=3, num_layers=LAYERS, scale=2.0), prompt, root,
                          Sampler.from_params(temperature=1.5, top_k=20, seed=1))
    state.commit([root])
    drafter = DraftModelDrafter(draft_model=tiny_llama(seed=5, num_layers=2, scale=2.0), confidence=0.0,
                                stochastic=False)
    drafter.begin(state)
    tree = drafter.draft(state, 6)
    fresh = tiny_llama(seed=5, num_layers=2, scale=2.0)
    chain, context = [], list(state.tokens)
    for _ in range(6):
        chain.append(int(fresh.prefill(context + chain)[0].argmax()))
    assert tree.tokens == chain
    assert tree.draft_probs == {}


def test_the_draft_methods_documented_stochastic_default_is_the_one_it_takes():
    """``draft`` samples its drafts for sampled requests unless told not to (the module docstring;
    layerskip's default is the other way): its option table, which help texts and the method's
    signature show, gives the default the drafter itself takes."""
    import inspect

    from decodekit.engine import build_decoder
    from decodekit.speculative.drafters.draft_model import OPTIONS

    taken = inspect.signature(DraftModelDrafter).parameters["stochastic"].default
    assert OPTIONS["stochastic"].default is taken is True
    assert build_decoder("draft", draft_model="self-truncated:1").method.drafter.stochastic is True


# Invalid options ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method, options",
    [
        ("layerskip", {"skip_ratio": 1.0}),
        ("layerskip", {"skip_ratio": -0.1}),
        ("layerskip", {"confidence": 1.5}),
        ("layerskip", {"adapt": "maybe"}),
        ("layerskip", {"stochastic": 1}),
        ("layerskip", {"max_draft": 0}),
        ("layerskip", {"skip_layer": 3}),
        ("draft", {}),
        ("draft", {"draft_model": "self-truncated:x"}),
        ("draft", {"draft_model": "self-truncated:0"}),
        ("draft", {"draft_model": f"self-truncated:{LAYERS + 1}"}),
        ("draft", {"draft_model": "self-truncated:2", "confidence": "high"}),
        ("draft", {"draft_model": 3}),
    ],
)
def test_invalid_options_raise_invalid_parameter(engine, method, options):
    with pytest.raises(InvalidParameter):
        generate(engine, "hi there", method, budget=3, **options)


def test_a_missing_draft_model_and_a_non_native_target_fail_with_one_clear_error(engine, tmp_path):
    with pytest.raises(DecodeKitError, match="not found"):
        generate(engine, "hi", "draft", draft_model=str(tmp_path / "nowhere"))
    with pytest.raises(InvalidParameter, match="target backend itself"):
        generate(engine, "hi", "draft", draft_model=engine.model.backend)
    hf = Engine(LoadedModel(HFBackend(tiny_hf_model(seed=1, num_layers=4)), CharTokenizer(96), "tiny-hf"))
    with pytest.raises(InvalidParameter, match="layerskip"):
        generate(hf, "hi there", "layerskip", budget=3)
    with pytest.raises(InvalidParameter, match="native backend"):
        generate(hf, "hi there", "draft", draft_model="self-truncated:2", budget=3)


# The embedded model -------------------------------------------------------------------------------


@pytest.mark.real_model
@pytest.mark.parametrize("method, options", [("layerskip", {}), ("draft", {"draft_model": "self-truncated:16"})])
def test_real_model_greedy_is_exact(real_model, method, options):
    engine = Engine(real_model)
    prompt = "Name three primary colours."
    reference = engine.generate(prompt, max_new_tokens=12).tokens
    got = engine.generate(prompt, method=method, max_new_tokens=12, budget=4, **options)
    assert got.tokens == reference


def test_a_draft_model_folder_is_loaded_once_and_each_target_drafts_with_its_own_cache(monkeypatch, tmp_path):
    """The draft model's weights are shared; its cache is per target (kept in the target's memory,
    the one home of per-model state), so two clones drafting at once never share a cache."""
    from decodekit.models import loading
    from decodekit.speculative.drafters import draft_model

    loads = []
    monkeypatch.setattr(loading, "build_backend", lambda folder, dtype: loads.append(folder) or tiny_llama(seed=3))
    monkeypatch.setattr(draft_model, "_loaded", {})
    target = tiny_llama(seed=0)
    twin = target.clone()
    mine, theirs = draft_model.draft_backend(str(tmp_path), target), draft_model.draft_backend(str(tmp_path), twin)
    assert mine is not theirs and draft_model.draft_backend(str(tmp_path), target) is mine
    assert len(loads) == 1 and mine.weights is theirs.weights


def test_a_draft_model_folder_spelt_two_ways_is_one_draft_model(monkeypatch, tmp_path):
    """A folder is known by its resolved path: ``m`` and ``m/../m`` are one draft model, loaded once
    and kept once in the target's memory (two entries would each hold weights and a cache, and
    crowd out the target's other kept draft model)."""
    from decodekit.models import loading
    from decodekit.speculative.drafters import draft_model

    loads = []
    monkeypatch.setattr(loading, "build_backend", lambda folder, dtype: loads.append(folder) or tiny_llama(seed=3))
    monkeypatch.setattr(draft_model, "_loaded", {})
    target = tiny_llama(seed=0)
    (tmp_path / "m").mkdir()
    first = draft_model.draft_backend(str(tmp_path / "m"), target)
    assert draft_model.draft_backend(str(tmp_path / "m" / ".." / "m"), target) is first
    assert len(loads) == 1


@pytest.mark.parametrize("method, options", [("draft", {"draft_model": "self-truncated:1"}), ("layerskip", {}),
                                             ("kvdraft", {})])
def test_a_chain_drafts_as_far_as_the_budget_says(method, options):
    """The chain drafters have no cap of their own: a fixed budget of 16 (under the loop's common
    max_draft) drafts 16 nodes a verification (they stopped at 6, their old default)."""
    engine = Engine(LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny"))
    g = engine.generate("abcabcabcabcabcabcabc", method=method, max_new_tokens=60, chat=False, budget=16,
                        confidence=0.0, **options)
    assert g.stats.extra["drafted"] == 16 * g.stats.extra["verifications"]


@pytest.mark.parametrize("method, options", [("draft", {"draft_model": "self-truncated:1"}), ("layerskip", {}),
                                             ("kvdraft", {})])
def test_a_chains_accepted_tokens_are_counted_under_its_drafters_name(method, options):
    """Each node of a chain names the drafter that proposed it: the accepted tokens are counted under
    that name (``accepted_by_source``; layer skipping's skip search counts its own accepted tokens by it)."""
    engine = Engine(LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny"))
    g = engine.generate("abcabcabcabcabcabcabc", method=method, max_new_tokens=40, chat=False, budget=4,
                        confidence=0.0, ignore_eos=True, **options)
    assert g.stats.extra["accepted"] > 0
    assert g.stats.extra["accepted_by_source"] == {method: g.stats.extra["accepted"]}


@pytest.mark.parametrize("method, options", [("draft", {"draft_model": "self-truncated:1"}), ("layerskip", {}),
                                             ("kvdraft", {})])
def test_a_max_draft_given_is_the_chains_cap_too(method, options):
    """The common ``max_draft`` a request gives caps the chains the controller sizes, past the chain
    drafters' own default cap of 6 (which it did not reach: they kept 6)."""
    from decodekit.engine import build_decoder

    assert build_decoder(method, **options).method.drafter.max_draft == 6
    assert build_decoder(method, max_draft=16, **options).method.drafter.max_draft == 16
    assert build_decoder(method, max_draft=3, **options).method.drafter.max_draft == 3


@pytest.mark.parametrize("method, options, cache", [
    ("draft", {"draft_model": "self-truncated:1"}, "int4:group=8,residual=64"),  # the draft shares the target's cache policy
    ("kvdraft", {"draft_cache": "h2o:budget=6,window=3"}, "full"),
])
def test_a_draft_cache_that_rolls_back_only_so_far_caps_its_chains(method, options, cache):
    """A chain drafted on a cache is rolled back past what the target did not accept: no longer
    than that cache can roll back (a longer one failed mid-generation), and still greedy's tokens."""
    backend = tiny_llama(seed=0, vocab_size=96, hidden_size=64, max_position=2048).with_kv_cache(cache)
    engine = Engine(LoadedModel(backend, CharTokenizer(96), "tiny"))
    prompt = ("hello world " * 30)[:300]
    greedy = engine.generate(prompt, max_new_tokens=120, chat=False)
    got = engine.generate(prompt, method=method, max_new_tokens=120, chat=False, budget=8, confidence=0.0, **options)
    assert got.tokens == greedy.tokens


@pytest.mark.parametrize("method, options", [("layerskip", {}), ("draft", {"draft_model": "self-truncated:1"})])
def test_no_draft_runs_for_tokens_the_request_would_throw_away(method, options):
    """max_new_tokens=1 is the prefill's token alone, as plain decoding's; a chain never drafts past
    the request's end (a verification adds one token more than it accepts)."""
    engine = Engine(LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny"))
    one = engine.generate("abcabcabcabc", method=method, max_new_tokens=1, chat=False, budget=6, confidence=0.0, **options)
    assert one.stats.forward_passes == 0 and one.stats.extra["drafted"] == 0 and len(one.tokens) == 1
    few = engine.generate("abcabcabcabc", method=method, max_new_tokens=4, chat=False, budget=16, confidence=0.0, **options)
    assert few.stats.extra["drafted"] <= 3 and len(few.tokens) == 4


def test_a_draft_model_decoding_a_request_of_its_own_keeps_its_answer():
    """A draft model given as a backend may be serving its own requests: the target drafts on a
    clone of it, so the draft model's own answer stays as if it had not been drafted from."""
    tok = CharTokenizer(96)
    draft = LoadedModel(tiny_llama(seed=5, num_layers=2, scale=2.0), tok, "draft")
    target = LoadedModel(tiny_llama(seed=4, num_layers=2, scale=2.0), tok, "target")
    prompt = "hello world " * 6
    alone = Engine(LoadedModel(draft.backend.clone(), tok, "draft")).generate(prompt, max_new_tokens=30, chat=False)
    drafted = []

    def on_text(delta):
        if not drafted:
            drafted.append(Engine(target).generate("zq", method="draft", draft_model=draft.backend, confidence=0.0,
                                                   max_new_tokens=8, chat=False))

    got = Engine(draft).generate(prompt, max_new_tokens=30, chat=False, on_text=on_text)
    assert drafted and got.tokens == alone.tokens


@pytest.mark.parametrize("method, options", [("layerskip", {}), ("draft", {"draft_model": "self-truncated:1"})])
def test_no_draft_runs_after_an_end_of_sequence_from_the_prompts_pass(method, options):
    """When the prefill's token ends the request (an end-of-sequence token), the step returns it
    with no pass more, as plain decoding does: nothing is drafted or verified."""
    backend = tiny_llama(seed=0)
    tokenizer = CharTokenizer(96)
    first = Engine(LoadedModel(backend, tokenizer, "tiny")).generate("abcabcabcabc", max_new_tokens=1, chat=False).tokens[0]
    tokenizer.eos_token_ids = frozenset({first})  # the model's first token now ends the text
    engine = Engine(LoadedModel(backend, tokenizer, "tiny"))
    got = engine.generate("abcabcabcabc", method=method, max_new_tokens=8, chat=False, budget=6, confidence=0.0, **options)
    assert got.tokens == [] and got.finish_reason == "eos"
    assert got.stats.forward_passes == 0 and got.stats.extra["drafted"] == 0


@pytest.mark.parametrize("method, options", [("layerskip", {}), ("draft", {"draft_model": "self-truncated:1"})])
def test_a_fixed_budget_of_zero_is_plain_decoding_for_a_chain_drafter(method, options):
    """``budget=0`` (a fixed budget of no nodes) rests speculation: every step a plain one, greedy's
    tokens, and a chain drafter made with it (its own cap is at least 1, as ``max_draft`` must be)."""
    engine = Engine(LoadedModel(tiny_llama(seed=0), CharTokenizer(96), "tiny"))
    plain = engine.generate("abcabcabcabc", max_new_tokens=10, chat=False)
    got = engine.generate("abcabcabcabc", method=method, max_new_tokens=10, chat=False, budget=0, **options)
    assert got.tokens == plain.tokens
    assert got.stats.extra["verifications"] == 0 and got.stats.extra["drafted"] == 0


def test_a_draft_model_of_a_shorter_context_drafts_only_within_it():
    """The draft model keeps its own cache: its chains fit its own context (not the target's), and
    once the text outgrows it the steps are plain ones, with greedy's tokens throughout."""
    engine = Engine(LoadedModel(tiny_llama(seed=1, num_layers=2, scale=2.0, max_position=256), CharTokenizer(96), "tiny"))
    short = tiny_llama(seed=1, num_layers=2, scale=2.0, max_position=24)
    prompt = "abcabcabcabcabcabc"  # 18 tokens: room for the draft model's first chains only
    plain = engine.generate(prompt, max_new_tokens=20, chat=False, ignore_eos=True)
    got = engine.generate(prompt, method="draft", draft_model=short, max_new_tokens=20, chat=False, ignore_eos=True,
                          budget=4, confidence=0.0)
    assert got.tokens == plain.tokens
    assert got.stats.extra["verifications"] > 0 and got.stats.extra["plain_steps"] > 0


def test_a_draft_model_whose_context_is_full_runs_no_pass_and_one_with_room_drafts():
    """The draft model's chain must fit its own context: tokens that fill it leave no room, so the
    draft is empty and the draft model runs no pass (none past its context); with room for one
    more token the draft model runs the context and drafts."""
    for length, drafts in ((8, False), (7, True)):
        target = tiny_llama(seed=1, num_layers=2, scale=2.0, max_position=64)
        state = pending_state(target, list(range(1, length)), 9)
        drafter = DraftModelDrafter(draft_model=tiny_llama(seed=1, num_layers=2, scale=2.0, max_position=8),
                                    confidence=0.0)
        drafter.begin(state)
        state.commit([9])
        calls: list[int] = []
        real_append = drafter.backend.append
        drafter.backend.append = lambda tokens, **kw: calls.append(tokens.shape[1]) or real_append(tokens, **kw)
        tree = drafter.draft(state, 4)
        assert drafter.backend.length <= 8, length
        if drafts:
            assert len(tree) >= 1 and calls[0] == length
        else:
            assert len(tree) == 0 and calls == [] and drafter.last_steps == 0


def test_the_layer_importance_probe_is_the_last_probe_tokens_of_the_context():
    """The block influence is measured on a probe of the *last* ``PROBE_TOKENS`` tokens (the module
    docstring), run after the cache and rolled back."""
    from decodekit.speculative.drafters.layerskip import PROBE_TOKENS

    seen = []

    class Probed:
        length = 0
        info = SimpleNamespace(num_layers=2, max_length=256)
        kv_policy = None

        def append(self, tokens, hidden_layers):
            seen.append(tokens[0].tolist())
            return SimpleNamespace(hidden=[torch.ones(1, tokens.shape[1], 2)] * 3)

        def truncate(self, length):
            self.length = length

    context = list(range(1, 2 * PROBE_TOKENS + 4))
    assert layer_importance(Probed(), context) is not None
    assert seen == [context[-PROBE_TOKENS:]]


def test_a_probe_that_exactly_fills_the_context_is_run():
    """The probe is refused only when it does not fit: a cache of ``max_length - len(probe)`` entries
    takes it exactly."""

    class Probed:
        length = 6
        info = SimpleNamespace(num_layers=2, max_length=8)
        kv_policy = None

        def append(self, tokens, hidden_layers):
            assert self.length + tokens.shape[1] <= self.info.max_length
            return SimpleNamespace(hidden=[torch.ones(1, tokens.shape[1], 2)] * 3)

        def truncate(self, length):
            self.length = length

    assert layer_importance(Probed(), [4, 5]) == pytest.approx([0.0, 0.0], abs=1e-6)
    assert layer_importance(Probed(), [3, 4, 5]) is None  # one token too many


def test_skip_trials_never_skip_the_first_or_the_last_layer():
    """Like the starting set, a trial's added layer is one of the layers 1 .. L-2: the first and last
    layers always run (the module docstring), whatever the fixed-seed choice."""
    for seed in range(10):
        search = SkipSearch(6, frozenset({2}), seed=seed)
        feed(search, 4, 5)  # per pass 0.8, score 5 / (5 * 5/6 + 1) < 1: a grow trial
        assert search.trial and len(search.current) == 2
        assert search.current <= {1, 2, 3, 4}, seed


def test_an_evenly_spread_skip_set_takes_the_middle_of_each_share():
    """Without an importance estimate the skipped layers are spread evenly over the layers 1 .. L-2:
    each in the middle of its equal share (of 1..10 in two shares, 1..5 and 6..10: layers 3 and 8)."""
    assert initial_skip_set(12, 2) == {3, 8}
    assert initial_skip_set(12, 1) == {6}  # the middle of 1..10, rounded down: index 5
