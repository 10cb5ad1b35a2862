"""The drafter registry: every drafter registers a factory under a name, with its options.

A factory takes keyword options (declared as :class:`~decodekit.options.OptionSpec`; the registry
rejects unknown ones and bad values with :class:`~decodekit.errors.InvalidParameter`) and returns
a :class:`Drafter`. The speculative loop turns each registered drafter into a decoding method of
the same name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ...options import OptionSpec
from .base import Drafter


@dataclass(frozen=True)
class DrafterSpec:
    name: str
    factory: Callable[..., Drafter]
    description: str
    options: Mapping[str, OptionSpec] = field(default_factory=dict)  # the factory's keyword options


#: The one drafter registry: name -> spec (``spec.factory(**options)`` builds the drafter).
DRAFTER_SPECS: dict[str, DrafterSpec] = {}


def register_drafter(name: str, description: str, *, options: Mapping[str, OptionSpec] | None = None) -> Callable:
    """Decorator registering a drafter factory (a class or function taking the keyword ``options``)."""

    def wrap(factory: Callable[..., Drafter]) -> Callable[..., Drafter]:
        DRAFTER_SPECS[name] = DrafterSpec(name, factory, description, dict(options or {}))
        return factory

    return wrap


__all__ = ["DRAFTER_SPECS", "Drafter", "DrafterSpec", "register_drafter"]

# Each module registers its drafters on import.
from . import ngram, suffix, recycling, lookahead, hierarchy, layerskip, draft_model, kvdraft, bandit, medusa, hydra, eagle  # noqa: E402,F401
