"""Tests for decodekit.samplers: each processor's defining rule on small hand-checkable logits,
the shared invariants, and the Sampler (greedy, seeding, sampling frequencies, validation)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from decodekit.errors import InvalidParameter
from decodekit.samplers import (
    SAMPLER_PARAMS,
    AdaptiveTopK,
    EpsilonCutoff,
    EtaCutoff,
    FrequencyPenalty,
    Histories,
    LogitsProcessor,
    MinP,
    NoRepeatNGram,
    PresencePenalty,
    RepetitionPenalty,
    Sampler,
    Temperature,
    TopH,
    TopK,
    TopNSigma,
    TopP,
    TypicalP,
)

NEG = float("-inf")


def logits_of(*probs: float) -> torch.Tensor:
    """A [1, V] logits row whose softmax is ``probs`` (up to float rounding)."""
    return torch.tensor([probs], dtype=torch.float64).log().float()


def kept(out: torch.Tensor, row: int = 0) -> set[int]:
    return set(torch.nonzero(torch.isfinite(out[row])).flatten().tolist())


def entropy(ps: list[float]) -> float:
    s = sum(ps)
    return -sum(p / s * math.log(p / s) for p in ps if p > 0)


class NoTouch:
    """A 'histories' object that fails on any use: processors that ignore history must not touch it."""

    def __getattr__(self, name):
        raise AssertionError(f"history was touched ({name})")

    def __len__(self):
        raise AssertionError("history was touched (len)")

    def __iter__(self):
        raise AssertionError("history was touched (iter)")

    def __getitem__(self, i):
        raise AssertionError("history was touched (getitem)")


TRUNCATION = [
    TopK(2), TopP(0.5), MinP(0.3), TypicalP(0.3), EpsilonCutoff(0.05), EtaCutoff(0.05),
    TopNSigma(0.5), TopH(0.5), AdaptiveTopK(0.1),
]
HISTORY_FREE = [Temperature(0.7), *TRUNCATION]
HISTORY = [RepetitionPenalty(1.5), RepetitionPenalty(1.5, 2), FrequencyPenalty(0.4),
           FrequencyPenalty(0.4, 3), PresencePenalty(0.6), PresencePenalty(0.6, 1), NoRepeatNGram(2)]
ALL = HISTORY_FREE + HISTORY


# ---------------------------------------------------------------- temperature


def test_temperature_divides_logits():
    out = Temperature(2.0)(torch.tensor([[2.0, 4.0, -6.0, NEG]]), NoTouch())
    assert out.tolist() == [[1.0, 2.0, -3.0, NEG]]


@pytest.mark.parametrize("temperature", [1e-37, 1e-38, 1e-45])
def test_a_temperature_near_0_keeps_the_most_likely_tokens_evenly(temperature):
    """logits / T past float32's range (or T below its normal numbers, which flush to 0): the
    distribution is still softmax(l / T)'s, whose limit keeps the largest logits, ties evenly."""
    logits = torch.tensor([[50.0, 80.0, 80.0, -3.0, NEG], [1.0, 0.5, 2.0, 2.0 - 2**-22, NEG]])
    probs = torch.softmax(Temperature(temperature)(logits, NoTouch()), dim=-1)
    assert probs.tolist() == [[0.0, 0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]]
    negative = torch.tensor([[-50.0, -60.0, -50.0, -70.0, NEG]])  # past the range downwards, alone
    assert torch.softmax(Temperature(temperature)(negative, NoTouch()), dim=-1).tolist() == [[0.5, 0.0, 0.5, 0.0, 0.0]]
    assert torch.isinf(Temperature(temperature)(torch.tensor([[float("inf"), 1.0]]), NoTouch())[0, 0])  # left as it is


def test_a_rows_scaled_logits_do_not_depend_on_a_row_beside_it_that_overflowed():
    """The shift that keeps an overflowing row in range applies to that row alone: a batch's other
    rows (a verification's, a served batch's) keep the bits they get by themselves."""
    calm = torch.tensor([[0.1, 0.2, -0.3, 0.05]])
    together = torch.cat([calm, torch.tensor([[50.0, 80.0, -3.0, 1.0]])])
    temperature = Temperature(1e-37)
    assert torch.equal(temperature(together, NoTouch())[:1], temperature(calm, NoTouch()))


def test_a_temperature_past_float32s_range_makes_every_allowed_token_equally_likely():
    probs = torch.softmax(Temperature(1e39)(torch.tensor([[1.0, NEG, 2.0, -30.0]]), NoTouch()), dim=-1)
    assert probs[0].tolist() == pytest.approx([1 / 3, 0.0, 1 / 3, 1 / 3])  # not NaN: the masked token stays masked


# ---------------------------------------------------------------- top-k


def test_top_k_keeps_k_largest():
    x = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    assert kept(TopK(2)(x, [])) == {1, 3}
    assert kept(TopK(1)(x, [])) == {1}
    assert kept(TopK(10)(x, [])) == {0, 1, 2, 3, 4}  # k > V keeps everything


def test_top_k_keeps_ties_at_the_boundary():
    x = torch.tensor([[3.0, 1.0, 3.0, 2.0]])
    assert kept(TopK(1)(x, [])) == {0, 2}


# ---------------------------------------------------------------- top-p


def test_top_p_stops_when_the_mass_before_a_token_reaches_p_exactly():
    """0.5 / 0.25 / 0.25 with p = 0.5: the first token alone reaches p (the mass before the second
    is exactly 0.5, not below it), so one token is kept."""
    x = torch.tensor([[math.log(2.0), 0.0, 0.0]])
    assert torch.softmax(x, -1).tolist() == [[0.5, 0.25, 0.25]]  # exact in float32
    assert kept(TopP(0.5)(x, [])) == {0}


def test_top_p_keeps_smallest_set_reaching_p():
    x = logits_of(0.1, 0.4, 0.2, 0.3)
    assert kept(TopP(0.3)(x, [])) == {1}          # 0.4 >= 0.3
    assert kept(TopP(0.65)(x, [])) == {1, 3}      # 0.4 + 0.3 = 0.7 >= 0.65, 0.4 alone < 0.65
    assert kept(TopP(0.75)(x, [])) == {1, 3, 2}   # 0.9
    assert kept(TopP(1.0)(x, [])) == {0, 1, 2, 3}


def test_top_p_minimality_on_random_rows():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 200, generator=g) * 2
    p = 0.8
    out = TopP(p)(x, [])
    probs = torch.softmax(x.double(), -1)
    for r in range(16):
        keep = torch.isfinite(out[r])
        mass = probs[r][keep].sum().item()
        smallest = probs[r][keep].min().item()
        assert mass >= p
        assert mass - smallest < p  # dropping the least probable kept token falls below p
        # it is a top set: everything kept is at least as probable as everything dropped
        assert probs[r][keep].min() >= probs[r][~keep].max()



def test_top_p_sums_the_mass_exactly_on_a_large_vocabulary():
    """The nucleus is the smallest top set whose mass reaches p, however large the vocabulary: with p
    a hair (1e-12) above the mass of the k most probable tokens, token k is still needed and no more.
    A float32 running sum (or p rounded to float32) is off by ~1e-8 near mass 0.9, more than that hair."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 100_000, generator=g) * 1.5
    probs = torch.softmax(x, -1)[0]
    sp = torch.sort(probs, descending=True, stable=True).values.double()
    before = torch.cumsum(sp, 0) - sp  # exact enough: float64 sums of float32 values
    for k in torch.searchsorted(before, torch.linspace(0.5, 0.95, 12, dtype=torch.float64)).tolist():
        out = TopP(before[k].item() + 1e-12)(x, [])
        assert torch.equal(torch.isfinite(out[0]), probs >= sp[k].float()), k

def test_top_p_keeps_tied_tokens_together():
    x = logits_of(0.5, 0.25, 0.25)
    assert kept(TopP(0.6)(x, [])) == {0, 1, 2}


# ---------------------------------------------------------------- min-p


def test_min_p_threshold_is_relative_to_top_probability():
    x = logits_of(0.5, 0.2, 0.14, 0.1, 0.06)
    assert kept(MinP(0.3)(x, [])) == {0, 1}           # threshold 0.15
    assert kept(MinP(0.25)(x, [])) == {0, 1, 2}       # threshold 0.125
    assert kept(MinP(0.0)(x, [])) == {0, 1, 2, 3, 4}
    assert kept(MinP(1.0)(x, [])) == {0}


def test_min_p_keeps_a_token_exactly_at_the_threshold():
    """The rule is p >= min_p * p_max: a token whose probability equals the threshold stays."""
    x = logits_of(0.5, 0.25, 0.125, 0.125)
    assert torch.softmax(x, -1).tolist() == [[0.5, 0.25, 0.125, 0.125]]  # exact in float32
    assert kept(MinP(0.5)(x, [])) == {0, 1}         # threshold 0.25 = p of token 1
    assert kept(MinP(0.25)(x, [])) == {0, 1, 2, 3}  # threshold 0.125 = p of tokens 2 and 3


def test_min_p_matches_rule_on_random_rows():
    x = torch.randn(8, 300, generator=torch.Generator().manual_seed(1)) * 3
    out = MinP(0.1)(x, [])
    probs = torch.softmax(x, -1)
    expect = probs >= 0.1 * probs.max(-1, keepdim=True).values
    assert torch.equal(torch.isfinite(out), expect)
    assert torch.equal(out[expect], x[expect])  # kept logits are unchanged


# ---------------------------------------------------------------- typical


def test_typical_keeps_tokens_closest_to_the_entropy():
    ps = [0.45, 0.25, 0.18, 0.12]
    h = entropy(ps)
    dist = [abs(-math.log(p) - h) for p in ps]
    # hand check of the ranking by |surprisal - H|: 0.25, then 0.18, then 0.45, then 0.12
    assert sorted(range(4), key=lambda i: dist[i]) == [1, 2, 0, 3]
    x = logits_of(*ps)
    paper = lambda tau: kept(TypicalP(tau, keep_argmax=False)(x, []))  # noqa: E731
    assert paper(0.2) == {1}              # 0.25 >= 0.2
    assert paper(0.4) == {1, 2}           # 0.25 + 0.18 = 0.43 >= 0.4, the mode is not typical
    assert paper(0.9) == {0, 1, 2, 3}     # 0.88 < 0.9 so the last one is needed too
    # library default: the typical set plus the argmax
    assert kept(TypicalP(0.2)(x, [])) == {0, 1}
    assert kept(TypicalP(0.4)(x, [])) == {0, 1, 2}


def test_typical_stops_when_the_mass_before_a_token_reaches_tau_exactly():
    """Meister et al.'s set is the smallest prefix of the typicality ranking with mass >= tau: for
    0.5 / 0.25 / 0.125 / 0.125 (H = 1.75 ln 2, distances 0.75, 0.25, 1.25, 1.25 ln 2) the 0.25
    token alone reaches tau = 0.25, so the next one (the mode) is not needed."""
    x = torch.tensor([[math.log(2.0), 0.0, -math.log(2.0), -math.log(2.0)]])
    assert torch.log_softmax(x, -1).exp().tolist() == [[0.5, 0.25, 0.125, 0.125]]  # exact in float32
    assert kept(TypicalP(0.25, keep_argmax=False)(x, [])) == {1}
    assert kept(TypicalP(0.75, keep_argmax=False)(x, [])) == {0, 1}  # 0.25 + 0.5 reaches 0.75


def test_typical_set_is_a_mass_minimal_ball_around_entropy():
    x = torch.randn(6, 100, generator=torch.Generator().manual_seed(5)) * 2
    tau = 0.7
    out = TypicalP(tau, keep_argmax=False)(x, [])
    logp = torch.log_softmax(x.double(), -1)
    p = logp.exp()
    h = -(p * logp).sum(-1, keepdim=True)
    dist = (-logp - h).abs()
    for r in range(6):
        keep = torch.isfinite(out[r])
        assert dist[r][keep].max() < dist[r][~keep].min()  # kept = the closest tokens
        far = dist[r][keep].argmax()
        mass = p[r][keep].sum().item()
        assert mass >= tau and mass - p[r][keep][far].item() < tau


# ---------------------------------------------------------------- epsilon / eta


def test_epsilon_drops_tokens_below_epsilon():
    x = logits_of(0.6, 0.3, 0.0995, 0.0005)
    assert kept(EpsilonCutoff(0.001)(x, [])) == {0, 1, 2}
    assert kept(EpsilonCutoff(0.2)(x, [])) == {0, 1}
    assert kept(EpsilonCutoff(0.9)(x, [])) == {0}  # nothing reaches 0.9: the argmax stays


def test_epsilon_keeps_a_token_exactly_at_epsilon():
    """Hewitt et al.'s rule keeps p >= epsilon: a probability equal to epsilon is kept."""
    x = logits_of(0.5, 0.25, 0.125, 0.125)
    assert torch.softmax(x, -1).tolist() == [[0.5, 0.25, 0.125, 0.125]]  # exact in float32
    assert kept(EpsilonCutoff(0.25)(x, [])) == {0, 1}
    assert kept(EpsilonCutoff(0.125)(x, [])) == {0, 1, 2, 3}


def test_a_cutoff_that_drops_everything_keeps_every_token_tied_for_the_top():
    """Which of several equally likely tokens is kept must not depend on token ids (HF's warpers
    keep them all too)."""
    assert kept(EpsilonCutoff(0.5)(torch.zeros(1, 4), [])) == {0, 1, 2, 3}
    assert kept(EpsilonCutoff(0.6)(torch.tensor([[-9.0, 0.0, -9.0, 0.0]]), [])) == {1, 3}
    assert kept(EtaCutoff(0.9)(torch.tensor([[0.0, -9.0, 0.0]]), [])) == {0, 2}


def test_eta_uses_entropy_scaled_threshold_when_entropy_is_high():
    ps = [0.2, 0.1, 0.1, 0.08, 0.08, 0.08, 0.06, 0.06, 0.05, 0.05, 0.04, 0.04, 0.03, 0.02,
          0.005, 0.003, 0.002]
    eta = 0.05
    thr = min(eta, math.sqrt(eta) * math.exp(-entropy(ps)))
    assert 0.017 < thr < 0.019  # hand value: sqrt(0.05) * exp(-2.523) = 0.01794, below eta
    out = EtaCutoff(eta)(logits_of(*ps), [])
    assert kept(out) == {i for i, p in enumerate(ps) if p >= thr}
    assert {11, 12, 13} <= kept(out)  # 0.04, 0.03, 0.02: below eta but above the eta threshold
    assert kept(out).isdisjoint({14, 15, 16})


def test_eta_uses_eta_when_entropy_is_low():
    ps = [0.9, 0.05, 0.03, 0.015, 0.005]
    eta = 0.02
    assert math.sqrt(eta) * math.exp(-entropy(ps)) > eta  # 0.091: eta is the binding term
    assert kept(EtaCutoff(eta)(logits_of(*ps), [])) == {0, 1, 2}



def test_eta_matches_the_papers_threshold_on_random_rows():
    """Hewitt et al.'s eta cutoff: keep p >= min(eta, sqrt(eta) * exp(-H)), H the entropy in nats of
    the distribution the processor receives (removed tokens have p = 0), and the argmax. Checked
    against that rule, written out, on rows of low and high entropy, some with removed tokens."""
    g = torch.Generator().manual_seed(5)
    for scale in (0.5, 1.0, 2.0, 4.0):
        x = torch.randn(6, 60, generator=g) * scale
        x[3:, ::4] = NEG  # half the rows come with removed tokens
        probs = torch.softmax(x.double(), -1)
        for eta in (0.001, 0.01, 0.05, 0.2):
            out = EtaCutoff(eta)(x, [])
            for r in range(6):
                ps = probs[r].tolist()
                thr = min(eta, math.sqrt(eta) * math.exp(-entropy(ps)))
                want = {i for i, p in enumerate(ps) if p >= thr} | {max(range(60), key=ps.__getitem__)}
                close = {i for i, p in enumerate(ps) if abs(p - thr) <= 1e-5 * thr}  # float32 rounding
                assert kept(out, r) - close == want - close, (scale, eta, r)


@pytest.mark.parametrize("proc", [EtaCutoff(0.05), EtaCutoff(0.3), TypicalP(0.5), TypicalP(0.9)], ids=repr)
def test_entropy_based_cutoffs_ignore_removed_tokens(proc):
    """A token already at -inf has probability 0 and adds 0 (0·log 0) to the entropy: padding a row
    with removed tokens leaves the kept set as it was (not NaN, which would keep the argmax alone)."""
    g = torch.Generator().manual_seed(6)
    clean = torch.randn(4, 30, generator=g) * 1.5
    padded = torch.cat([clean, torch.full((4, 10), NEG)], dim=-1)
    out = proc(padded, [])
    assert torch.isneginf(out[:, 30:]).all()
    for r in range(4):
        assert kept(out, r) == kept(proc(clean, []), r)
        assert len(kept(out, r)) > 1

# ---------------------------------------------------------------- top-n-sigma


def test_top_n_sigma_keeps_logits_within_n_sigma_of_max():
    x = torch.tensor([[4.0, 3.0, 1.0, 0.0, -2.0]])
    sigma = math.sqrt(22.8 / 5)  # mean 1.2, population variance 4.56
    assert abs(sigma - 2.1354) < 1e-4
    assert kept(TopNSigma(1.0)(x, [])) == {0, 1}       # cutoff 4 - 2.135 = 1.865
    assert kept(TopNSigma(1.5)(x, [])) == {0, 1, 2}    # cutoff 4 - 3.203 = 0.797
    assert kept(TopNSigma(0.1)(x, [])) == {0}
    # the population σ, not the sample σ sqrt(22.8 / 4) = 2.3875 (whose cutoff 0.896 would keep logit 1)
    assert kept(TopNSigma(1.3)(x, [])) == {0, 1}       # cutoff 4 - 2.776 = 1.224


def test_top_n_sigma_ignores_removed_tokens_in_sigma():
    x = torch.tensor([[4.0, 3.0, 1.0, 0.0, -2.0, NEG, NEG]])
    assert kept(TopNSigma(1.5)(x, [])) == {0, 1, 2}
    # the mean too is over the 5 finite logits: 1.2, not 6 / 25 = 0.24 over the row of 25, whose
    # σ (2.34) would give the cutoff 4 - 1.3 * 2.34 = 0.96 and keep logit 1 (see the test above)
    clean = torch.tensor([[4.0, 3.0, 1.0, 0.0, -2.0]])
    padded = torch.cat([clean, torch.full((1, 20), NEG)], dim=-1)
    for n in (0.5, 1.0, 1.3, 1.5, 2.0):
        assert kept(TopNSigma(n)(padded, [])) == kept(TopNSigma(n)(clean, [])), n
    assert kept(TopNSigma(1.3)(padded, [])) == {0, 1}



def test_top_n_sigma_keeps_a_logit_exactly_n_sigma_below_the_max():
    """Tang et al. keep logits >= max - n·σ: a logit on the cutoff itself is kept."""
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0]])  # mean 0, population σ 1: exact in float32
    assert kept(TopNSigma(2.0)(x, [])) == {0, 1, 2, 3}  # cutoff 1 - 2·1 = -1, the logit of 1 and 3
    assert kept(TopNSigma(1.999)(x, [])) == {0, 2}

# ---------------------------------------------------------------- top-H


def top_h_reference(probs: list[float], alpha: float) -> set[int]:
    """The authors' stopping rule, transcribed as a loop: walk tokens by descending probability
    (ties by id), add -p log p, stop before the token whose term takes the sum past alpha * H(p)."""
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    tau = alpha * -sum(p * math.log(p) for p in probs if p > 0)
    keep, total = [order[0]], -probs[order[0]] * math.log(probs[order[0]])
    for i in order[1:]:
        if probs[i] == 0:
            break
        total -= probs[i] * math.log(probs[i])
        if total > tau * (1 + 1e-9):
            break
        keep.append(i)
    return set(keep)


def test_top_h_bound_holds_and_next_token_breaks_it():
    ps = [0.5, 0.3, 0.15, 0.05]
    terms = [-p * math.log(p) for p in ps]
    partial = [sum(terms[:k]) for k in range(1, 5)]  # 0.347, 0.708, 0.992, 1.142 = H(p)
    for alpha, k in [(0.5, 1), (0.6, 1), (0.7, 2), (0.9, 3), (1.0, 4)]:
        out = TopH(alpha)(logits_of(*ps), [])
        assert kept(out) == set(range(k))
        assert partial[k - 1] <= alpha * partial[-1] + 1e-12
        if k < 4:
            assert partial[k] > alpha * partial[-1]


def test_top_h_uniform_keeps_alpha_n_tokens():
    # the unnormalised sum reaches alpha * log(100) after 50 of 100 equal tokens; a rule on the
    # renormalised entropy (log k <= alpha * log 100) would keep only 10
    x = torch.zeros(1, 100)
    assert kept(TopH(0.5)(x, [])) == set(range(50))  # ties by token id, lower first (a stable sort)
    assert kept(TopH(0.3)(x, [])) == set(range(30))



def test_top_h_uniform_keeps_alpha_n_tokens_for_every_alpha():
    """The docstring's promise, alpha · n of n equal tokens, for alpha = k / n over a row of 1000:
    the sum of k equal terms equals the bound in exact arithmetic, which float32 running sums (a
    relative error near 1e-7, past the rule's 1e-9 slack) would miss by a token either way."""
    n = 1000
    x = torch.zeros(1, n)
    for k in range(1, n, 5):
        assert torch.isfinite(TopH(k / n)(x, [])).sum().item() == k, k

def test_top_h_matches_reference_rule_on_random_rows():
    g = torch.Generator().manual_seed(7)
    for _ in range(200):
        vocab = int(torch.randint(2, 300, (1,), generator=g))
        x = torch.randn(1, vocab, generator=g) * float(0.3 + 4 * torch.rand(1, generator=g))
        alpha = float(torch.rand(1, generator=g).clamp(min=0.01))
        probs = torch.softmax(x, -1)[0].tolist()
        assert kept(TopH(alpha)(x, [])) == top_h_reference(probs, alpha)


def test_top_h_after_top_k_100_is_hugging_face_warper():
    warper = pytest.importorskip("transformers.generation.logits_process").TopHLogitsWarper
    g = torch.Generator().manual_seed(11)
    for _ in range(200):
        vocab = int(torch.randint(2, 400, (1,), generator=g))
        x = torch.randn(2, vocab, generator=g) * float(0.3 + 4 * torch.rand(1, generator=g))
        alpha = float(torch.rand(1, generator=g).clamp(min=0.01))
        ours = torch.isfinite(TopH(alpha)(TopK(100)(x, []), []))
        assert torch.equal(ours, torch.isfinite(warper(alpha)(None, x)))


def test_top_h_never_keeps_a_token_of_probability_0():
    """Its entropy term is 0, so with alpha = 1 the sum alone would not stop before it (the docstring's
    promise): logit -200 has probability exp(-200) = 0 in float32."""
    x = torch.tensor([[0.0, 0.0, -200.0, -200.0]])
    assert torch.softmax(x, -1)[0, 2:].tolist() == [0.0, 0.0]
    assert kept(TopH(1.0)(x, [])) == {0, 1}


def test_top_h_breaks_ties_by_token_id():
    # two equal tokens: keeping both would exceed the bound (H = log 2 > alpha * H(p))
    x = logits_of(0.3, 0.3, 0.2, 0.2)
    assert kept(TopH(0.3)(x, [])) == {0}


# ---------------------------------------------------------------- adaptive top-k


def test_adaptive_k_stopping_rule_by_hand():
    x = logits_of(0.5, 0.3, 0.15, 0.05)
    # log(1 + p_(k+1)/S_k): k=1 0.470, k=2 0.172, k=3 0.051
    for lam, k in [(0.5, 1), (0.2, 2), (0.1, 3), (0.01, 4)]:
        assert kept(AdaptiveTopK(lam)(x, [])) == set(range(k))


def test_adaptive_k_minimises_the_kl_l0_objective():
    g = torch.Generator().manual_seed(11)
    for lam in (0.02, 0.1, 0.3):
        x = torch.randn(5, 60, generator=g) * 2
        out = AdaptiveTopK(lam)(x, [])
        sp = torch.sort(torch.softmax(x.double(), -1), -1, descending=True).values
        cost = -torch.log(torch.cumsum(sp, -1)) + lam * torch.arange(1, 61, dtype=torch.float64)
        best = cost.argmin(-1) + 1
        assert torch.isfinite(out).sum(-1).tolist() == best.tolist()



def test_adaptive_k_stops_where_the_increment_equals_lambda():
    """The optimum is the smallest k with log(1 + p_(k+1) / S_k) <= λ: where the increment is exactly
    λ, cost(k + 1) == cost(k) and the smaller k is the one kept; a λ a hair below it takes k + 1."""
    x = logits_of(0.5, 0.3, 0.15, 0.05)
    p = torch.sort(torch.softmax(x, -1), dim=-1, descending=True, stable=True).values.double()
    nxt = torch.cat([p[..., 1:], torch.zeros_like(p[..., :1])], dim=-1)
    increments = torch.log1p(nxt / torch.cumsum(p, -1))[0].tolist()  # 0.470, 0.172, 0.051, 0
    for k in (1, 2, 3):
        lam = increments[k - 1]
        assert kept(AdaptiveTopK(lam)(x, [])) == set(range(k)), k
        assert kept(AdaptiveTopK(math.nextafter(lam, 0.0))(x, [])) == set(range(k + 1)), k

# ---------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_multiplies_negative():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = RepetitionPenalty(2.0)(x, [torch.tensor([0, 1, 1])])
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0]]


def test_repetition_penalty_window_counts_only_recent_tokens():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = RepetitionPenalty(2.0, window=2)(x, [torch.tensor([3, 1, 2])])
    assert out.tolist() == [[2.0, -2.0, 0.25, 3.0]]


def test_frequency_penalty_scales_with_count():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = FrequencyPenalty(0.5)(x, [torch.tensor([0, 1, 1])])
    assert out.tolist() == [[1.5, -2.0, 0.5, 3.0]]
    out = FrequencyPenalty(0.5, window=2)(x, [torch.tensor([0, 1, 1])])
    assert out.tolist() == [[2.0, -2.0, 0.5, 3.0]]


def test_presence_penalty_is_once_per_token():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = PresencePenalty(0.5)(x, [torch.tensor([0, 1, 1, 1])])
    assert out.tolist() == [[1.5, -1.5, 0.5, 3.0]]
    out = PresencePenalty(0.5, window=1)(x, [torch.tensor([0, 1, 1, 3])])
    assert out.tolist() == [[2.0, -1.0, 0.5, 2.5]]


def test_penalties_with_ragged_histories():
    x = torch.zeros(3, 5)
    hist = [torch.tensor([4, 4, 2]), torch.tensor([], dtype=torch.long), torch.tensor([1])]
    out = FrequencyPenalty(1.0)(x, hist)
    assert out.tolist() == [[0, 0, -1, 0, -2], [0, 0, 0, 0, 0], [0, -1, 0, 0, 0]]


def test_frequency_and_presence_count_generated_ids_only_repetition_counts_the_prompt():
    # the prompt holds token 3 four times, the generated ids (1, 0) never: OpenAI's frequency and
    # presence penalties leave 3 alone, CTRL's repetition penalty does not
    x = torch.tensor([[2.0, 1.0, 0.5, 3.0]])
    hist = Histories([[3, 3, 3, 3, 1, 0]], prompt_len=4)
    assert FrequencyPenalty(0.5)(x, hist).tolist() == [[1.5, 0.5, 0.5, 3.0]]
    assert PresencePenalty(0.5)(x, hist).tolist() == [[1.5, 0.5, 0.5, 3.0]]
    assert RepetitionPenalty(2.0)(x, hist).tolist() == [[1.0, 0.5, 0.5, 1.5]]
    assert FrequencyPenalty(0.5, window=1)(x, hist).tolist() == [[1.5, 1.0, 0.5, 3.0]]  # window: generated ids
    # one prompt length per row; a plain list of tensors has no prompt, so everything counts
    both = Histories([[3, 3, 1], [3, 3, 1]], prompt_len=[3, 1])
    assert FrequencyPenalty(1.0)(x.repeat(2, 1), both).tolist() == [[2.0, 1.0, 0.5, 3.0], [2.0, 0.0, 0.5, 2.0]]
    assert FrequencyPenalty(1.0)(x, [torch.tensor([3, 3, 1])]).tolist() == [[2.0, 0.0, 0.5, 1.0]]
    sampler = Sampler.from_params(frequency_penalty=2.0, presence_penalty=2.0, temperature=0)
    assert sampler.pick(x, hist).item() == 3 and sampler.pick(x, [torch.tensor([3, 3, 3, 3, 1, 0])]).item() == 2


@pytest.mark.parametrize("make, name", [
    (lambda: RepetitionPenalty(0.0), "repetition_penalty"),
    (lambda: FrequencyPenalty(float("nan")), "frequency_penalty"),
    (lambda: PresencePenalty(float("inf")), "presence_penalty"),
    (lambda: RepetitionPenalty(1.5, window=0), "penalty_window"),
    (lambda: FrequencyPenalty(0.5, window=-2), "penalty_window"),
], ids=["repetition-0", "frequency-nan", "presence-inf", "window-0", "window-negative"])
def test_penalty_processors_check_their_values_when_built_directly(make, name):
    """A processor built without ``Sampler.from_params`` checks its own values: a window of 0 would count everything."""
    with pytest.raises(InvalidParameter, match=rf"^{name} must be"):
        make()


@pytest.mark.parametrize("rows", [[[4], []], [[], [-1]]], ids=["id-equal-to-vocab", "negative-id"])
def test_penalties_refuse_history_ids_outside_the_vocabulary(rows):
    """An id outside [0, V) names no logit: counted, it would land on another row's token."""
    hist = [torch.tensor(r, dtype=torch.long) for r in rows]
    for proc in (FrequencyPenalty(1.0), PresencePenalty(1.0), RepetitionPenalty(2.0)):
        with pytest.raises(ValueError, match=r"history token ids must be in \[0, 4\)"):
            proc(torch.zeros(2, 4), hist)



def test_penalties_refuse_more_histories_than_rows():
    """One history per row: a third history for two rows is an error (its ids would be counted into
    a row that does not exist), whether the processor is called alone or through a Sampler."""
    hist = [torch.tensor([1]), torch.tensor([2]), torch.tensor([3])]
    for proc in (FrequencyPenalty(1.0), PresencePenalty(1.0), RepetitionPenalty(2.0)):
        with pytest.raises(ValueError, match="expected 2 histories"):
            proc(torch.zeros(2, 4), hist)

# ---------------------------------------------------------------- no-repeat-n-gram


def test_no_repeat_ngram_bans_exactly_the_completing_token():
    x = torch.zeros(1, 10)
    out = NoRepeatNGram(3)(x, [torch.tensor([5, 6, 7, 5, 6])])
    assert kept(out) == set(range(10)) - {7}
    out = NoRepeatNGram(3)(x, [torch.tensor([1, 2, 3, 1, 2, 4, 9, 1, 2])])
    assert kept(out) == set(range(10)) - {3, 4}
    out = NoRepeatNGram(2)(x, [torch.tensor([3, 4, 5])])  # last id 5 never seen before
    assert kept(out) == set(range(10))


def test_no_repeat_ngram_short_history_and_unigrams():
    x = torch.zeros(2, 6)
    assert kept(NoRepeatNGram(3)(x, [torch.tensor([1, 2]), torch.tensor([1])]), 0) == set(range(6))
    out = NoRepeatNGram(1)(x, [torch.tensor([1, 2, 2]), torch.tensor([], dtype=torch.long)])
    assert kept(out, 0) == {0, 3, 4, 5} and kept(out, 1) == set(range(6))


def test_no_repeat_ngram_bans_the_argmax_and_never_empties_a_row():
    x = torch.tensor([[5.0, 1.0, 0.0], [5.0, 1.0, NEG]])
    out = NoRepeatNGram(1)(x, [torch.tensor([0]), torch.tensor([0, 1])])
    assert kept(out, 0) == {1, 2}                    # the argmax is banned: that is the point
    assert out[1].tolist() == [5.0, 1.0, NEG]        # banning 0 and 1 would empty it: unchanged


def test_no_repeat_ngram_needs_the_whole_prefix_to_match():
    """Paulus et al.'s rule bans a token only after the same n-1 ids: a match of the last id alone bans nothing."""
    x = torch.zeros(1, 10)
    out = NoRepeatNGram(3)(x, [torch.tensor([1, 2, 3, 4, 2])])  # (4, 2) never came before; (1, 2) did
    assert kept(out) == set(range(10))
    out = NoRepeatNGram(3)(x, [torch.tensor([1, 2, 3, 1, 2])])  # (1, 2) again: 3 would repeat (1, 2, 3)
    assert kept(out) == set(range(10)) - {3}



def test_no_repeat_ngram_counts_the_prompt():
    """The whole history counts, prompt included (Paulus et al.; Hugging Face's processor sees the
    prompt's ids too), unlike the frequency and presence penalties: an n-gram of the prompt is not
    repeated either."""
    x = torch.zeros(1, 10)
    hist = Histories([[5, 6, 7, 1, 5, 6]], prompt_len=4)  # (5, 6, 7) is in the prompt only
    assert kept(NoRepeatNGram(3)(x, hist)) == set(range(10)) - {7}
    assert kept(NoRepeatNGram(1)(x, hist)) == set(range(10)) - {1, 5, 6, 7}
    sampler = Sampler.from_params(no_repeat_ngram_size=3, temperature=0)
    assert sampler.pick(logits_of(0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.3), hist).item() != 7


def test_no_repeat_ngram_matches_hugging_face_with_a_prompt():
    """Against transformers' NoRepeatNGramLogitsProcessor, which is given prompt and generated ids as
    one sequence: the same bans, whatever part of the history is the prompt."""
    hf = pytest.importorskip("transformers.generation.logits_process").NoRepeatNGramLogitsProcessor
    g = torch.Generator().manual_seed(8)
    for n in (1, 2, 3):
        ids = torch.randint(0, 6, (4, 14), generator=g)
        x = torch.randn(4, 6, generator=g)
        ours = NoRepeatNGram(n)(x, Histories(list(ids), prompt_len=[0, 5, 9, 14]))
        theirs = hf(n)(ids, x.clone())
        emptied = torch.isneginf(theirs).all(-1)  # we leave such a row unchanged instead
        assert torch.equal(torch.isfinite(ours[~emptied]), torch.isfinite(theirs[~emptied])), n

# ---------------------------------------------------------------- shared invariants


def _history(batch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 12, (3 + 2 * b,), generator=g) for b in range(batch)]


@pytest.mark.parametrize("proc", ALL, ids=repr)
def test_rows_are_processed_independently(proc):
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(9)) * 2
    hist = _history(4)
    together = proc(x, hist)
    for r in range(4):
        alone = proc(x[r:r + 1], hist[r:r + 1])
        assert torch.equal(together[r:r + 1], alone)


@pytest.mark.parametrize("proc", ALL, ids=repr)
def test_input_is_not_modified(proc):
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(4))
    x[0, 5] = NEG
    before = x.clone()
    hist = _history(3)
    hist_before = [h.clone() for h in hist]
    out = proc(x, hist)
    assert torch.equal(x, before)
    assert all(torch.equal(a, b) for a, b in zip(hist, hist_before))
    assert out.data_ptr() != x.data_ptr() and out.dtype == torch.float32 and out.shape == x.shape


@pytest.mark.parametrize("proc", HISTORY_FREE, ids=repr)
def test_history_free_processors_do_not_touch_history(proc):
    assert proc.needs_history is False
    proc(torch.randn(2, 12), NoTouch())


@pytest.mark.parametrize("proc", HISTORY, ids=repr)
def test_history_processors_declare_it(proc):
    assert proc.needs_history is True


@pytest.mark.parametrize(
    "proc",
    [TopK(1), TopP(1e-6), MinP(1.0), TypicalP(1e-6), EpsilonCutoff(0.999), EtaCutoff(0.999),
     TopNSigma(1e-6), TopH(1e-6), AdaptiveTopK(100.0), *TRUNCATION],
    ids=repr,
)
def test_argmax_always_kept(proc):
    x = torch.randn(20, 50, generator=torch.Generator().manual_seed(6)) * 3
    x[:, 7] = NEG  # some tokens already removed upstream
    out = proc(x, [])
    assert torch.equal(out.argmax(-1), x.argmax(-1))
    assert torch.isfinite(out.gather(-1, x.argmax(-1, keepdim=True))).all()
    assert not torch.isfinite(out[:, 7]).any()
    assert torch.all(torch.isfinite(out) <= torch.isfinite(x))  # truncation only removes
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], x[finite])  # and leaves kept logits untouched


# ---------------------------------------------------------------- Sampler


def test_public_names_and_params():
    assert tuple(inspect.signature(Sampler.from_params).parameters) == SAMPLER_PARAMS
    assert issubclass(TopP, LogitsProcessor)


def test_from_params_orders_processors_and_skips_no_ops():
    s = Sampler.from_params(
        adaptive_k=0.1, top_h=0.5, eta=0.01, epsilon=0.01, typical_p=0.9, min_p=0.05, top_p=0.9,
        top_k=40, top_n_sigma=1.0, temperature=0.7, no_repeat_ngram_size=3, presence_penalty=0.1,
        frequency_penalty=0.1, repetition_penalty=1.1, penalty_window=32, seed=0,
    )
    assert s.describe()["processors"] == [
        "RepetitionPenalty", "FrequencyPenalty", "PresencePenalty", "NoRepeatNGram", "Temperature",
        "TopNSigma", "TopK", "TopP", "MinP", "TypicalP", "EpsilonCutoff", "EtaCutoff", "TopH",
        "AdaptiveTopK",
    ]
    d = s.describe()
    assert d["penalty_window"] == 32 and d["top_p"] == 0.9 and d["temperature"] == 0.7
    assert d["seed"] == 0 and d["greedy"] is False
    assert s.needs_history
    plain = Sampler.from_params(temperature=1.0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                                frequency_penalty=0.0, presence_penalty=0.0)
    assert plain.processors == [] and not plain.needs_history


def test_process_composes_in_order():
    x = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    hist = [torch.tensor([0])]
    s = Sampler.from_params(repetition_penalty=4.0, temperature=0.5, top_k=2)
    # penalty first: logit 2 -> 0.5; then /0.5 -> [1, 2, 1, -2]; top-2 keeps 2 and the tied 1s
    assert s.process(x, hist).tolist() == [[1.0, 2.0, 1.0, NEG]]
    with pytest.raises(ValueError):
        s.process(x, None)


def test_process_returns_a_new_tensor_even_with_nothing_to_do():
    """``process`` promises a new tensor: a caller may write into it without changing the logits it gave."""
    x = torch.tensor([[2.0, 1.0, 0.5]])
    out = Sampler(seed=0).process(x)
    assert out is not x and torch.equal(out, x)
    out[0, 0] = NEG
    assert x.tolist() == [[2.0, 1.0, 0.5]]


def test_greedy_equals_argmax_of_processed_logits():
    x = torch.randn(8, 30, generator=torch.Generator().manual_seed(1)) * 2
    g = Sampler(greedy=True)
    assert g.is_greedy and torch.equal(g.pick(x, []), x.argmax(-1))
    probs = g.probs(x, [])
    assert torch.equal(probs, torch.nn.functional.one_hot(x.argmax(-1), 30).float())
    t0 = Sampler.from_params(temperature=0, top_k=5)
    assert t0.is_greedy and torch.equal(t0.pick(x, []), x.argmax(-1))
    # greedy still applies penalties: the banned argmax is not picked
    hist = [torch.tensor([int(i)]) for i in x.argmax(-1)]
    pen = Sampler.from_params(temperature=0, no_repeat_ngram_size=1)
    picked = pen.pick(x, hist)
    assert torch.equal(picked, x.topk(2, -1).indices[:, 1])
    assert torch.equal(pen.probs(x, hist), torch.nn.functional.one_hot(picked, 30).float())  # one-hot at the processed argmax


def test_same_seed_same_samples_different_seed_different():
    x = torch.zeros(64, 50)
    a, b, c = (Sampler.from_params(seed=s) for s in (123, 123, 124))
    draws_a = [a.pick(x, []) for _ in range(3)]
    draws_b = [b.pick(x, []) for _ in range(3)]
    draws_c = [c.pick(x, []) for _ in range(3)]
    assert all(torch.equal(u, v) for u, v in zip(draws_a, draws_b))
    assert not all(torch.equal(u, v) for u, v in zip(draws_a, draws_c))
    assert torch.equal(Sampler(seed=5).uniform(4), Sampler(seed=5).uniform(4))
    assert not torch.equal(Sampler(seed=5).uniform(4), Sampler(seed=6).uniform(4))
    assert Sampler().seed != Sampler().seed  # no seed: fresh random seeds


def test_keyed_draws_are_unrelated_across_neighbouring_seeds_and_positions():
    """The race's key hashes seed and position apart (splitmix64): no two of 8 seeds x 32 positions
    share their noise, so draws from a uniform 65,536-token distribution almost never coincide
    (0.5 coincidences expected); a key that ignored the position, or mixed it unhashed, repeats."""
    probs = torch.ones(1 << 16)
    draws = [Sampler(seed=seed).sample_at(probs, position) for seed in range(8) for position in range(32)]
    assert len(set(draws)) >= len(draws) - 3


def test_uniform_draws_are_in_unit_interval():
    u = Sampler(seed=0).uniform(1000)
    assert u.shape == (1000,) and u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.05  # sd of the mean is 0.009


# chi-square 0.999 quantiles by degrees of freedom (from standard tables)
CHI2_999 = {2: 13.816, 3: 16.266, 4: 18.467}


def _chi2(counts: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    expected = probs * n
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampling_frequencies_match_probs():
    x = torch.tensor([[2.0, 1.5, 0.3, 1.0, -1.0, 0.0]])
    s = Sampler.from_params(temperature=0.8, top_k=4, seed=2024)
    probs = s.probs(x, [])[0].double()
    assert abs(probs.sum().item() - 1) < 1e-6 and set(torch.nonzero(probs).flatten().tolist()) == {0, 1, 2, 3}
    n = 40000
    ids = s.pick(x.expand(n, -1), [])
    counts = torch.bincount(ids, minlength=6).double()
    assert counts[[4, 5]].sum() == 0  # removed tokens are never drawn
    keep = probs > 0
    assert _chi2(counts[keep], probs[keep], n) < CHI2_999[3]


def test_sample_from_uses_given_weights():
    s = Sampler(seed=7)
    w = torch.tensor([0.0, 3.0, 1.0, 0.0, 4.0])  # unnormalised, like a speculative residual
    n = 30000
    ids = s.sample_from(w.expand(n, -1))
    assert ids.shape == (n,) and ids.dtype == torch.long
    counts = torch.bincount(ids, minlength=5).double()
    assert counts[0] == 0 and counts[3] == 0
    p = w / w.sum()
    assert _chi2(counts[[1, 2, 4]], p[[1, 2, 4]].double(), n) < CHI2_999[2]
    assert s.sample_from(w).shape == ()
    with pytest.raises(ValueError):
        s.sample_from(torch.zeros(1, 5))



@pytest.mark.parametrize("weights", [[1.0, float("inf"), 2.0], [float("nan"), 1.0, 2.0], [0.0, 0.0, 0.0],
                                     [-1.0, 2.0, 1.0]], ids=["inf", "nan", "zero", "negative"])
def test_sample_from_refuses_weights_it_cannot_draw_from(weights):
    """Weights that are not finite (a penalty past float32's range, a NaN), negative or sum to 0 are
    the sampler's own InvalidParameter, saying why, never torch's RuntimeError from multinomial; the
    keyed draw (:meth:`Sampler.sample_at`) refuses the same weights."""
    s = Sampler(seed=0)
    with pytest.raises(InvalidParameter, match="no token can be sampled"):
        s.sample_from(torch.tensor([weights, [1.0, 1.0, 1.0]]))
    with pytest.raises(InvalidParameter, match="no token can be sampled"):
        s.sample_at(torch.tensor(weights), 0)

@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": -0.1}, "top_p"),
        ({"top_k": 0}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"),
        ({"temperature": -0.5}, "temperature"), ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"min_p": -0.1}, "min_p"), ({"min_p": 1.1}, "min_p"),
        ({"typical_p": 0}, "typical_p"), ({"typical_p": 1.01}, "typical_p"),
        ({"epsilon": 0}, "epsilon"), ({"epsilon": 1}, "epsilon"),
        ({"eta": 0}, "eta"), ({"eta": 1.0}, "eta"),
        ({"top_n_sigma": 0}, "top_n_sigma"), ({"top_n_sigma": -1}, "top_n_sigma"),
        ({"top_h": 0}, "top_h"), ({"top_h": 1.5}, "top_h"),
        ({"adaptive_k": 0}, "adaptive_k"), ({"adaptive_k": "0.1"}, "adaptive_k"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"presence_penalty": float("inf")}, "presence_penalty"),
        ({"penalty_window": 0}, "penalty_window"), ({"penalty_window": 2**40 + 1}, "penalty_window"),
        ({"no_repeat_ngram_size": 0}, "no_repeat_ngram_size"),
        ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"), ({"greedy": "yes"}, "greedy"),
    ],
)
def test_invalid_values_raise_naming_the_parameter(kwargs, name):
    with pytest.raises(InvalidParameter) as err:
        Sampler.from_params(**kwargs)
    msg = str(err.value)
    assert msg.startswith(f"{name} must be") and "\n" not in msg


def test_greedy_with_a_temperature_is_refused_not_ignored():
    with pytest.raises(InvalidParameter, match=r"^greedy takes the most likely token, so temperature=0.7 would be ignored"):
        Sampler.from_params(greedy=True, temperature=0.7)
    with pytest.raises(InvalidParameter, match="temperature=1 would be ignored"):
        Sampler.from_params(greedy=True, temperature=1.0)  # said, so refused though 1 is the default
    for params in ({"greedy": True}, {"greedy": True, "temperature": 0}, {"greedy": True, "top_p": 0.5}):
        assert Sampler.from_params(**params).is_greedy


def test_invalid_message_states_range():
    with pytest.raises(InvalidParameter, match=r"^top_p must be in \(0, 1\], got 0$"):
        Sampler.from_params(top_p=0)
    with pytest.raises(InvalidParameter, match=r"^top_k must be an integer >= 1, got 0$"):
        TopK(0)
    with pytest.raises(InvalidParameter, match=r"^temperature must be a finite number > 0"):
        Temperature(0)  # the processor itself needs T > 0; from_params maps 0 to greedy


def test_histories_give_each_rows_generated_ids_whether_rows_are_lists_or_tensors():
    from decodekit.samplers.base import Histories, generated_ids, generated_lists

    rows = [[5, 6, 7, 8], torch.tensor([1, 2, 3])]
    histories = Histories(rows, [2, 1])
    assert generated_lists(histories) == [[7, 8], [2, 3]]
    assert [t.tolist() for t in generated_ids(histories)] == [[7, 8], [2, 3]]
    assert [t.tolist() for t in histories] == [[5, 6, 7, 8], [1, 2, 3]]  # read as a list: the whole history
    assert generated_lists([torch.tensor([4, 5])]) == [[4, 5]]  # a plain sequence has no prompt


def test_histories_refuse_a_prompt_length_per_row_that_does_not_match_the_rows():
    """One prompt length per row: fewer would leave a row's prompt counted as generated (zip stops early)."""
    with pytest.raises(ValueError, match="expected 2 prompt lengths, got 1"):
        Histories([[1, 2], [3, 4]], [1])


# ---------------------------------------------------------------- the sampler's own promises


class RefuseTokens(LogitsProcessor):
    """A mask (like a grammar's) that refuses ``refused`` and allows only ``allow`` tokens of any continuation."""

    refuses_tokens = True

    def __init__(self, refused: set[int], allow: int = 10**9):
        self.refused, self.allow = refused, allow

    def __call__(self, logits, histories):
        out = logits.clone()
        out[:, sorted(self.refused)] = NEG
        return out

    def allowed_prefix(self, generated, continuation):
        return min(self.allow, len(continuation))

    def surely_allows(self, token, history):
        return token not in self.refused


def test_allowed_prefix_is_the_strictest_processors():
    """Every processor must allow a draft token, so the prefix is the shortest any refusing processor allows."""
    s = Sampler([RefuseTokens(set(), allow=3), Temperature(0.5), RefuseTokens(set(), allow=1)], seed=0)
    assert s.allowed_prefix([], [4, 5, 6, 7]) == 1
    assert Sampler([Temperature(0.5)], seed=0).allowed_prefix([], [4, 5, 6]) == 3  # nothing refuses


def test_pick_at_never_returns_a_token_the_mask_refuses():
    """The choice made before the mask stands only where the mask surely allows it; else the mask decides."""
    logits = torch.tensor([5.0, 2.0, 1.0])
    greedy = Sampler([RefuseTokens({0})], greedy=True, seed=0)
    assert greedy.pick_at(logits, 0) == 1
    sampled = Sampler([RefuseTokens({0}), Temperature(0.01)], seed=0)
    assert all(sampled.pick_at(logits, position) == 1 for position in range(8))



def test_pick_at_lets_the_mask_decide_where_the_unmasked_row_cannot_be_sampled():
    """The choice before the mask is an optimisation: where the row without the mask cannot be
    sampled (an infinite or NaN logit on a token the mask refuses), the masked row is, and is."""
    s = Sampler([RefuseTokens({0}), Temperature(0.5)], seed=0)
    for bad in (float("inf"), float("nan")):
        logits = torch.tensor([bad, 1.0, 2.0])
        assert {s.pick_at(logits, position) for position in range(8)} <= {1, 2}
        assert s.process(logits[None])[0, 0] == NEG


def test_broken_by_asks_every_processor():
    """A finished request's tokens are checked against every processor's promise, not the first one's."""
    class Refuses7(LogitsProcessor):
        def __call__(self, logits, histories):
            return logits.clone()

        def broken_by(self, generated):
            return "7 is not allowed" if 7 in generated else None

    s = Sampler([Temperature(0.5), TopK(3), Refuses7()], seed=0)
    assert s.broken_by([1, 2]) is None
    assert s.broken_by([1, 7]) == "7 is not allowed"

def test_forced_asks_every_processor():
    """The tokens a processor forces are found whichever processor of the chain forces them."""
    class ForcesAfter2(LogitsProcessor):
        def __call__(self, logits, histories):
            return logits.clone()

        def forced(self, generated):
            return [3, 4] if generated[-1:] == [2] else []

    s = Sampler([Temperature(0.5), TopK(3), ForcesAfter2()], seed=0)
    assert s.forced([1]) == []
    assert s.forced([1, 2]) == [3, 4]


@pytest.mark.parametrize("shape", [(4,), (1, 2, 4)])
def test_process_refuses_logits_that_are_not_rows(shape):
    """``process`` takes ``[batch, vocab]``: one flat row or a 3-D tensor is a ValueError saying so."""
    for s in (Sampler(seed=0), Sampler.from_params(top_k=2, seed=0)):
        with pytest.raises(ValueError, match=r"logits must have shape \[batch, vocab\]"):
            s.process(torch.zeros(shape))


def test_process_refuses_a_history_count_unlike_the_rows():
    """A history processor needs one history per row: one history for two rows is an error, not a guess."""
    class FirstRowsHistory(LogitsProcessor):  # a processor of one's own that trusts what it is given
        needs_history = True

        def __call__(self, logits, histories):
            return logits.clone()

    for s in (Sampler.from_params(repetition_penalty=1.5), Sampler([FirstRowsHistory()], seed=0)):
        with pytest.raises(ValueError, match="one history per batch row"):
            s.process(torch.zeros(2, 4), [torch.tensor([1])])


def test_uniform_refuses_a_negative_count():
    """``uniform(n)`` takes a non-negative integer; -1 is a ValueError naming it."""
    with pytest.raises(ValueError, match="non-negative"):
        Sampler(seed=0).uniform(-1)
    assert Sampler(seed=0).uniform(0).shape == (0,)


def test_greedy_must_be_a_bool():
    """``greedy=1`` is refused rather than read as true (the sampler's parameters are checked, not coerced)."""
    with pytest.raises(InvalidParameter, match="greedy"):
        Sampler(greedy=1)


def test_seed_takes_every_64_bit_value_and_no_more():
    """Seeds are unsigned 64-bit integers: 2**64 - 1 is the largest, 2**64 is refused."""
    assert Sampler(seed=2**64 - 1).seed == 2**64 - 1
    with pytest.raises(InvalidParameter, match="seed"):
        Sampler(seed=2**64)


def test_splitmix64_keys_stay_below_2_to_the_63():
    """splitmix64 promises keys below 2**63 (non-negative signed 64-bit), whatever the input."""
    from decodekit.samplers.sampler import splitmix64

    outs = [splitmix64(x) for x in (*range(64), 2**64 - 1, 2**63, 12345678901234567)]
    assert all(0 <= k < 2**63 for k in outs)
    assert any(k >= 2**62 for k in outs)  # the top kept bit is used (the outputs are not just small)


def test_typical_p_of_one_is_allowed_and_adds_no_processor():
    """typical_p is in (0, 1]: at 1 the typical set must hold the whole mass, i.e. every token of
    positive probability, so the value changes nothing and from_params adds no processor (as for
    top_p=1 and min_p=0)."""
    s = Sampler.from_params(typical_p=1.0, seed=0)
    assert s.processors == [] and "typical_p" not in s.describe()
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    for keep_argmax in (True, False):
        out = TypicalP(1.0, keep_argmax=keep_argmax)(x, [])
        assert torch.equal(out, x)  # the whole mass: nothing cut, nothing changed


def test_repetition_penalty_below_float32s_smallest_normal_is_refused():
    """repetition_penalty is in [FLOAT32_TINY, FLOAT32_MAX]: a subnormal (or smaller) float32 divisor
    is refused by name, the smallest normal one is taken."""
    from decodekit.samplers import RepetitionPenalty
    from decodekit.samplers.params import FLOAT32_TINY

    for tiny in (1e-39, 1e-45, FLOAT32_TINY / 2):
        with pytest.raises(InvalidParameter, match="^repetition_penalty must be"):
            Sampler.from_params(repetition_penalty=tiny)
    assert RepetitionPenalty(FLOAT32_TINY).penalty == FLOAT32_TINY


def test_a_penalty_window_longer_than_the_history_counts_all_of_it():
    """Only the last W ids count: with fewer than W ids, every one of them counts."""
    from decodekit.samplers import FrequencyPenalty, RepetitionPenalty

    x = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    hist = [torch.tensor([1, 1, 2])]
    # logit -= 0.5 * count: id 1 twice, id 2 once
    assert FrequencyPenalty(0.5, window=5)(x, hist).tolist() == [[1.0, 0.0, 0.5, 1.0]]
    assert FrequencyPenalty(0.5, window=3)(x, hist).tolist() == [[1.0, 0.0, 0.5, 1.0]]
    assert FrequencyPenalty(0.5, window=2)(x, hist).tolist() == [[1.0, 0.5, 0.5, 1.0]]  # the last 2: [1, 2]
    # positive logits divided by 2 for every seen id, whatever the count
    assert RepetitionPenalty(2.0, window=10)(x, [torch.tensor([0, 3])]).tolist() == [[0.5, 1.0, 1.0, 0.5]]


def test_top_p_and_typical_p_of_one_keep_every_token_on_their_own():
    """As Sampler.from_params has them (no processor): float32 probabilities summing a hair past 1
    left the tail's mass before it at 1.0, and TopP(1.0) dropped tens of a row's tail tokens."""
    from decodekit.samplers import TypicalP

    torch.manual_seed(0)
    x = torch.randn(8, 49152) * 2
    for processor in (TopP(1.0), TypicalP(1.0), TypicalP(1.0, keep_argmax=False)):
        assert torch.equal(processor(x, []), x), processor
