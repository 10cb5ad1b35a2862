"""Lossless speculative decoding: one draft–verify loop, exact verifiers, many drafters.

Every drafter registered in :data:`decodekit.speculative.drafters.DRAFTER_SPECS` becomes a decoding
method of the same name (``pld``, ``suffix``, ``recycling``, ``lookahead``, ``hierarchy``,
``layerskip``, ``draft``, ``kvdraft``, the trained ``eagle``, ``medusa`` and ``hydra``, and ``auto``
which picks among them with a bandit). Options common to
all: ``max_draft``, ``budget`` (fixed size, no controller), ``cost_table``; plus each drafter's own.
"""

from __future__ import annotations

from ..engine.registry import register_method
from ..options import option_table
from .controller import Controller, CostTable, prepare
from .drafters import DRAFTER_SPECS, Drafter, register_drafter
from .loop import COMMON_OPTIONS, SpeculativeMethod, method_builder
from .tree import DraftTree, Verification
from .verify import GreedyVerifier, KeyedVerifier, SamplingVerifier, Verifier


def register_methods() -> None:
    """Register (or refresh) one decoding method per drafter."""
    for name, spec in DRAFTER_SPECS.items():
        register_method(name, method_builder(spec.factory), spec.description, lossless=True, family="speculative",
                        options=option_table(spec.options, COMMON_OPTIONS))


register_methods()

__all__ = [
    "Controller", "CostTable", "DRAFTER_SPECS", "DraftTree", "Drafter", "GreedyVerifier", "KeyedVerifier", "SamplingVerifier",
    "SpeculativeMethod", "Verification", "Verifier", "prepare", "register_drafter", "register_methods",
]
