"""Medusa: K trained heads on the target's last feature propose the next K tokens at once.

Paper: Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads" (the network and its training: ``speculative/trained/``). Lossless: the heads only propose;
the verifiers accept greedily (output token-identical to plain greedy) or with the keyed sampling
verifier (the drafts are deterministic: plain sampling's tokens).

Choices the paper leaves open (each one tested):
  * The tree is grown per step from the heads' own probabilities, best first by the product of the
    probabilities along a path (Medusa fixes one sparse tree from heads' validation accuracies;
    growing it per step uses the same estimate, for this step's candidates). Each head offers its
    ``candidates`` tokens; head k's candidates hang below every node of depth k.
  * The feature is the one the last verification (or plain step) computed at the last accepted
    position, read from the backend (``last_features``), so drafting runs no target pass.
"""

from __future__ import annotations

import torch

from ...engine.core import DecodeState
from ..tree import DraftTree, grow_best_first
from . import register_drafter
from .base import TRAINED_OPTIONS, FeatureDrafter


class MedusaDrafter(FeatureDrafter):
    """Medusa heads (Cai et al., 2024) on the target's last feature; see the module docstring."""

    name = kind = "medusa"

    def draft(self, state: DecodeState, budget: int) -> DraftTree:
        tree = DraftTree()
        feature = self.last_feature(state)
        if feature is None or budget <= 0:
            return tree
        with torch.inference_mode():
            probs = torch.softmax(self.net(feature), dim=-1)  # [K, N]
            top = probs.topk(min(self.candidates, probs.shape[-1]), dim=-1)  # a small draft vocabulary has fewer
        vocab = self.net.head.vocab.tolist()
        heads = [[(vocab[i], p, k + 1) for p, i in zip(top.values[k].tolist(), top.indices[k].tolist())]
                 for k in range(probs.shape[0])]
        grow_best_first(tree, heads[0], lambda k: heads[k], budget, len(heads), self.name)
        return tree


register_drafter(
    "medusa", "trained Medusa heads on the target's last feature (decodekit train-drafter --kind medusa)",
    options=TRAINED_OPTIONS,
)(MedusaDrafter)
