"""Options: each declared once as an :class:`OptionSpec`, every value read by one parser.

Sampler parameters, methods, drafters and the speculative loop's common options all declare
their options as tables of ``OptionSpec`` (name, type, default, range or choices, help). The
registry checks a method's options against its table, ``decodekit methods`` lists them, and the
command line builds its sampler flags from the sampler's table.

A value arrives typed (from Python) or as text (``--opt key=value``). :meth:`OptionSpec.parse`
turns text into the declared type (one boolean parser: true/false, yes/no, 1/0) and checks it;
:meth:`OptionSpec.check` only checks. Any bad value or unknown name raises
:class:`~decodekit.errors.InvalidParameter` naming the option, in one line.

The bottom layer, beside ``errors``: imports nothing else from decodekit.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InvalidParameter

TRUE_WORDS = frozenset({"true", "yes", "1"})
FALSE_WORDS = frozenset({"false", "no", "0"})


# Checks ----------------------------------------------------------------------------------------------


def _fmt(x: float) -> str:
    return "inf" if x == math.inf else "-inf" if x == -math.inf else f"{x:g}"


def shown(value: Any, width: int = 60) -> str:
    """``repr(value)`` for an error message, cut to ``width`` characters (a 400-digit integer, a
    pasted document)."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def finite(value: numbers.Real) -> bool:
    """Whether a real number is finite as a float (an integer too large for a float is not: it has
    no float value, and math.isfinite raises on it)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_count(value: Any) -> bool:
    """Whether ``value`` is an int >= 0 (a bool is no count): what a file read back must hold for one."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_finite_number(value: Any) -> bool:
    """Whether ``value`` is an int or a float (no bool) with a finite float value."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and finite(value)


def is_measure(value: Any) -> bool:
    """Whether ``value`` is a finite number >= 0 (no bool): a time, a rate or a share read back."""
    return is_finite_number(value) and value >= 0


def check_real(name: str, value: Any, lo: float = -math.inf, hi: float = math.inf, *,
               lo_open: bool = False, hi_open: bool = False) -> float:
    """``float(value)`` if it is a finite real number in the interval (bools rejected), else InvalidParameter."""
    if lo == -math.inf and hi == math.inf:
        allowed = "a finite number"
    elif hi == math.inf:
        allowed = f"a finite number {'>' if lo_open else '>='} {_fmt(lo)}"
    elif lo == -math.inf:
        allowed = f"a finite number {'<' if hi_open else '<='} {_fmt(hi)}"
    else:
        allowed = f"in {'(' if lo_open else '['}{_fmt(lo)}, {_fmt(hi)}{')' if hi_open else ']'}"
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and finite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        raise InvalidParameter(f"{name} must be {allowed}, got {shown(value)}")
    return float(value)


def check_int(name: str, value: Any, lo: int | None = 1, hi: int | None = None) -> int:
    """``value`` if it is an integer in ``[lo, hi]`` (None: unbounded; bools rejected), else InvalidParameter."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok or (lo is not None and value < lo) or (hi is not None and value > hi):
        allowed = ("" if lo is None and hi is None else f" <= {hi}" if lo is None
                   else f" >= {lo}" if hi is None else f" in [{lo}, {hi}]")
        raise InvalidParameter(f"{name} must be an integer{allowed}, got {shown(value)}")
    return int(value)


def parse_bool(name: str, value: Any) -> bool:
    """The one boolean parser: a bool, or the words true/false, yes/no, 1/0 (any case)."""
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS | FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    if not isinstance(value, bool):
        raise InvalidParameter(f"{name} must be true or false (yes/no, 1/0), got {shown(value)}")
    return value


# Specs -----------------------------------------------------------------------------------------------


def any_value(value: Any) -> bool:
    """:attr:`OptionSpec.local` of an option every value of which is local (a file, a Python object)."""
    return True


@dataclass(frozen=True)
class OptionSpec:
    """One option.

    ``type`` is int, float, bool, str, Path (a file's path: text or a ``Path``, given as text), dict (a
    mapping) or object (any Python value, unchecked).
    Numbers must lie in ``[lo, hi]`` (an end is open when asked); a str with ``choices`` must be
    one of them. ``allow_callable``: a Python callable is accepted too (a custom scorer, an answer
    extractor). In a table (:func:`parse_options`), an option whose default is None is off when None.
    ``local``: whether a value names something of this machine (a file, a model to load, a Python
    object); a server refuses such a value from a request (:func:`any_value` for every value).
    """

    name: str
    type: type
    default: Any = None
    help: str = ""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[str, ...] = ()
    allow_callable: bool = False
    local: Callable[[Any], bool] | None = None

    def check(self, value: Any) -> Any:
        """``value`` checked against the spec (no conversion from text)."""
        if self.allow_callable and callable(value):
            return value
        name = self.name
        if self.type is bool:
            if not isinstance(value, bool):  # typed values are strict: 1 is not a bool
                raise InvalidParameter(f"{name} must be true or false, got {shown(value)}")
            return value
        if self.type is int:
            return check_int(name, value, None if self.lo is None else int(self.lo), None if self.hi is None else int(self.hi))
        if self.type is float:
            lo = -math.inf if self.lo is None else self.lo
            hi = math.inf if self.hi is None else self.hi
            return check_real(name, value, lo, hi, lo_open=self.lo_open, hi_open=self.hi_open)
        if self.type is Path and isinstance(value, os.PathLike):  # a file's path, as text or a Path
            value = os.fspath(value)
        if self.type in (str, Path):
            if self.choices and value not in self.choices:
                extra = " or a callable" if self.allow_callable else ""
                raise InvalidParameter(f"{name} must be one of {', '.join(self.choices)}{extra}, got {shown(value)}")
            if not isinstance(value, str) or not value:
                raise InvalidParameter(f"{name} must be a non-empty string, got {shown(value)}")
            return value
        if self.type is dict:
            if not isinstance(value, Mapping):
                raise InvalidParameter(f"{name} must be a mapping, got {shown(value)}")
            return value
        return value  # object: any Python value

    def parse(self, value: Any) -> Any:
        """``value`` (typed, or text from the command line) converted to the spec's type and checked."""
        if isinstance(value, str) and self.type in (int, float, bool, dict):
            value = self.from_text(value)
        return self.check(value)

    def from_text(self, text: str) -> Any:
        """Text to the spec's type; text that does not convert is returned as is (``check`` names it)."""
        if self.type is bool:
            return parse_bool(self.name, text)
        if self.type is int or self.type is float:
            try:
                return self.type(text.strip())
            except ValueError:
                return text
        if self.type is dict:  # a JSON object, e.g. --opt 'cost_table={"1": 0.004, "8": 0.006}'
            try:
                value = json.loads(text)
            except ValueError:
                return text
            return value if isinstance(value, dict) else text
        return text

    def describe(self) -> str:
        """One line for listings, e.g. ``n (int >= 1, default 4): beam width``."""
        if self.choices:
            kind = " | ".join(self.choices) + (" | callable" if self.allow_callable else "")
        else:
            kind = {object: "any", dict: "mapping", Path: "path"}.get(self.type, self.type.__name__) + self._bounds()
        default = "off by default" if self.default is None else f"default {self.default!r}"
        return f"{self.name} ({kind}, {default})" + (f": {self.help}" if self.help else "")

    def _bounds(self) -> str:
        lo, hi = self.lo, self.hi
        if lo is None and hi is None:
            return ""
        if hi is None:
            return f" {'>' if self.lo_open else '>='} {_fmt(lo)}"
        if lo is None:
            return f" {'<' if self.hi_open else '<='} {_fmt(hi)}"
        return f" in {'(' if self.lo_open else '['}{_fmt(lo)}, {_fmt(hi)}{')' if self.hi_open else ']'}"


def option_table(*parts: OptionSpec | Mapping[str, OptionSpec]) -> dict[str, OptionSpec]:
    """``{name: spec}`` from specs and whole tables, in order; a later spec of a name replaces an earlier one."""
    table: dict[str, OptionSpec] = {}
    for part in parts:
        table.update({part.name: part} if isinstance(part, OptionSpec) else part)
    return table


def keyword_signature(specs: Mapping[str, OptionSpec], *leading: str) -> inspect.Signature:
    """The signature of a function taking ``**options`` from ``specs``, for ``help()`` and
    ``inspect``: the ``leading`` positional names (e.g. "cls"), then one keyword per option."""
    params = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in leading]
    params += [inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, default=spec.default,
                                 annotation=spec.type if spec.default is not None else spec.type | None)
               for spec in specs.values()]
    return inspect.Signature(params)


def parse_options(owner: str, specs: Mapping[str, OptionSpec], values: Mapping[str, Any], *,
                  text: bool = True, defaults: bool = True) -> dict[str, Any]:
    """``values`` checked against ``specs`` (``text``: strings are parsed first), plus the defaults
    of the options not given (``defaults``). ``owner`` names what takes them, e.g. "method 'pld'"."""
    unknown = sorted(set(values) - set(specs))
    if unknown:
        if not specs:
            raise InvalidParameter(f"{owner} takes no options, got: {', '.join(unknown)}", param=unknown[0])
        raise InvalidParameter(f"{owner} has no option {', '.join(map(repr, unknown))}; "
                               f"valid options: {', '.join(sorted(specs))}", param=unknown[0])
    out = {name: spec.default for name, spec in specs.items()} if defaults else {}
    for name, value in values.items():
        spec = specs[name]
        if value is None and spec.default is None:
            out[name] = None
        else:
            out[name] = spec.parse(value) if text else spec.check(value)
    return out


# Text from the command line --------------------------------------------------------------------------


def literal(text: str) -> Any:
    """A value of unknown type from text: true/false as bool, then int, float, else the string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_option_items(items: Sequence[str], specs: Mapping[str, OptionSpec] | None = None,
                       prefix: str = "") -> dict[str, Any]:
    """``--opt`` items as one dict, each parsed by :func:`parse_option`; a key given twice is refused
    (never one value silently over another). ``prefix``: what the items were written after (bench's
    ``METHOD.``), for the message."""
    options: dict[str, Any] = {}
    for item in items:
        key, value = parse_option(item, specs)
        if key in options:
            raise InvalidParameter(f"--opt {prefix}{key}=... is given twice; give one")
        options[key] = value
    return options


def parse_option(text: str, specs: Mapping[str, OptionSpec] | None = None) -> tuple[str, Any]:
    """``key=value`` (``--opt``) as ``(key, value)``: the value parsed by the key's spec when
    ``specs`` has one, else read by :func:`literal`."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise InvalidParameter(f"--opt expects key=value, got {text!r}")
    spec = (specs or {}).get(key)
    return key, spec.parse(raw) if spec is not None else literal(raw)
