"""The drafter registry: every drafter registers a factory under a name.

A factory takes keyword options (the drafter's own; unknown ones raise
:class:`~decodekit.errors.InvalidParameter`) and returns a :class:`Drafter`. The speculative
loop turns each registered drafter into a decoding method of the same name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .base import Drafter


@dataclass(frozen=True)
class DrafterSpec:
    name: str
    factory: Callable[..., Drafter]
    description: str
    stochastic: bool  # True: drafts carry draft_probs (sampled proposals)


DRAFTERS: dict[str, Callable[..., Drafter]] = {}
DRAFTER_SPECS: dict[str, DrafterSpec] = {}


def register_drafter(name: str, description: str, *, stochastic: bool = False) -> Callable:
    """Decorator registering a drafter factory (a class or function taking keyword options)."""

    def wrap(factory: Callable[..., Drafter]) -> Callable[..., Drafter]:
        DRAFTERS[name] = factory
        DRAFTER_SPECS[name] = DrafterSpec(name, factory, description, stochastic)
        return factory

    return wrap


__all__ = ["DRAFTERS", "DRAFTER_SPECS", "Drafter", "DrafterSpec", "register_drafter"]

# Each module registers its drafters on import.
from . import ngram, suffix, recycling, lookahead, hierarchy, layerskip, draft_model  # noqa: E402,F401
