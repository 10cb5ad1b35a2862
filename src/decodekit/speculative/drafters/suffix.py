"""Suffix-automaton drafting (SAM-Decoding, Hu et al. 2024; SuffixDecoding, Oliaro et al. 2024).

A suffix automaton over prompt + generated tokens, extended by one state per token (amortised
O(1), no rebuild per step), finds the longest suffix of the context that occurred before; the
tokens that followed its occurrences, ranked by occurrence count, are grown best-first into a
tree. As in SuffixDecoding, the tree may be as deep as ``growth`` x the match length (so long
matches draft far, short ones barely). With ``corpus=True`` a second automaton over earlier
outputs of the same model (kept across requests in the backend's memory, capped in size)
proposes too; the longer match drafts first, and of two as long the request's own context (the
nearer evidence). Model-free; lossless through the verifier.

Choices the papers leave open: occurrence counts are maintained incrementally along the
suffix-link path, which we cap at ``COUNT_WALK`` states per token (only pathological repetition
reaches it; it then undercounts short strings, which only affects ranking).
"""

from __future__ import annotations

import math

from ...engine.core import DecodeState
from ...models.backend import Backend
from ...options import OptionSpec, option_table
from ..tree import DraftTree, grow_best_first, merge_into
from . import register_drafter
from .base import ContextDrafter

COUNT_WALK = 256
SEPARATOR = -1  # between corpus documents: never proposed, never matched across
CORPUS_LIMIT = 100_000  # tokens; beyond it the corpus keeps its newest half


class SuffixAutomaton:
    """The suffix automaton of a token sequence, with occurrence counts per state."""

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]
        self.link = [-1]
        self.length = [0]
        self.count = [0]
        self.last = 0
        self.size = 0  # tokens added

    def _new_state(self, length: int, link: int, nxt: dict[int, int], count: int) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.count.append(count)
        return len(self.next) - 1

    def extend(self, token: int) -> None:
        """Append one token (the standard online construction)."""
        nxt, link, length = self.next, self.link, self.length
        cur = self._new_state(length[self.last] + 1, 0, {}, 0)
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = self._new_state(length[p] + 1, link[q], dict(nxt[q]), self.count[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        self.size += 1
        # Every state on cur's suffix-link path gains this end position.
        s, steps = cur, 0
        while s > 0 and steps < COUNT_WALK:
            self.count[s] += 1
            s = link[s]
            steps += 1

    def advance(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """Longest match of (matched text + token): (state, length), following suffix links."""
        nxt, link, length = self.next, self.link, self.length
        while state and token not in nxt[state]:
            state = link[state]
            matched = length[state]
        if token in nxt[state]:
            return nxt[state][token], matched + 1
        return 0, 0

    def continuations(self, state: int, width: int) -> list[tuple[int, float, int]]:
        """Up to ``width`` next tokens after ``state``'s strings: (token, share of occurrences, state)."""
        options = [(self.count[s], t, s) for t, s in self.next[state].items() if t != SEPARATOR]
        if not options:
            return []
        options.sort(key=lambda o: (-o[0], o[1]))
        total = sum(o[0] for o in options)
        return [(t, c / total, s) for c, t, s in options[:width]]


class Corpus:
    """Earlier outputs of one model, as one automaton (documents separated by SEPARATOR)."""

    def __init__(self) -> None:
        self.documents: list[list[int]] = []
        self.automaton = SuffixAutomaton()

    def add(self, tokens: list[int]) -> None:
        if not tokens:
            return
        self.documents.append(list(tokens))
        if self.automaton.size + len(tokens) + 1 > CORPUS_LIMIT:
            keep, total = [], 0
            for doc in reversed(self.documents):
                if total + len(doc) > CORPUS_LIMIT // 2:
                    break
                keep.append(doc)
                total += len(doc) + 1
            self.documents = keep[::-1]
            self.automaton = SuffixAutomaton()
            for doc in self.documents:
                self._feed(doc)
        else:
            self._feed(tokens)

    def _feed(self, tokens: list[int]) -> None:
        self.automaton.extend(SEPARATOR)
        for t in tokens:
            self.automaton.extend(t)


def corpus_for(backend: Backend) -> Corpus:
    """The corpus of earlier outputs of this backend's model (kept in the backend's memory)."""
    return backend.memory("suffix.corpus", Corpus)


OPTIONS = option_table(
    OptionSpec("corpus", bool, False, "also draft from this model's earlier outputs"),
    OptionSpec("width", int, 4, "continuations followed per tree node", lo=1),
    OptionSpec("growth", float, 2.0, "tree depth cap as a multiple of the match length", lo=0.0, lo_open=True),
    OptionSpec("min_match", int, 1, "shortest match that drafts", lo=1),
    OptionSpec("max_depth", int, 32, "tree depth cap", lo=1),
)


@register_drafter("suffix", "suffix automaton over the context (and optionally earlier outputs): frequent continuations",
                  options=OPTIONS)
class SuffixDrafter(ContextDrafter):
    name = "suffix"

    def __init__(self, corpus: bool = False, width: int = 4, growth: float = 2.0, min_match: int = 1, max_depth: int = 32):
        self.use_corpus = OPTIONS["corpus"].parse(corpus)
        self.width = OPTIONS["width"].parse(width)
        self.growth = OPTIONS["growth"].parse(growth)
        self.min_match = OPTIONS["min_match"].parse(min_match)
        self.max_depth = OPTIONS["max_depth"].parse(max_depth)
        self.corpus: Corpus | None = None
        self.reset()

    def begin(self, state: DecodeState) -> None:
        self.corpus = corpus_for(state.backend) if self.use_corpus else None
        super().begin(state)

    def reset(self) -> None:
        self.automaton = SuffixAutomaton()
        self.corpus_match = (0, 0)  # (state, length) of the context's longest suffix in the corpus

    def push(self, tokens: list[int], position: int) -> None:
        self.automaton.extend(tokens[position])
        if self.corpus is not None:
            self.corpus_match = self.corpus.automaton.advance(*self.corpus_match, tokens[position])

    def draft(self, state: DecodeState, budget: int) -> DraftTree:
        self.sync(state)
        sam = self.automaton
        own = sam.link[sam.last]  # the longest suffix that also occurred earlier
        matches = [(sam.length[own], sam, own, "suffix")] if own > 0 else []
        if self.corpus is not None and self.corpus_match[1] > 0:
            state_, length = self.corpus_match
            matches.append((length, self.corpus.automaton, state_, "suffix:corpus"))
        matches.sort(key=lambda m: -m[0])  # (stable: of two as long, the context's first)
        tree = DraftTree()
        for length, automaton, start, source in matches:
            if length < self.min_match or len(tree) >= budget:
                continue
            depth = min(self.max_depth, max(1, math.floor(self.growth * length)))
            # grown to the whole budget: nodes the earlier match already drafted merge into it (a
            # part of only the room left would leave that room empty by as many nodes)
            part = DraftTree()
            grow_best_first(
                part,
                automaton.continuations(start, self.width),
                lambda s, a=automaton: a.continuations(s, self.width),
                budget,
                depth,
                source,
            )
            merge_into(tree, part, budget)
        return tree

    def finish(self, state: DecodeState) -> None:
        """Add this request's output to the corpus (when enabled): :attr:`DecodeState.output`,
        through its end-of-sequence token, without the tokens a verification accepted past that
        token or past a stop string, which the request never output."""
        if self.corpus is not None:
            self.corpus.add(state.output if state.output is not None else state.generated)
