"""Hydra: Medusa's heads made sequentially dependent, each reading the candidate path before it.

Paper: Ankner et al. 2024, "Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding" (the
network and its training: ``speculative/trained/``). Lossless: the heads only propose; the
verifiers accept greedily (output token-identical to plain greedy) or with the keyed sampling
verifier (the drafts are deterministic: plain sampling's tokens).

Choices the paper leaves open (each one tested):
  * The tree is grown per step best first by the product of the heads' probabilities along a path
    (as :mod:`.medusa` does; Hydra fixes one tree from validation accuracies). A node of depth d is
    expanded by head d on the feature, the root's token and the path's tokens down to the node, so
    siblings get different children, unlike Medusa's (whose head k offers the same candidates below
    every node of depth k); a node is expanded only while the tree still has room.
  * The feature is the one the last verification (or plain step) computed at the position before
    the root (``last_features``), as for Medusa: drafting runs no target pass.
"""

from __future__ import annotations

import torch

from ...engine.core import DecodeState
from ..tree import DraftTree, grow_best_first
from . import register_drafter
from .base import TRAINED_OPTIONS, FeatureDrafter


class HydraDrafter(FeatureDrafter):
    """Hydra heads (Ankner et al., 2024) on the target's last feature; see the module docstring."""

    name = kind = "hydra"

    def draft(self, state: DecodeState, budget: int) -> DraftTree:
        tree = DraftTree()
        feature = self.last_feature(state)
        if feature is None or budget <= 0:
            return tree
        embed = state.backend.token_embeddings

        def expand(path: tuple[torch.Tensor, int]) -> list[tuple[int, float, tuple[torch.Tensor, int]]]:
            """A node's candidate children: its path's inputs (the feature and the embeddings above
            it) with its own token's embedding added, through the head of the node's depth."""
            above, token = path
            inputs = torch.cat([above, embed(torch.tensor([token]))[0].float()])
            k = inputs.shape[0] // feature.shape[0] - 2
            probs = torch.softmax(self.net(k, inputs), dim=-1)
            top = probs.topk(min(self.candidates, probs.shape[-1]))  # a small draft vocabulary has fewer
            return [(vocab[i], p, (inputs, vocab[i])) for p, i in zip(top.values.tolist(), top.indices.tolist())]

        vocab = self.net.head.vocab.tolist()
        with torch.inference_mode():
            first = expand((feature.float(), state.tokens[-1]))  # head 0: the feature and the root's token
            grow_best_first(tree, first, expand, budget, self.net.config.heads, self.name)
        return tree


register_drafter(
    "hydra", "trained Hydra heads: Medusa's, each reading the drafted path (decodekit train-drafter --kind hydra)",
    options=TRAINED_OPTIONS,
)(HydraDrafter)
