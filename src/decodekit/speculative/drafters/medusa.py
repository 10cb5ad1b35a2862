"""Medusa: K trained heads on the target's last feature propose the next K tokens at once.

Paper: Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads" (the network and its training: ``speculative/trained/``). Lossless: the heads only propose;
the verifiers accept greedily (output token-identical to plain greedy) or with the keyed sampling
verifier (the drafts are deterministic: plain sampling's tokens).

Choices the paper leaves open (each one tested):
  * The tree is grown per step from the heads' own probabilities, best first by the product of the
    probabilities along a path (Medusa fixes one sparse tree from heads' validation accuracies;
    growing it per step uses the same estimate, for this step's candidates). Each head offers its
    ``top_k`` tokens; head k's candidates hang below every node of depth k.
  * The feature is the one the last verification (or plain step) computed at the last accepted
    position, read from the backend (``last_features``), so drafting runs no target pass.
"""

from __future__ import annotations

import torch

from ...engine.core import DecodeState
from ...errors import InvalidParameter
from ...options import OptionSpec, option_table
from ..trained import store
from ..tree import DraftTree, Verification, grow_best_first
from . import register_drafter
from .base import Drafter

#: Options of both trained drafters (``eagle`` adds its own).
TRAINED_OPTIONS = option_table(
    OptionSpec("drafter", str, None, "the drafter file (default: the one trained for this model)"),
    OptionSpec("top_k", int, 4, "candidates per draft position", lo=1, hi=64),
)


class FeatureDrafter(Drafter):
    """What EAGLE and Medusa share: their network, loaded for the target, and the target's features
    at the committed positions, taken from every pass the loop runs."""

    kind = ""

    def __init__(self, *, drafter: str | None = None, top_k: int = 4):
        self.path = drafter
        self.top_k = TRAINED_OPTIONS["top_k"].parse(top_k)
        self.net = None

    def begin(self, state: DecodeState) -> None:
        self.net = store.load(state.backend, self.kind, self.path)
        features = state.backend.last_features
        if features is None or features.shape[1] > len(state.tokens):
            raise InvalidParameter(f"method {self.kind} needs a backend that gives features (the native backend)")
        self.chunks = [features[0].float()]  # the known features, in passes' chunks, from position chunk_start
        self.chunk_start = len(state.tokens) - features.shape[1]
        self.known = len(state.tokens)  # positions chunk_start .. known - 1 have their feature

    def update(self, state: DecodeState, tree: DraftTree, verdict: Verification, logits: torch.Tensor) -> None:
        features = state.backend.last_features
        if features is None or features.shape[1] != len(tree) + 1 or self.known != len(state.tokens) - 1:
            return  # not the pass the loop says it ran: learn nothing rather than misalign
        rows = [0] + [i + 1 for i in verdict.path]  # the root and the accepted nodes
        self.chunks.append(features[0, rows].float())
        self.known += len(rows)

    def features_from(self, position: int) -> torch.Tensor:
        """The features of positions ``position .. known - 1`` (earlier ones are dropped for good)."""
        while self.chunks and self.chunk_start + len(self.chunks[0]) <= position:
            self.chunk_start += len(self.chunks.pop(0))
        return torch.cat(self.chunks)[position - self.chunk_start :]

    def last_feature(self, state: DecodeState) -> torch.Tensor | None:
        """The feature at the position before the root (it predicted the root), when known."""
        if self.known != len(state.tokens) - 1:
            return None
        return self.features_from(self.known - 1)[-1]


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
            top = probs.topk(self.top_k, dim=-1)
        vocab = self.net.head.vocab.tolist()
        heads = [[(vocab[i], p, k + 1) for p, i in zip(top.values[k].tolist(), top.indices[k].tolist())]
                 for k in range(probs.shape[0])]
        grow_best_first(tree, heads[0], lambda k: heads[k], budget, len(heads), self.name)
        return tree


register_drafter(
    "medusa", "trained Medusa heads on the target's last feature (decodekit train-drafter --kind medusa)",
    options=TRAINED_OPTIONS,
)(MedusaDrafter)
