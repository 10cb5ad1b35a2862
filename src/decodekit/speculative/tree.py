"""Draft trees: what a drafter proposes and a verifier accepts from.

A tree hangs below the *root*, the last chosen token, which is not yet in the cache. Node i
has token ``tokens[i]`` and parent ``parents[i]`` (-1 = the root); nodes are in topological
order. A chain is a tree whose node i has parent i - 1; plain decoding is the empty tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    # For sampled (stochastic) drafts: parent index (-1 = root) -> the draft distribution q [V]
    # the children of that node were drawn from. Parents absent here have deterministic
    # children (q is a point mass on each proposed child, in order).
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)
    source: list[str] = field(default_factory=list)  # which drafter proposed each node (hierarchy stats)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int], source: str = "") -> "DraftTree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), {}, [source] * len(tokens))

    def add(self, token: int, parent: int, source: str = "") -> int:
        """Append a node; return its index."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.source.append(source)
        return len(self.tokens) - 1

    def children(self, node: int) -> list[int]:
        """Indices of the children of ``node`` (-1 = root), in proposal order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def child_with_token(self, node: int, token: int) -> int | None:
        for i, p in enumerate(self.parents):
            if p == node and self.tokens[i] == token:
                return i
        return None

    def depth(self) -> int:
        depths: list[int] = []
        for p in self.parents:
            depths.append(0 if p < 0 else depths[p] + 1)
        return max(depths) + 1 if depths else 0

    def truncated(self, budget: int) -> "DraftTree":
        """The first ``budget`` nodes (a valid tree because nodes are topologically ordered)."""
        if budget >= len(self.tokens):
            return self
        keep = {p: q for p, q in self.draft_probs.items() if p < budget}
        return DraftTree(self.tokens[:budget], self.parents[:budget], keep, self.source[:budget])


@dataclass
class Verification:
    """A verifier's verdict: the accepted nodes (root-to-leaf path) and the bonus token after them."""

    path: list[int]
    bonus: int
