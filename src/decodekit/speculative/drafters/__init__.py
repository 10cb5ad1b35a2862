"""The drafter registry: every drafter registers a factory under a name.

A factory takes keyword options (the drafter's own; unknown ones raise
:class:`~decodekit.errors.InvalidParameter`) and returns a :class:`Drafter`. The speculative
loop turns each registered drafter into a decoding method of the same name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...errors import InvalidParameter
from .base import Drafter


@dataclass(frozen=True)
class DrafterSpec:
    name: str
    factory: Callable[..., Drafter]
    description: str
    stochastic: bool  # True: drafts carry draft_probs (sampled proposals)


#: The one drafter registry: name -> spec (``spec.factory(**options)`` builds the drafter).
DRAFTER_SPECS: dict[str, DrafterSpec] = {}


def register_drafter(name: str, description: str, *, stochastic: bool = False) -> Callable:
    """Decorator registering a drafter factory (a class or function taking keyword options)."""

    def wrap(factory: Callable[..., Drafter]) -> Callable[..., Drafter]:
        DRAFTER_SPECS[name] = DrafterSpec(name, factory, description, stochastic)
        return factory

    return wrap


def int_option(name: str, value, lo: int) -> int:
    """Validate an integer option (command-line digit strings accepted)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise InvalidParameter(f"{name} must be an integer >= {lo}, got {value!r}")
    return value


def bool_option(name: str, value) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    if not isinstance(value, bool):
        raise InvalidParameter(f"{name} must be true or false, got {value!r}")
    return value


__all__ = ["DRAFTER_SPECS", "Drafter", "DrafterSpec", "bool_option", "int_option", "register_drafter"]

# Each module registers its drafters on import.
from . import ngram, suffix, recycling, lookahead, hierarchy, layerskip, draft_model, bandit  # noqa: E402,F401
