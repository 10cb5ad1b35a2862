"""EAGLE: a one-layer draft network extrapolates the target's features and drafts a dynamic tree.

Papers: Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty" (the
network: ``fc(concat(embedding of the next token, feature))`` then one decoder layer, predicting the
next feature; the target's head turns it into tokens; ``speculative/trained/networks.py``); Li et al.
2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" (the tree). Lossless:
the drafter only proposes; the verifiers accept greedily (output token-identical to plain greedy)
or with the keyed sampling verifier (deterministic drafts: plain sampling's tokens).

Choices the papers leave open (each one tested):
  * The draft network keeps its own key/value cache of the committed pairs (feature j, token j + 1),
    made from the target's true features as verifications and plain steps compute them
    (``last_features``); drafted positions use the network's own predicted features, and their
    entries live only for the draft. Where the cache kept a prompt's beginning from the last request
    (a chat's next turn) and reads only the rest, the features of that beginning come from the
    last request (``FeatureHistory``): the network sees the whole context, as the paper's does.
  * EAGLE-2's expansion: each level expands the ``candidates`` nodes of the newest level with the highest
    path confidence (the product of draft probabilities along the path), each into its ``candidates``
    best tokens; growth stops at ``max_depth`` (and at the budget's depth), when the level's best
    confidence falls below ``min_confidence``, or once ``budget`` nodes are at least as confident as
    the level's best (no deeper node could then be kept: the same tree, fewer draft passes); the tree
    returned is the ``budget`` most confident nodes (ancestors included), in topological order.
"""

from __future__ import annotations

import torch

from ...engine.core import DecodeState
from ...options import OptionSpec, option_table
from ..tree import DraftTree, select_nodes
from . import register_drafter
from .base import TRAINED_OPTIONS, FeatureDrafter

OPTIONS = option_table(
    TRAINED_OPTIONS,
    OptionSpec("max_depth", int, 6, "deepest draft level", lo=1, hi=64),
    OptionSpec("min_confidence", float, 0.02, "stop growing when a level's best path confidence is below this", lo=0.0, hi=1.0),
)


class EagleDrafter(FeatureDrafter):
    """EAGLE's draft network with EAGLE-2's dynamic tree; see the module docstring."""

    name = kind = "eagle"
    reads_earlier_features = True

    def __init__(self, *, drafter: str | None = None, candidates: int = 4, max_depth: int = 6, min_confidence: float = 0.02):
        super().__init__(drafter=drafter, candidates=candidates)
        self.max_depth = OPTIONS["max_depth"].parse(max_depth)
        self.min_confidence = OPTIONS["min_confidence"].parse(min_confidence)

    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        self.first = self.chunk_start  # pair j is (feature j, token j + 1), from the first known feature on
        self.past: tuple[torch.Tensor, torch.Tensor] | None = None  # the committed pairs' keys and values
        self.pairs = 0  # committed pairs: pair j = (feature j, token j + 1) for j = first .. first + pairs - 1
        self.ahead: torch.Tensor | None = None  # the network's output for the last committed pair

    def _commit_pairs(self, state: DecodeState, upto: int) -> None:
        """Run the pairs not yet in the network's cache, up to pair ``upto - 1``."""
        start = self.first + self.pairs
        if start >= upto:
            return
        features = self.features_from(start)[: upto - start]
        tokens = torch.tensor(state.tokens[start + 1 : upto + 1])
        embeds = state.backend.token_embeddings(tokens)
        n, held = upto - start, self.pairs
        visible = torch.ones(n, held + n, dtype=torch.bool)
        visible[:, held:] = torch.ones(n, n, dtype=torch.bool).tril()
        out, (k, v) = self.net(features[None], embeds[None], torch.arange(start, upto), visible, self.past)
        self.past = (k, v) if self.past is None else (torch.cat([self.past[0], k], 2), torch.cat([self.past[1], v], 2))
        self.pairs += n
        self.ahead = out[0, -1]

    def draft(self, state: DecodeState, budget: int) -> DraftTree:
        tree = DraftTree()
        n = len(state.tokens)  # the root sits at position n - 1
        if budget <= 0 or self.known != n - 1:
            return tree
        with torch.inference_mode():
            self._commit_pairs(state, n - 1)  # the last pair holds the root: its output predicts the root's child
            if self.ahead is None:
                return tree
            return self._grow(state, tree, budget, n)

    def _grow(self, state: DecodeState, tree: DraftTree, budget: int, n: int) -> DraftTree:
        net, k, held = self.net, self.candidates, self.pairs
        scores: list[float] = []  # each node's path confidence
        parent_feature: dict[int, torch.Tensor] = {}  # the predicted feature at a node's parent's position
        children = self._add_children(tree, scores, parent_feature, [-1], self.ahead[None], 1.0)
        run: list[int] = []  # nodes whose pair is in the draft cache, in the order of its rows
        keys = values = None
        for depth in range(1, min(self.max_depth, budget)):  # a kept node's ancestors are kept: depth <= budget
            frontier = sorted(children, key=lambda i: -scores[i])[:k]
            if scores[frontier[0]] < self.min_confidence or not _can_enter(scores, scores[frontier[0]], budget):
                break
            visible = torch.zeros(len(frontier), held + len(run) + len(frontier), dtype=torch.bool)
            visible[:, :held] = True
            for row, node in enumerate(frontier):
                visible[row, held + len(run) + row] = True
                parent = tree.parents[node]
                while parent >= 0:
                    visible[row, held + run.index(parent)] = True
                    parent = tree.parents[parent]
            past = self.past if keys is None else (torch.cat([self.past[0], keys], 2), torch.cat([self.past[1], values], 2))
            features = torch.stack([parent_feature[i] for i in frontier])
            embeds = state.backend.token_embeddings(torch.tensor([tree.tokens[i] for i in frontier]))
            positions = torch.full((len(frontier),), n - 2 + depth)  # a depth-d node's pair sits at n - 2 + d
            out, (new_k, new_v) = net(features[None], embeds[None], positions, visible, past)
            keys = new_k if keys is None else torch.cat([keys, new_k], 2)
            values = new_v if values is None else torch.cat([values, new_v], 2)
            run.extend(frontier)
            children = self._add_children(tree, scores, parent_feature, frontier, out[0], None)
        # a child scores at most its parent (a probability times it) and was added after it: the best
        # `budget` nodes by a stable sort hold every kept node's ancestors
        keep = sorted(range(len(tree)), key=lambda i: -scores[i])[:budget]
        return select_nodes(tree, keep)

    def _add_children(self, tree: DraftTree, scores: list[float], parent_feature: dict, parents: list[int],
                      predicted: torch.Tensor, root_score: float | None) -> list[int]:
        """Hang each parent's ``candidates`` tokens under it (``predicted``: the feature at each parent's
        position, one row per parent); returns the new nodes."""
        probs = torch.softmax(self.net.head(predicted), dim=-1)
        top = probs.topk(min(self.candidates, probs.shape[-1]), dim=-1)  # a small draft vocabulary has fewer
        vocab = self.net.head.vocab
        added = []
        for row, parent in enumerate(parents):
            base = root_score if parent < 0 else scores[parent]
            for p, i in zip(top.values[row].tolist(), top.indices[row].tolist()):
                child = tree.add(int(vocab[i]), parent, self.name)
                scores.append(base * p)
                parent_feature[child] = predicted[row]
                added.append(child)
        return added


def _can_enter(scores: list[float], best: float, budget: int) -> bool:
    """Whether a node below one of confidence ``best`` could be among the ``budget`` most confident:
    a path's confidence never grows with depth, and a new node loses ties to the nodes before it
    (the selection's sort is stable), so once ``budget`` nodes reach ``best``, deeper levels would be
    drafted for nothing (EAGLE-2 reranks the whole tree the same way)."""
    return len(scores) < budget or sum(score >= best for score in scores) < budget


register_drafter(
    "eagle", "a trained EAGLE draft network on the target's features, dynamic trees (decodekit train-drafter --kind eagle)",
    options=OPTIONS,
)(EagleDrafter)
