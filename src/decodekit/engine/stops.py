"""The stop-string rule, in one place for the decode loop, search methods and the benchmark.

A generation stops as soon as its text contains one of the stop strings. The returned text is cut
just before the first occurrence; the returned tokens are those whose text lies wholly before it,
so they never carry any part of a stop string (a token that straddles the cut is dropped, and
its characters before the cut stay in the text only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import InvalidParameter

if TYPE_CHECKING:
    from ..models.tokenizer import Tokenizer

#: Tokens decoded at the end of the output to look for a stop string, at least; a longer stop
#: string widens the window (a character takes at most CHARACTER_BYTES byte-level tokens).
MIN_WINDOW = 64
#: Byte tokens one character takes at most (UTF-8).
CHARACTER_BYTES = 4


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """Validated stop strings: one string is one stop string (not its characters); an empty one is
    refused (every text contains it: dropped, the stop the user asked for would silently never come)."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
        raise InvalidParameter(f"stop must be a string or a list of strings, got {stop!r}")
    for s in stop:
        if not s:
            raise InvalidParameter("a stop string is empty (every text contains it); give non-empty stop strings",
                                   param="stop")
        try:  # a lone surrogate (bytes that were not UTF-8) is no text a model can write
            s.encode("utf-8")
        except UnicodeEncodeError as err:
            raise InvalidParameter(f"stop string {s!r} is not valid UTF-8 text (undecodable character at "
                                   f"position {err.start})", param="stop") from None
    return tuple(stop)


def hits_stop(tokenizer: Tokenizer, tokens: Sequence[int], stop: Sequence[str], added: int = 1) -> bool:
    """Whether the text of ``tokens``, the last ``added`` of them new, now contains a stop string
    (decodes only the tail that can: one that ends in a new token; a speculative step adds many)."""
    if not stop:
        return False
    longest = max(len(s) for s in stop)
    window = max(MIN_WINDOW, CHARACTER_BYTES * (longest + 1)) + max(0, added - 1)
    new = len(tokenizer.decode(list(tokens[-added:]))) if added > 0 else 0
    while True:
        text = settled(tokenizer.decode(list(tokens[-window:])))
        # the window holds a stop's whole length before the new text, or all there is: tokens that
        # decode to nothing (an EOS kept, special tokens) could otherwise leave a stop's start outside
        if len(text) >= longest + new or window >= len(tokens):
            return any(s in text for s in stop)
        window *= 2


def settled(text: str) -> str:
    """``text`` without the replacement characters at its end: they stand for a character whose
    tokens have not all come yet, where no stop string can be found (not even "\ufffd")."""
    return text.rstrip("\ufffd")


def decoded(tokenizer: Tokenizer, tokens: list[int]) -> str:
    """The text of ``tokens``. Where they end inside a character, the tokens before it are decoded
    apart from its bytes: a tokenizer may turn a whole run of byte tokens into replacement
    characters (Gemma's byte fallback does), the whole characters the run began with included,
    which a stream had already sent as they were."""
    text = tokenizer.decode(tokens)
    if not text.endswith("\ufffd"):
        return text
    for k in range(len(tokens) - 1, max(len(tokens) - CHARACTER_BYTES, 0) - 1, -1):
        head = tokenizer.decode(tokens[:k])
        if not head.endswith("\ufffd"):
            return head + tokenizer.decode(tokens[k:])
    return text


def cut_at_stop(tokenizer: Tokenizer, tokens: list[int], stop: Sequence[str]) -> tuple[str, list[int], str | None]:
    """Decode ``tokens`` (:func:`decoded`) and cut at the first stop string: (text, tokens before it,
    the stop string hit or None)."""
    text = decoded(tokenizer, tokens)
    searched = settled(text)
    hits = [(searched.find(s), s) for s in stop if s and s in searched]
    if not hits:
        return text, tokens, None
    cut, hit = min(hits)
    return text[:cut], tokens[:tokens_before(tokenizer, tokens, text, cut)], hit


def tokens_before(tokenizer: Tokenizer, tokens: list[int], text: str, cut: int) -> int:
    """How many of ``tokens`` (whose text is ``text``) lie wholly before character ``cut``: the
    longest run whose text is a prefix of ``text[:cut]``. A prefix that ends inside a character
    (byte tokens) decodes to replacement characters and is passed over, not taken as the end (a
    tokenizer may give one per byte, and even garble the character before).

    A longer run's settled text is no shorter (but where a tokenizer garbles the characters before
    an unfinished one, and those never match the text), so a bisection finds the longest run whose
    settled text fits before the cut, and the runs below it are tried from there down: a few
    decodes, where one per token made a long answer's last step take seconds."""
    low, high = 0, len(tokens)  # the settled text of tokens[:low] fits; of tokens[:high + 1], not
    while low < high:
        mid = (low + high + 1) // 2
        if len(settled(tokenizer.decode(tokens[:mid]))) <= cut:
            low = mid
        else:
            high = mid - 1
    for k in range(low, 0, -1):
        prefix = tokenizer.decode(tokens[:k])
        if len(prefix) <= cut and text.startswith(prefix):
            return k
    return 0


def through_stop(tokenizer: Tokenizer, tokens: list[int], text: str, hit: str, kept: int) -> list[int]:
    """``tokens`` up to the one that completes the stop string ``hit`` (cut from the end of ``text``,
    :func:`cut_at_stop`'s): what the model generated before it stopped, wherever a step ended (a
    speculative step or a search's step may run past the stop, and what came after is not counted)."""
    end = len(text) + len(hit)
    for k in range(max(kept, 1), len(tokens) + 1):
        if len(settled(decoded(tokenizer, tokens[:k]))) >= end:
            return tokens[:k]
    return tokens


def shown_tokens(tokenizer: Tokenizer, text: str, tokens: list[int], cut_off: Sequence[int]) -> list[int]:
    """The tokens whose text ``text`` shows, in whole or in part: ``tokens`` and, where a stop string
    cut inside a token (its characters before the cut stay in the text), the cut-off tokens up to
    the one that holds the text's end (a character split over byte tokens counts once all are in)."""
    shown = list(tokens)
    for token in cut_off:
        if len(settled(decoded(tokenizer, shown))) >= len(text):
            break
        shown.append(token)
    return shown
