"""Token-level samplers as small composable logits processors.

``Sampler.from_params(...)`` builds a validated chain; every processor is also usable alone.
"""

from decodekit.samplers.base import Histories, LogitsProcessor
from decodekit.samplers.penalties import (
    FrequencyPenalty,
    NoRepeatNGram,
    PresencePenalty,
    RepetitionPenalty,
)
from decodekit.samplers.params import SAMPLER_OPTIONS, SAMPLER_PARAMS
from decodekit.samplers.sampler import Sampler
from decodekit.samplers.truncation import (
    AdaptiveTopK,
    EpsilonCutoff,
    EtaCutoff,
    MinP,
    Temperature,
    TopH,
    TopK,
    TopNSigma,
    TopP,
    TypicalP,
)

__all__ = [
    "SAMPLER_OPTIONS",
    "SAMPLER_PARAMS",
    "AdaptiveTopK",
    "EpsilonCutoff",
    "EtaCutoff",
    "FrequencyPenalty",
    "Histories",
    "LogitsProcessor",
    "MinP",
    "NoRepeatNGram",
    "PresencePenalty",
    "RepetitionPenalty",
    "Sampler",
    "Temperature",
    "TopH",
    "TopK",
    "TopNSigma",
    "TopP",
    "TypicalP",
]
