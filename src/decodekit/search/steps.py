"""Step-level search: a solution is a sequence of steps split by a delimiter (default a blank line).

A step ends when its text holds the delimiter after some content, at EOS, at a stop string, or at
``max_step_tokens`` (boundaries fall on token edges, so a step may run a few characters past the
delimiter). Every new step is rated by a :class:`~decodekit.search.scorers.StepScorer` (a
process-reward model; by default the model's own judgement, ``mean-logprob`` of the step) and a
partial solution's value aggregates its step scores (``aggregate``: mean (default), last, min, sum).

* ``step-beam``: verifier-guided step beam search (as in Snell et al., 2024, "Scaling LLM
  Test-Time Compute Optimally..."): each of ``n`` beams samples ``expand`` next steps (one batch),
  the best ``n`` partial solutions survive; finished ones leave the beam (which shrinks) and the
  best finished solution is returned.
* ``particle``: particle filtering (Puri et al., 2025, "A Probabilistic Inference Approach to
  Inference-Time Scaling of LLMs using Particle-Based Monte Carlo Methods"; see ParticleFilter).
* ``astar``: A*-style best-first search (after Chatziveroglou, 2025, "A*-Decoding: Token-Efficient
  Inference Scaling"): a priority queue of partial solutions ordered by value (the PRM score plays
  the heuristic); the best one is popped and expanded into ``n`` sampled next steps; the first
  finished solution popped is returned. The total of tokens chosen stays within ``token_budget``:
  each expansion may spend at most (budget left) // n tokens per child; when the budget is spent,
  the best finished solution seen (else the best partial one) is returned.

Not lossless. With a greedy request sampler, steps are sampled at ``sample_temperature``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.core import Decoder, Generation, Request
from ..errors import InvalidParameter
from ..models import LoadedModel
from ..options import OptionSpec, option_table
from ..samplers import Sampler
from ..samplers.params import SEED_LIMIT
from .answers import ANSWER_START_OPTION, answer_functions
from .batch import SAMPLE_TEMPERATURE, SAMPLE_TEMPERATURE_OPTION, RowSamplers, Sample, SearchContext
from .scorers import JUDGE_MODEL_OPTION, SCORER_NAMES, Scorer, make_scorer
from .uncertainty import sample_signals

AGGREGATES = ("mean", "last", "min", "sum")

COMMON_OPTIONS = option_table(
    OptionSpec("delimiter", str, "\n\n", "step delimiter"),
    OptionSpec("max_step_tokens", int, 128, "token cap per step", lo=1),
    OptionSpec("scorer", str, "mean-logprob", "step scorer (process reward)", choices=SCORER_NAMES,
               allow_callable=True),
    JUDGE_MODEL_OPTION,
    OptionSpec("aggregate", str, "mean", "how step scores make a solution's value", choices=AGGREGATES),
    SAMPLE_TEMPERATURE_OPTION,
    ANSWER_START_OPTION,
)
STEP_BEAM_OPTIONS = option_table(
    OptionSpec("n", int, 4, "beam width", lo=1),
    OptionSpec("expand", int, 4, "sampled next steps per beam", lo=1),
    COMMON_OPTIONS,
)
PARTICLE_OPTIONS = option_table(
    OptionSpec("n", int, 8, "number of particles", lo=1),
    # not `temperature`: that name is the sampler's (the request's own temperature samples the steps)
    OptionSpec("weight_temperature", float, 1.0, "weight = exp(prefix value / weight_temperature)", lo=1e-6),
    OptionSpec("ess_threshold", float, 0.5, "resample when ESS < threshold * n (1.0: after every step)", lo=0.0, hi=1.0),
    COMMON_OPTIONS,
)
ASTAR_OPTIONS = option_table(
    OptionSpec("n", int, 4, "sampled next steps per expansion", lo=1),
    OptionSpec("token_budget", int, 2048, "total tokens the search may choose", lo=1),
    COMMON_OPTIONS,
)


def aggregate(scores: Sequence[float], how: str) -> float:
    if not scores:
        return -math.inf
    if how == "last":
        return scores[-1]
    if how == "min":
        return min(scores)
    total = sum(scores)
    return total if how == "sum" else total / len(scores)


@dataclass
class Partial:
    """A partial (or finished) solution: its steps joined, one score per step."""

    sample: Sample
    scores: list[float]
    done: bool = False

    def value(self, how: str) -> float:
        return aggregate(self.scores, how)


def effective_sample_size(log_weights: Sequence[float]) -> float:
    """ESS = (Σw)² / Σw² of normalised weights given as logs."""
    w = torch.softmax(torch.tensor(list(log_weights), dtype=torch.float64), dim=0)
    return float(1.0 / (w * w).sum())


class StepSearch(Decoder):
    """Shared mechanism: expanding a partial solution by one sampled step and scoring the children."""

    method = "steps"

    def __init__(self, n: int, delimiter: str = "\n\n", max_step_tokens: int = 128, scorer: Any = "mean-logprob",
                 judge_model: Any = None, aggregate: str = "mean", sample_temperature: float = SAMPLE_TEMPERATURE,
                 answer_start: Callable[[str], int] | None = None, **_: Any):
        self.n = n
        _, self.start = answer_functions("auto", answer_start)  # where phi_first is read
        self.delimiter, self.max_step = delimiter, max_step_tokens
        self.scorer: Scorer = make_scorer(scorer, judge_model)
        self.how, self.temperature = aggregate, sample_temperature

    def context(self, model: LoadedModel, request: Request) -> SearchContext:
        """The request's search context, once the scorer has checked the model (before any step)."""
        self.scorer.check(model, request)
        return SearchContext(model, request)

    def expand(self, ctx: SearchContext, node: Partial, rows: RowSamplers, slots: Sequence[int],
               cap: int | None = None) -> list[Partial]:
        """One sampled next step per slot (one batch), each child scored."""
        done_len = ctx.request.max_new_tokens
        limit = min(self.max_step, done_len - len(node.sample.tokens), cap or self.max_step)
        steps = ctx.decode(ctx.prompt + node.sample.tokens, rows, slots, limit, delimiter=self.delimiter)
        children = []
        for step in steps:
            joined = node.sample.then(step)
            done = step.finish_reason in ("eos", "stop") or len(joined.tokens) >= done_len
            score = self.scorer.score_step(ctx, node.sample.tokens, step)
            children.append(Partial(joined, node.scores + [score], done))
        return children

    def result(self, ctx: SearchContext, best: Partial, pool: Sequence[Partial], extra: dict[str, Any]) -> Generation:
        if best.sample.finish_reason == "step":
            best.sample.finish_reason = "length"
        signals = sample_signals(best.sample, ctx.tokenizer, self.start(ctx.tokenizer.decode(best.sample.tokens)))
        signals["value"] = best.value(self.how)
        candidates = [
            {"text": ctx.tokenizer.decode(p.sample.tokens), "value": round(p.value(self.how), 6),
             "step_scores": [round(s, 6) for s in p.scores], "tokens": len(p.sample.tokens), "done": p.done}
            for p in pool
        ]
        extra = {"method": self.method, "candidates": candidates, "uncertainty": signals, **extra}
        return ctx.finalize(best.sample, extra)

    def best(self, nodes: Sequence[Partial]) -> Partial:
        return max(nodes, key=lambda p: p.value(self.how))  # ties: the first


class StepBeamSearch(StepSearch):
    method = "step-beam"

    def __init__(self, n: int = 4, expand: int = 4, **kw: Any):
        super().__init__(n, **kw)
        self.k = expand

    def generate(self, model: LoadedModel, request: Request) -> Generation:
        ctx = self.context(model, request)
        rows = ctx.row_samplers(self.temperature)
        beams, finished = [Partial(Sample.empty(), [])], []
        expansions = 0
        while beams:
            children = []
            for beam in beams:  # each expansion its own slots: a kept prefix shorter than a sibling
                # would otherwise redraw, in the same slot, positions that sibling drew
                children += self.expand(ctx, beam, rows, rows.fresh_slots(expansions * self.k, self.k))
                expansions += 1
            children.sort(key=lambda p: p.value(self.how), reverse=True)
            keep = children[: self.n - len(finished)]
            finished += [c for c in keep if c.done]
            beams = [c for c in keep if not c.done]
        return self.result(ctx, self.best(finished), finished, {})


class ParticleFilter(StepSearch):
    """Particle filtering over steps (Puri et al., 2025, "A Probabilistic Inference Approach to
    Inference-Time Scaling of LLMs using Particle-Based Monte Carlo Methods").

    The model's steps are the proposal and the process reward the observation: after every step
    each of the ``n`` particles is weighted by exp(value of its current prefix / ``weight_temperature``),
    the value being the aggregate of its step scores. As in the authors' reference code (its_hub's
    ``ParticleFiltering``), the weight is the score of the whole prefix, not of the new step, and a
    finished particle keeps weighing its final value at every later step, so it competes with the
    live particles on the same footing.

    Particles (finished ones included) are resampled, multinomially, when the effective sample
    size falls below ``ess_threshold`` · n. Between resamples the per-step log-weights add up (the
    usual SMC bookkeeping), so the weighted particles approximate the same distribution whatever
    the threshold. ``ess_threshold=1.0`` resamples after every step, even when the weights are
    equal: that is the reference's schedule. With it, ``weight_temperature=1``, the matching ``aggregate``
    and a scorer returning the reference's log-weight (the logit of the PRM's probability), this is
    the reference algorithm. Our default 0.5 resamples less often, which adds less noise; below
    1.0 a constant scorer never resamples, and since each particle slot keeps its own seed,
    particle i is then the independent sample seeded ``seed + i``.

    The returned particle is the finished one with the highest value (the reference's argmax).
    """

    method = "particle"

    def __init__(self, n: int = 8, weight_temperature: float = 1.0, ess_threshold: float = 0.5, **kw: Any):
        super().__init__(n, **kw)
        self.weight_temperature, self.ess_threshold = weight_temperature, ess_threshold

    def generate(self, model: LoadedModel, request: Request) -> Generation:
        ctx = self.context(model, request)
        model.backend.check_rows(self.n)  # the first step decodes every particle at once
        rows = ctx.row_samplers(self.temperature)
        resampler = Sampler(seed=(rows.base.seed + self.n) % SEED_LIMIT)  # its own stream, not a particle's
        particles = [Partial(Sample.empty(), []) for _ in range(self.n)]
        log_w = [0.0] * self.n
        resamples = 0
        while not all(p.done for p in particles):
            for group in self._groups(particles):
                # particle i draws with slot i until the first resample, then with slots no draw has
                # used (a copied prefix shorter than the particle it replaced would otherwise redraw
                # the positions that particle drew, with its noise)
                slots = rows.fresh_slots(resamples * self.n, self.n)
                children = self.expand(ctx, particles[group[0]], rows, [slots[i] for i in group])
                for i, child in zip(group, children):
                    particles[i] = child
            log_w = [w + p.value(self.how) / self.weight_temperature for w, p in zip(log_w, particles)]
            if self._should_resample(log_w):
                # after a resample every particle stands for an equal share of the distribution
                particles, log_w = self._resample(particles, log_w, resampler), [0.0] * self.n
                resamples += 1
        finished = [p for p in particles if p.done]
        return self.result(ctx, self.best(finished), particles, {"resamples": resamples})

    def _should_resample(self, log_w: Sequence[float]) -> bool:
        # at 1.0 always: ESS == n for equal weights would otherwise skip the reference's resample
        return self.ess_threshold >= 1.0 or effective_sample_size(log_w) < self.ess_threshold * self.n

    @staticmethod
    def _groups(particles: list[Partial]) -> list[list[int]]:
        """Unfinished particles with identical text so far, grouped: each group is one batch."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(particles):
            if not p.done:
                groups.setdefault(tuple(p.sample.tokens), []).append(i)
        return list(groups.values())

    @staticmethod
    def _resample(particles: list[Partial], log_w: list[float], resampler: Sampler) -> list[Partial]:
        weights = torch.softmax(torch.tensor(log_w, dtype=torch.float64), dim=0).float()
        picks = resampler.sample_from(weights.expand(len(particles), -1)).tolist()
        return [Partial(particles[a].sample, list(particles[a].scores), particles[a].done) for a in picks]


class AStarDecoding(StepSearch):
    method = "astar"

    def __init__(self, n: int = 4, token_budget: int = 2048, **kw: Any):
        super().__init__(n, **kw)
        if token_budget < self.n:  # the first expansion gives each of its n children a token at least
            raise InvalidParameter(f"token_budget ({token_budget}) must be at least n ({self.n}), a token for each "
                                   f"child of the first expansion", param="token_budget")
        self.budget = token_budget

    def generate(self, model: LoadedModel, request: Request) -> Generation:
        ctx = self.context(model, request)
        rows = ctx.row_samplers(self.temperature)
        order = itertools.count()
        queue: list[tuple[float, int, Partial]] = [(0.0, next(order), Partial(Sample.empty(), []))]
        seen: list[Partial] = []
        expansions = 0
        while queue:
            node = heapq.heappop(queue)[2]
            if node.done:
                return self.result(ctx, node, seen, {"expansions": expansions, "budget": self.budget})
            per_child = (self.budget - ctx.spent) // self.n
            if per_child < 1:
                heapq.heappush(queue, (-node.value(self.how), next(order), node))
                break
            for child in self.expand(ctx, node, rows, rows.fresh_slots(expansions * self.n, self.n), cap=per_child):
                seen.append(child)
                heapq.heappush(queue, (-child.value(self.how), next(order), child))
            expansions += 1
        nodes = [entry[2] for entry in queue]
        done = [p for p in nodes if p.done]
        best = self.best(done or nodes)
        return self.result(ctx, best, seen, {"expansions": expansions, "budget": self.budget, "budget_exhausted": True})
