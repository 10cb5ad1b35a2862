"""The stop-string rule, in one place for the decode loop, search methods and the benchmark.

A generation stops as soon as its text contains one of the stop strings. The returned text is cut
just before the first occurrence; the returned tokens are those whose text lies wholly before it,
so they never carry any part of a stop string (a token that straddles the cut is dropped, and
its characters before the cut stay in the text only).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import InvalidParameter

#: Tokens decoded at the end of the output to look for a stop string, at least; a longer stop
#: string widens the window (a character takes at most four byte-level tokens).
MIN_WINDOW = 64


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """Validated stop strings: one string is one stop string (not its characters); empty ones are dropped."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
        raise InvalidParameter(f"stop must be a string or a list of strings, got {stop!r}")
    return tuple(s for s in stop if s)


def hits_stop(tokenizer, tokens: Sequence[int], stop: Sequence[str], added: int = 1) -> bool:
    """Whether the text of ``tokens``, the last ``added`` of them new, now contains a stop string
    (decodes only the tail that can: one that ends in a new token; a speculative step adds many)."""
    if not stop:
        return False
    window = max(MIN_WINDOW, 4 * max(len(s) for s in stop) + 4) + max(0, added - 1)
    text = tokenizer.decode(list(tokens[-window:]))
    return any(s in text for s in stop)


def cut_at_stop(tokenizer, tokens: list[int], stop: Sequence[str]) -> tuple[str, list[int], str | None]:
    """Decode ``tokens`` and cut at the first stop string: (text, tokens before it, the stop string hit or None)."""
    text = tokenizer.decode(tokens)
    hits = [(text.find(s), s) for s in stop if s and s in text]
    if not hits:
        return text, tokens, None
    cut, hit = min(hits)
    text = text[:cut]
    kept = 0
    while kept < len(tokens) and len(tokenizer.decode(tokens[: kept + 1])) <= cut:
        kept += 1
    return text, tokens[:kept], hit
