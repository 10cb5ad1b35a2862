"""Draft trees: what a drafter proposes and a verifier accepts from.

A tree hangs below the *root*, the last chosen token, which is not yet in the cache. Node i
has token ``tokens[i]`` and parent ``parents[i]`` (-1 = the root); nodes are in topological
order. A chain is a tree whose node i has parent i - 1; plain decoding is the empty tree.
"""

from __future__ import annotations

import heapq
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

    def paths(self) -> list[list[int]]:
        """Each node's tokens from below the root down to it, inclusive."""
        paths: list[list[int]] = []
        for token, parent in zip(self.tokens, self.parents):
            paths.append(([] if parent < 0 else paths[parent]) + [token])
        return paths

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


# Tree-building helpers shared by the drafters -------------------------------------------------


def add_chain(tree: DraftTree, tokens: list[int], parent: int = -1, source: str = "") -> list[int]:
    """Hang ``tokens`` as a chain below ``parent``, reusing nodes that already spell a prefix of it
    (so several proposals sharing a start become one tree). Returns the node index of every token."""
    nodes: list[int] = []
    for token in tokens:
        existing = tree.child_with_token(parent, token)
        parent = existing if existing is not None else tree.add(token, parent, source)
        nodes.append(parent)
    return nodes


def merge_into(tree: DraftTree, other: DraftTree, budget: int) -> None:
    """Add ``other``'s nodes to ``tree`` (deduplicating shared prefixes) while ``tree`` has fewer
    than ``budget`` nodes. ``other``'s deterministic children only (its draft_probs are dropped)."""
    mapped: list[int] = []
    for i, (token, parent) in enumerate(zip(other.tokens, other.parents)):
        top = -1 if parent < 0 else mapped[parent]
        if top == -2:  # the parent was cut off by the budget
            mapped.append(-2)
            continue
        existing = tree.child_with_token(top, token)
        if existing is not None:
            mapped.append(existing)
        elif len(tree) < budget:
            mapped.append(tree.add(token, top, other.source[i] if other.source else ""))
        else:
            mapped.append(-2)


def select_nodes(tree: DraftTree, nodes: list[int]) -> DraftTree:
    """The subtree made of ``nodes`` (ancestor-closed, any order), reindexed in topological order.

    Children sampled without replacement (their parent has ``draft_probs``) can only be verified
    in draw order by recursive rejection sampling: the second draw is not distributed as q. So of
    such siblings only a prefix in draw order is kept (up to the first one not chosen), with
    everything below the dropped ones."""
    chosen = set(nodes)
    dropped: set[int] = set()
    seen_gap: set[int] = set()  # sampled parents whose children have had a gap in draw order
    for i, parent in enumerate(tree.parents):  # parents come before children
        if parent in dropped or (parent in tree.draft_probs and parent in seen_gap):
            dropped.add(i)
        elif i not in chosen:
            dropped.add(i)
            seen_gap.add(parent)
    keep = sorted(chosen - dropped)
    index = {old: new for new, old in enumerate(keep)}
    parents = [-1 if tree.parents[i] < 0 else index[tree.parents[i]] for i in keep]
    probs = {(-1 if p < 0 else index[p]): q for p, q in tree.draft_probs.items() if p < 0 or p in index}
    source = [tree.source[i] for i in keep] if tree.source else []
    return DraftTree([tree.tokens[i] for i in keep], parents, probs, source)


def grow_best_first(
    tree: DraftTree,
    first: list[tuple[int, float, object]],
    expand,
    budget: int,
    max_depth: int,
    source: str,
    parent: int = -1,
) -> None:
    """Grow ``tree`` below ``parent`` best-first by path score until it holds ``budget`` nodes.

    ``first`` lists the candidate children of ``parent`` as (token, score, payload);
    ``expand(payload)`` lists a node's candidate children as (token, relative score, payload);
    a node's score is the product of relative scores along its path. Candidates must have
    distinct tokens among siblings. Nodes are added in descending score, so any prefix of the
    added nodes is the best tree of that size under the scores.
    """
    heap = [(-score, n, parent, 1, token, payload) for n, (token, score, payload) in enumerate(first)]
    heapq.heapify(heap)
    counter = len(heap)
    while heap and len(tree) < budget:
        neg, _, par, depth, token, payload = heapq.heappop(heap)
        node = tree.add(token, par, source)
        if depth < max_depth and len(tree) < budget:  # a full tree takes no more children: none to list
            for child, rel, child_payload in expand(payload):
                counter += 1
                heapq.heappush(heap, (neg * rel, counter, node, depth + 1, child, child_payload))
