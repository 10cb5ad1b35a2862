"""Search methods declare their options as :class:`~decodekit.options.OptionSpec` tables beside
each method (``beam.OPTIONS``, ``select.SAMPLING_OPTIONS``, ...); the registry checks the values a
request gives. ``builder`` makes the registry's ``build``: the table's defaults, then the given values."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..options import OptionSpec


def builder(specs: Mapping[str, OptionSpec], factory: Callable[..., Any]) -> Callable[..., Any]:
    """A registry ``build(**options)`` (options already checked) calling ``factory`` with every option."""
    defaults = {name: spec.default for name, spec in specs.items()}

    def build(**options: Any) -> Any:
        return factory(**{**defaults, **options})

    return build
