"""Token-level samplers as small composable logits processors.

``Sampler.from_params(...)`` builds a validated chain; every processor is also usable alone. The
names below are imported on first use (:mod:`decodekit.exports`): the parameter table
(:mod:`.params`) is read by the command line without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..exports import lazy_exports

#: Each public name and the submodule it comes from.
_EXPORTS = {
    "Histories": ".base", "LogitsProcessor": ".base",
    "FrequencyPenalty": ".penalties", "NoRepeatNGram": ".penalties", "PresencePenalty": ".penalties",
    "RepetitionPenalty": ".penalties",
    "SAMPLER_OPTIONS": ".params", "SAMPLER_PARAMS": ".params",
    "Sampler": ".sampler",
    "AdaptiveTopK": ".truncation", "EpsilonCutoff": ".truncation", "EtaCutoff": ".truncation", "MinP": ".truncation",
    "Temperature": ".truncation", "TopH": ".truncation", "TopK": ".truncation", "TopNSigma": ".truncation",
    "TopP": ".truncation", "TypicalP": ".truncation",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .base import Histories, LogitsProcessor
    from .params import SAMPLER_OPTIONS, SAMPLER_PARAMS
    from .penalties import FrequencyPenalty, NoRepeatNGram, PresencePenalty, RepetitionPenalty
    from .sampler import Sampler
    from .truncation import (AdaptiveTopK, EpsilonCutoff, EtaCutoff, MinP, Temperature, TopH, TopK, TopNSigma, TopP,
                             TypicalP)
