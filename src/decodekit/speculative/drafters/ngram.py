"""Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"): continue the context.

Match the last n tokens (n from ``max_ngram`` down to ``min_ngram``) against earlier positions
of prompt + generated text and propose the tokens that followed the most recent occurrences.
A model-free drafter; losslessness comes from the verifier. The context is indexed one token at
a time as it grows (:class:`~.base.ContextDrafter`).

Choices the reference leaves open, or where this one differs from it:
  * the reference drafts from the first match it finds; this drafter drafts from the most recent
    occurrences (``matches`` of them, as a tree), which follow the current topic more closely;
  * n-gram lengths ``max_ngram=3`` down to ``min_ngram``, longest first, as the reference;
  * ``pld:n`` names a source of one n-gram length only (the controller's per-length statistics).
"""

from __future__ import annotations

from ...engine.core import DecodeState
from ...errors import InvalidParameter
from ...options import OptionSpec, option_table
from ..tree import DraftTree, add_chain
from . import register_drafter
from .base import ContextDrafter

OPTIONS = option_table(
    OptionSpec("max_ngram", int, 3, "longest n-gram matched", lo=1),
    OptionSpec("min_ngram", int, 1, "shortest n-gram matched (<= max_ngram)", lo=1),
    OptionSpec("matches", int, 1, "most recent occurrences drafted, as one tree", lo=1),
)


@register_drafter("pld", "prompt lookup: propose what followed the last n-gram earlier in the context", options=OPTIONS)
class PromptLookup(ContextDrafter):
    """Prompt lookup decoding. ``matches`` > 1 hangs the continuations of that many most recent
    occurrences (of the longest matching n-gram) as one tree; shared prefixes are merged.

    Node sources are ``pld:n`` (n = matched n-gram length) so the controller learns how far each
    match length is worth drafting (our choice: longer matches are accepted far more often).
    """

    name = "pld"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, matches: int = 1):
        self.max_ngram = OPTIONS["max_ngram"].parse(max_ngram)
        self.min_ngram = OPTIONS["min_ngram"].parse(min_ngram)
        if self.min_ngram > self.max_ngram:
            raise InvalidParameter(f"min_ngram ({min_ngram}) must not exceed max_ngram ({max_ngram})")
        self.matches = OPTIONS["matches"].parse(matches)
        self.reset()

    def reset(self) -> None:
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of its last token

    def push(self, tokens: list[int], position: int) -> None:
        for n in range(self.min_ngram, min(self.max_ngram, position + 1) + 1):
            self.ends.setdefault(tuple(tokens[position - n + 1 : position + 1]), []).append(position)

    def draft(self, state: DecodeState, budget: int) -> DraftTree:
        self.sync(state)
        tokens = state.tokens
        tree = DraftTree()
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            ends = self.ends.get(tuple(tokens[-n:]), [])
            found = 0
            for end in reversed(ends[:-1]):  # the last entry is the current end of the context
                following = tokens[end + 1 : end + 1 + budget - len(tree)]
                if following:
                    add_chain(tree, following, -1, f"pld:{n}")
                    found += 1
                if found == self.matches or len(tree) >= budget:
                    break
            if found:
                return tree
        return tree
