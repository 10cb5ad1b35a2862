"""Search and test-time scaling: beam search, CoT-decoding, best-of-N and voting, MBR,
first-finish, step-level search (step beam, particle filtering, A*), with uncertainty signals.

Every method here is a whole-request :class:`~decodekit.engine.core.Decoder`; candidates, scores and
uncertainty signals come back in ``Generation.extra``. Importing this package registers them.
"""

from __future__ import annotations

from ..engine.registry import register_method
from ..options import OptionSpec
from .batch import Sample, SearchContext, decode_batch
from .sample_decoder import SampleDecoder
from .beam import OPTIONS as BEAM_OPTIONS, BeamSearch
from .cot import OPTIONS as COT_OPTIONS, CoTDecoding
from .options import builder
from .scorers import Judge, Scorer, StepScorer, make_scorer
from .select import (
    BEST_OF_N_OPTIONS,
    MBR_OPTIONS,
    SAMPLING_OPTIONS,
    WEIGHTED_VOTE_OPTIONS,
    BestOfN,
    FirstFinish,
    MinimumBayesRisk,
    SelfConsistency,
    WeightedVote,
    majority_vote,
    mbr_select,
)
from .steps import ASTAR_OPTIONS, PARTICLE_OPTIONS, STEP_BEAM_OPTIONS, AStarDecoding, ParticleFilter, StepBeamSearch

METHODS: dict[str, tuple[type, dict[str, OptionSpec], str]] = {
    "beam": (BeamSearch, BEAM_OPTIONS, "beam search, GNMT length penalty, flexible-beam pruning (Freitag & Al-Onaizan 2017)"),
    "cot": (CoTDecoding, COT_OPTIONS, "CoT-decoding: top-k first tokens, greedy paths, max answer confidence (Wang & Zhou 2024)"),
    "best-of-n": (BestOfN, BEST_OF_N_OPTIONS, "best of N batched samples by a scorer (loglik, self-certainty, judge, ...)"),
    "self-consistency": (SelfConsistency, SAMPLING_OPTIONS, "majority vote over N sampled answers (Wang et al. 2023)"),
    "weighted-vote": (WeightedVote, WEIGHTED_VOTE_OPTIONS,
                      "vote over N sampled answers weighted by a score (default exp mean log-prob)"),
    "mbr": (MinimumBayesRisk, MBR_OPTIONS, "minimum Bayes risk over N samples, chrF utility"),
    "first-finish": (FirstFinish, SAMPLING_OPTIONS, "first of N batched samples to finish"),
    "step-beam": (StepBeamSearch, STEP_BEAM_OPTIONS, "step-level beam search guided by a step scorer"),
    "particle": (ParticleFilter, PARTICLE_OPTIONS, "particle filtering over steps (Puri et al. 2025)"),
    "astar": (AStarDecoding, ASTAR_OPTIONS, "A*-style best-first step search under a token budget"),
}

for _name, (_cls, _options, _description) in METHODS.items():
    register_method(_name, builder(_options, _cls), _description, lossless=False, family="search", options=_options)

__all__ = [
    "AStarDecoding", "BeamSearch", "BestOfN", "CoTDecoding", "FirstFinish", "Judge", "METHODS", "MinimumBayesRisk",
    "ParticleFilter", "Sample", "SampleDecoder", "Scorer", "SearchContext", "SelfConsistency", "StepBeamSearch",
    "StepScorer", "WeightedVote", "decode_batch", "majority_vote", "make_scorer", "mbr_select",
]
