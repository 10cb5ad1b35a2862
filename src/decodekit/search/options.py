"""Declarative method options: each search method lists its options once; values coming from the
CLI (``--opt key=value``, already typed) or Python are checked here and errors are one line."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidParameter


@dataclass(frozen=True)
class Option:
    """One option: ``kind`` is int, float, choice, bool, str, or any (passed through unchecked)."""

    kind: str
    default: Any
    help: str = ""
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    allow_callable: bool = False  # a Python callable is accepted instead of a choice
    allow_none: bool = False

    def check(self, name: str, value: Any) -> Any:
        if value is None and self.allow_none:
            return None
        if self.allow_callable and callable(value):
            return value
        checker = getattr(self, "_" + self.kind)
        return checker(name, value)

    def _int(self, name: str, value: Any) -> int:
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise InvalidParameter(f"{name} must be an integer, got {value!r}")
        return int(self._bounds(name, value))

    def _float(self, name: str, value: Any) -> float:
        try:
            number = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise InvalidParameter(f"{name} must be a finite number, got {value!r}")
        return self._bounds(name, number)

    def _bounds(self, name: str, value: float) -> float:
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            lo = "-inf" if self.lo is None else f"{self.lo:g}"
            hi = "inf" if self.hi is None else f"{self.hi:g}"
            raise InvalidParameter(f"{name} must be in [{lo}, {hi}], got {value!r}")
        return value

    def _choice(self, name: str, value: Any) -> str:
        if value not in self.choices:
            extra = " or a callable" if self.allow_callable else ""
            raise InvalidParameter(f"{name} must be one of {', '.join(self.choices)}{extra}, got {value!r}")
        return value

    def _bool(self, name: str, value: Any) -> bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise InvalidParameter(f"{name} must be true or false, got {value!r}")
        return value

    def _str(self, name: str, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise InvalidParameter(f"{name} must be a non-empty string, got {value!r}")
        return value

    def _any(self, name: str, value: Any) -> Any:
        return value


def parse_options(method: str, specs: Mapping[str, Option], options: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults overridden by ``options``; unknown names and bad values raise InvalidParameter."""
    unknown = sorted(set(options) - set(specs))
    if unknown:
        known = ", ".join(sorted(specs)) or "none"
        raise InvalidParameter(f"method {method!r} has no option {', '.join(unknown)} (options: {known})")
    return {name: spec.check(name, options.get(name, spec.default)) for name, spec in specs.items()}


def builder(method: str, specs: Mapping[str, Option], factory: Callable[..., Any]) -> Callable[..., Any]:
    """A registry ``build(**options)``: validate, then ``factory(**validated)``."""

    def build(**options: Any) -> Any:
        return factory(**parse_options(method, specs, options))

    build.options = dict(specs)  # type: ignore[attr-defined]  # read by `decodekit eval`
    return build
