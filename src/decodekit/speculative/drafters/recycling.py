"""Token Recycling (Luo et al. 2024, "Turning trash into treasure: accelerating inference of
large language models with token recycling").

An adjacency matrix keeps, for every token, its top-k successors taken from earlier
verification logits (``vocab x k`` int32, 1.5 MB for SmolLM2 with k = 8). Drafting expands a
tree from the root token through the matrix; after each verification every scored position
(root and all tree nodes, accepted or not) refreshes its token's row with the top-k of its
logits — the "trash" candidates are recycled. The matrix lives in the backend's memory,
so it keeps learning across requests, plain steps included (the refresh costs a top-k of the
vocabulary per step, hence ``topk.c``: with torch.topk, recycling was measurably slower than
plain decoding when it did not speculate). Model-free at draft time; lossless through the
verifier.

Choice the paper leaves open: its static tree was tuned offline; ours is the best-first tree
under fixed per-rank weights ``RANK_WEIGHTS`` (so its shape depends only on the budget, and the
controller then trims it by learned acceptance). Rows never filled hold -1 and end a branch.
"""

from __future__ import annotations

import torch

from ...engine.core import DecodeState
from ...models.backend import Backend
from ...models.kernels import top_k_indices
from ...options import OptionSpec, option_table
from ..tree import DraftTree, Verification, grow_best_first
from . import register_drafter
from .base import Drafter

# Relative weight of a node's r-th successor: how likely, a priori, the r-th ranked guess is right.
RANK_WEIGHTS = (0.55, 0.18, 0.08, 0.05, 0.035, 0.025, 0.02, 0.015, 0.012, 0.01, 0.008, 0.006, 0.005, 0.004, 0.003, 0.002)


def adjacency_for(backend: Backend, k: int) -> torch.Tensor:
    """This backend's successor matrix (created empty, -1, on first use; kept across requests in
    the backend's memory; a request asking for more columns than it has starts a wider one)."""
    held: dict[str, torch.Tensor] = backend.memory("recycling.successors", dict)
    matrix = held.get("matrix")
    if matrix is None or matrix.shape[1] < k:
        matrix = held["matrix"] = torch.full((backend.info.vocab_size, k), -1, dtype=torch.int32)
    return matrix


OPTIONS = option_table(
    OptionSpec("k", int, 8, "successors kept per token", lo=1, hi=len(RANK_WEIGHTS)),
    OptionSpec("max_depth", int, 8, "tree depth cap", lo=1),
)


@register_drafter("recycling", "token recycling: a top-k successor table refreshed from verification logits",
                  options=OPTIONS)
class TokenRecycling(Drafter):
    name = "recycling"

    def __init__(self, k: int = 8, max_depth: int = 8):
        self.k = OPTIONS["k"].parse(k)
        self.max_depth = OPTIONS["max_depth"].parse(max_depth)

    def begin(self, state: DecodeState) -> None:
        self.matrix = adjacency_for(state.backend, self.k)
        self.rows: dict[int, list[int]] = {}  # rows read this step (a token may appear at many nodes)

    def _successors(self, token: int) -> list[tuple[int, float, int]]:
        row = self.rows.get(token)
        if row is None:
            row = self.rows[token] = self.matrix[token, : self.k].tolist()
        return [(t, RANK_WEIGHTS[r], t) for r, t in enumerate(row) if t >= 0]

    def draft(self, state: DecodeState, budget: int) -> DraftTree:
        self.rows = {}
        tree = DraftTree()
        grow_best_first(tree, self._successors(state.tokens[-1]), self._successors, budget, self.max_depth, self.name)
        return tree

    def update(self, state: DecodeState, tree: DraftTree, verdict: Verification, logits: torch.Tensor) -> None:
        rows = torch.tensor([state.tokens[-1], *tree.tokens])
        self.matrix[rows, : self.k] = top_k_indices(logits, self.k)
        # the columns past this request's k are an earlier, wider request's, stale now: a later wider
        # one would read them beside these (the same token twice among a node's successors)
        self.matrix[rows, self.k :] = -1
