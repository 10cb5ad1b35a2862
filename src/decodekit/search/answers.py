"""Answer extraction shared by voting, CoT-decoding, uncertainty signals and the eval tasks.

Modes: ``number`` (the last number in the text, its thousands' commas removed, ``12.0`` -> ``12``, ``.5`` -> ``0.5``,
``007`` -> ``7``, digits of any script written as ASCII digits, full-width ``４２`` -> ``42``; a hyphen after a
letter or digit, as in ``pages 3-4``, is not a minus sign), ``line`` (the first non-empty line, normalised),
``text`` (the whole text, normalised), ``auto`` (the last number when there is one, else the first line). A
callable ``text -> str | None`` may replace a mode.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Callable
from numbers import Integral

from ..errors import InvalidParameter
from ..options import OptionSpec, any_value

ANSWER_MODES = ("auto", "number", "line", "text")
# A number: an optional sign (the Unicode minus too; a dollar sign may follow it), then digits with commas only
# between groups of three (so "1,2,3" is three numbers), then decimals, or a leading point's decimals;
# never a piece of a longer run of digits and dots ("1.5.2" is 1.5 and nothing more, not 0.2), though
# a number may follow dots that end no digits ("so...42").
NUMBER = re.compile(r"(?<!\d)(?<!\d\.)(?:[-\u2212]\$?)?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<![\d.])\.\d+)")

Extractor = Callable[[str], "str | None"]


def is_punctuation(c: str) -> bool:
    """ASCII punctuation and symbols, and punctuation of any script (Unicode category P*): a model
    writes a curly apostrophe, an en dash, guillemets or an ideographic full stop as often as their
    ASCII forms, and "N’Djamena" must read as "N'Djamena" does."""
    return c in string.punctuation or unicodedata.category(c).startswith("P")


def normalize_text(text: str) -> str:
    """Lower case, accents removed (NFKD), punctuation (:func:`is_punctuation`) read as a space (so
    "Port-au-Prince" is "port au prince", as written either way), whitespace collapsed."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = "".join(" " if is_punctuation(c) else c for c in text)
    return " ".join(text.split())


def normalize_number(raw: str) -> str:
    value = raw.replace(",", "").replace("$", "").replace("\u2212", "-")
    value = "".join(str(unicodedata.decimal(c)) if c.isdecimal() else c for c in value)  # ４２, ٤٢ -> 42
    sign, value = ("-", value[1:]) if value.startswith("-") else ("", value)
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    whole, dot, fraction = value.partition(".")
    value = (whole.lstrip("0") or "0") + dot + fraction
    return "0" if value == "0" else sign + value


def last_number_span(text: str) -> tuple[int, int] | None:
    """Character span of the last number in ``text`` (:data:`NUMBER` ends on a digit: a trailing
    sentence period or comma is never part of it)."""
    found = list(NUMBER.finditer(text))  # (every match holds a digit)
    if not found:
        return None
    m = found[-1]
    start, end = m.start(), m.end()
    if text[start] in "-\u2212" and start > 0 and text[start - 1].isalnum():  # a range or a date: 3-4, 2024-05
        start += 1
    return start, end


def extract_number(text: str) -> str | None:
    span = last_number_span(text)
    return normalize_number(text[span[0] : span[1]]) if span else None


def extract_line(text: str) -> str | None:
    for line in text.splitlines():
        norm = normalize_text(line)
        if norm:
            return norm
    return None


def extract_text(text: str) -> str | None:
    return normalize_text(text) or None


def extract_auto(text: str) -> str | None:
    return extract_number(text) or extract_line(text)


_EXTRACTORS: dict[str, Extractor] = {
    "auto": extract_auto,
    "number": extract_number,
    "line": extract_line,
    "text": extract_text,
}


def answer_start(text: str, mode: str | Extractor) -> int:
    """Character offset where the answer begins: the last number for ``number``/``auto`` (when
    there is one), else 0 (line/text modes and callables cover the whole text)."""
    if mode in ("number", "auto"):
        span = last_number_span(text)
        if span:
            return span[0]
    return 0


def extractor(mode: str | Extractor) -> Extractor:
    """The extraction function for a mode name (or the callable itself)."""
    return mode if callable(mode) else _EXTRACTORS[mode]


def mode_of(answer: str | Extractor) -> str | Extractor:
    """The mode name of a built-in extractor given as a function (an eval task's ``extract_number``
    is the ``number`` mode: its answer span is the last number), else ``answer`` itself."""
    return next((name for name, fn in _EXTRACTORS.items() if answer is fn), answer)


ANSWER_START_OPTION = OptionSpec("answer_start", object, None,
                                 "Python callable text -> offset where the answer begins (phi_first)", local=any_value)


def checked_answer(fn: Callable[[str], str | None]) -> Callable[[str], str | None]:
    """A user's ``answer`` callable, held to returning a string or None (no answer)."""
    def extract(text: str) -> str | None:
        value = fn(text)
        if value is not None and not isinstance(value, str):
            raise InvalidParameter(f"the answer callable must return a string or None, got {value!r}", param="answer")
        return value
    return extract


def checked_start(fn: Callable[[str], int]) -> Callable[[str], int]:
    """A user's ``answer_start`` callable, held to returning an offset into the text."""
    def start(text: str) -> int:
        value = fn(text)
        if not isinstance(value, Integral) or isinstance(value, bool) or not 0 <= value <= len(text):
            raise InvalidParameter(f"the answer_start callable must return an offset in [0, {len(text)}] into the "
                                   f"text, got {value!r}", param="answer_start")
        return int(value)
    return start


def answer_functions(answer: str | Callable[[str], str | None], start: Callable[[str], int] | None,
                     ) -> tuple[Callable[[str], str | None], Callable[[str], int]]:
    """A method's answer extractor and answer-start finder, from its ``answer`` mode or callable and
    its optional ``answer_start`` callable ``start`` (a task's own, such as an eval task's)."""
    if start is not None and not callable(start):
        raise InvalidParameter(f"answer_start must be a Python callable text -> offset (given from Python, not as "
                               f"text), got {start!r}")
    extract = checked_answer(answer) if callable(answer) else extractor(answer)
    return extract, checked_start(start) if start else (lambda text: answer_start(text, mode_of(answer)))
