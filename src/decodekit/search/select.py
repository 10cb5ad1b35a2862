"""Multi-sample selection: N samples in one batch, then one is chosen.

* best-of-N with a pluggable scorer (see :mod:`decodekit.search.scorers`);
* self-consistency (Wang et al., 2023, "Self-Consistency Improves Chain of Thought Reasoning in
  Language Models"): majority vote over extracted answers;
* weighted voting: each sample votes with a non-negative score (default ``prob`` = exp of the mean
  token log-prob, the paper's normalised weighted sum);
* minimum Bayes risk (Kumar & Byrne, 2004; Eikema & Aziz, 2020 for sampling-based MBR): the sample
  with the highest mean utility against the others, utility chrF (sacrebleu);
* first-finish: the first sample to end (EOS or stop string); ties go to the higher log-likelihood.

None of these is lossless: they change the output distribution on purpose. Choices the papers
leave open: vote ties go to the answer seen first (sample order); the returned text is the first
sample carrying the winning answer; samples with no extractable answer do not vote.
When the request's sampler is greedy (the engine's default for these methods), samples are drawn
at ``sample_temperature`` (default :data:`~.batch.SAMPLE_TEMPERATURE`) from the same processed distribution.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..engine.core import Decoder, Generation, Request
from ..errors import InvalidParameter
from ..models import LoadedModel
from ..options import OptionSpec, option_table
from .answers import ANSWER_MODES, ANSWER_START_OPTION, answer_functions
from .batch import SAMPLE_TEMPERATURE, SAMPLE_TEMPERATURE_OPTION, Sample, SearchContext
from .scorers import JUDGE_MODEL_OPTION, NONNEGATIVE_SCORER_NAMES, SCORER_NAMES, Scorer, make_scorer, returned_number
from .uncertainty import agreement, sample_signals

Utility = Callable[[str, str], float]


def majority_vote(answers: Sequence[str | None], weights: Sequence[float] | None = None) -> tuple[str | None, dict[str, float]]:
    """The answer with the largest total weight (1 each by default); ties go to the one seen first."""
    totals: dict[str, float] = {}
    for i, answer in enumerate(answers):
        if answer is not None:
            totals[answer] = totals.get(answer, 0.0) + (1.0 if weights is None else float(weights[i]))
    if not totals:
        return None, totals
    best = max(totals.values())
    return next(a for a in totals if totals[a] == best), totals


def chrf_utility() -> Utility:
    """chrF (Popović, 2015) of a hypothesis against one reference, from sacrebleu, in [0, 100]."""
    from sacrebleu.metrics import CHRF

    metric = CHRF()
    return lambda hyp, ref: metric.sentence_score(hyp, [ref]).score


def mbr_select(texts: Sequence[str], utility: Utility) -> tuple[int, list[float]]:
    """Index of the text with the highest mean utility against all the others (ties: the first, as
    best-of-n's), and those means."""
    n = len(texts)
    if n == 1:
        return 0, [0.0]
    expected = [sum(utility(texts[i], texts[j]) for j in range(n) if j != i) / (n - 1) for i in range(n)]
    return max(range(n), key=lambda i: expected[i]), expected


def first_finished(samples: Sequence[Sample]) -> int:
    """Index of the sample that finished first, in the fewest steps (a stop string's cut tokens
    count: they were decoded), ties to the higher log-likelihood; 0 when none finished."""
    finished = [i for i, s in enumerate(samples) if s.finish_reason in ("eos", "stop")]
    if not finished:
        return 0
    return min(finished, key=lambda i: (samples[i].steps, -samples[i].loglik))


def checked_utility(fn: Utility) -> Utility:
    """A user's ``utility`` callable, held to returning a finite number."""
    def utility(hyp: str, ref: str) -> float:
        return returned_number(fn(hyp, ref), "utility", param="utility")
    return utility


SAMPLING_OPTIONS = option_table(
    OptionSpec("n", int, 8, "number of samples", lo=1),
    SAMPLE_TEMPERATURE_OPTION,
    OptionSpec("answer", str, "auto", "answer extraction for voting and agreement", choices=ANSWER_MODES,
               allow_callable=True),
    ANSWER_START_OPTION,
)
SCORER_OPTIONS = option_table(
    OptionSpec("scorer", str, "loglik", "candidate scorer", choices=SCORER_NAMES, allow_callable=True),
    JUDGE_MODEL_OPTION,
)
BEST_OF_N_OPTIONS = option_table(SAMPLING_OPTIONS, SCORER_OPTIONS)
WEIGHTED_VOTE_OPTIONS = option_table(BEST_OF_N_OPTIONS, OptionSpec(
    "scorer", str, "prob", "vote weight", choices=NONNEGATIVE_SCORER_NAMES, allow_callable=True))
MBR_OPTIONS = option_table(SAMPLING_OPTIONS, OptionSpec("utility", str, "chrf", "utility", choices=("chrf",),
                                                        allow_callable=True))


class MultiSampleDecoder(Decoder):
    """Samples ``n`` continuations in one batch, then :meth:`choose` picks one."""

    method = "multi-sample"
    #: What rates the samples, where the method has one.
    scorer: Scorer | None = None

    def __init__(self, n: int = 8, sample_temperature: float = SAMPLE_TEMPERATURE, answer: str | Callable = "auto",
                 answer_start: Callable[[str], int] | None = None, **_: Any):
        self.n = n
        self.temperature = sample_temperature
        self.extract, self.start = answer_functions(answer, answer_start)

    def generate(self, model: LoadedModel, request: Request) -> Generation:
        if self.scorer is not None:
            self.scorer.check(model, request)
        ctx = SearchContext(model, request)
        samples = ctx.decode(ctx.prompt, ctx.row_samplers(self.temperature), range(self.n),
                             request.max_new_tokens, stop_on_first=self.stops_early)
        answers = [self.extract(s.text) for s in samples]
        index, scores = self.choose(ctx, samples, answers)
        chosen = samples[index]
        signals = sample_signals(chosen, model.tokenizer, self.start(chosen.text))
        signals["agreement"] = agreement(answers[index], answers)
        candidates = [
            {"text": s.text, "answer": a, "score": sc, "tokens": len(s.tokens), "loglik": round(s.loglik, 4),
             "finish_reason": s.finish_reason}
            for s, a, sc in zip(samples, answers, scores)
        ]
        extra = {"method": self.method, "chosen": index, "answer": answers[index], "candidates": candidates,
                 "uncertainty": signals}
        return ctx.finalize(chosen, extra)

    stops_early = False

    def choose(self, ctx: SearchContext, samples: list[Sample], answers: list[str | None]) -> tuple[int, list[Any]]:
        raise NotImplementedError


class BestOfN(MultiSampleDecoder):
    """Best-of-N: the sample with the highest scorer value (ties: the first)."""

    method = "best-of-n"

    def __init__(self, scorer: Any = "loglik", judge_model: Any = None, **kw: Any):
        super().__init__(**kw)
        self.scorer = make_scorer(scorer, judge_model)

    def choose(self, ctx: SearchContext, samples: list[Sample], answers: list[str | None]) -> tuple[int, list[Any]]:
        scores = [self.scorer.score(ctx, [], s) for s in samples]
        return max(range(len(samples)), key=lambda i: scores[i]), scores


class SelfConsistency(MultiSampleDecoder):
    """Majority vote over extracted answers (Wang et al., 2023)."""

    method = "self-consistency"

    def choose(self, ctx: SearchContext, samples: list[Sample], answers: list[str | None]) -> tuple[int, list[Any]]:
        winner, _ = majority_vote(answers)
        index = answers.index(winner) if winner is not None else 0
        return index, [None] * len(samples)


class WeightedVote(BestOfN):
    """Each sample votes for its answer with a non-negative scorer value (default ``prob``)."""

    method = "weighted-vote"

    def __init__(self, scorer: Any = "prob", **kw: Any):
        super().__init__(scorer=scorer, **kw)

    def choose(self, ctx: SearchContext, samples: list[Sample], answers: list[str | None]) -> tuple[int, list[Any]]:
        weights = [self.scorer.score(ctx, [], s) for s in samples]
        if any(w < 0 for w in weights):
            raise InvalidParameter(f"weighted-vote needs non-negative weights; scorer {self.scorer.name!r} gave {min(weights)}")
        winner, _ = majority_vote(answers, weights)
        index = answers.index(winner) if winner is not None else 0
        return index, weights


class MinimumBayesRisk(MultiSampleDecoder):
    """The sample with the highest mean utility (chrF by default) against the other samples."""

    method = "mbr"

    def __init__(self, utility: str | Utility = "chrf", **kw: Any):
        super().__init__(**kw)
        self.utility = chrf_utility() if utility == "chrf" else checked_utility(utility)

    def choose(self, ctx: SearchContext, samples: list[Sample], answers: list[str | None]) -> tuple[int, list[Any]]:
        return mbr_select([s.text for s in samples], self.utility)


class FirstFinish(MultiSampleDecoder):
    """The first of N samples to finish; the batch stops there, so it costs the shortest sample."""

    method = "first-finish"
    stops_early = True

    def choose(self, ctx: SearchContext, samples: list[Sample], answers: list[str | None]) -> tuple[int, list[Any]]:
        return first_finished(samples), [s.steps for s in samples]
