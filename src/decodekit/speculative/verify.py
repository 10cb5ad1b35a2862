"""Verifiers: choose the accepted root-to-leaf path of a draft tree and the bonus token after it.

Both are lossless: the tokens they return are distributed exactly as plain decoding with the
same sampler would produce them.

* :class:`GreedyVerifier` — follow, from the root, the child whose token is the target's argmax
  (of the *processed* logits, so greedy decoding with penalties stays exact); the bonus is the
  argmax after the last accepted node.
* :class:`SamplingVerifier` — speculative sampling (Leviathan et al. 2023, "Fast inference from
  transformers via speculative decoding"; Chen et al. 2023, "Accelerating large language model
  decoding with speculative sampling") generalised to trees by recursive rejection sampling over
  siblings (SpecInfer, Miao et al. 2024; Recursive Speculative Decoding, Jeon et al. 2024).

Target distributions are ``state.sampler.probs`` of the verification logits, one batched call;
with history-dependent processors each node's history is the context plus its path (the
prompt length travels with it, for the penalties that count generated ids only).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..engine.core import DecodeState
from ..samplers import Histories
from .tree import DraftTree, Verification


def children_index(tree: DraftTree) -> dict[int, list[int]]:
    """parent (-1 = root) -> children in proposal order."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)
    return kids


def processed_logits(state: DecodeState, tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
    """The sampler's processed logits ``[N + 1, V]`` for [root] + tree nodes, each row seeing its
    own history (context + path) when the sampler needs one."""
    if not state.sampler.processors:
        return logits
    if not state.sampler.needs_history:
        return state.sampler.process(logits)
    base = state.tokens
    paths: list[list[int]] = []
    for token, parent in zip(tree.tokens, tree.parents):
        paths.append(([] if parent < 0 else paths[parent]) + [token])
    histories = Histories([base] + [base + path for path in paths], state.prompt_len)
    return state.sampler.process(logits, histories)


class Verifier(ABC):
    @abstractmethod
    def verify(self, state: DecodeState, tree: DraftTree, logits: torch.Tensor) -> Verification:
        """``logits`` ``[N + 1, V]``: row 0 follows the root, row i + 1 follows node i."""


class GreedyVerifier(Verifier):
    """Longest root path whose tokens are the target's argmax at every step; bonus = the next argmax."""

    def verify(self, state: DecodeState, tree: DraftTree, logits: torch.Tensor) -> Verification:
        targets = processed_logits(state, tree, logits).argmax(dim=-1).tolist()
        child_of = {}
        for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
            child_of.setdefault((parent, token), i)
        path: list[int] = []
        node = -1
        while True:
            want = targets[node + 1]
            child = child_of.get((node, want))
            if child is None:
                return Verification(path, want)
            path.append(child)
            node = child


class SamplingVerifier(Verifier):
    """Speculative sampling over a tree, exact for stochastic and deterministic drafts.

    At a node whose children were sampled without replacement from ``q = tree.draft_probs[node]``,
    child x is accepted with probability min(1, p(x) / q(x)); after a rejection the target becomes
    norm(max(0, p - q)) and q is renormalised without x (Recursive SD). Deterministic children
    (no draft_probs: q is a point mass on each proposed child) are the special case: accept x with
    probability p(x), else remove x from p and renormalise. When no child is accepted the bonus is
    drawn from what is left of p; after a leaf it is drawn from the leaf's p. All draws go through
    ``state.sampler`` (uniform / sample_from).
    """

    def verify(self, state: DecodeState, tree: DraftTree, logits: torch.Tensor) -> Verification:
        sampler = state.sampler
        probs = torch.softmax(processed_logits(state, tree, logits), dim=-1)
        kids = children_index(tree)
        path: list[int] = []
        node = -1
        while True:
            p = probs[node + 1]
            accepted, p = self._choose_child(sampler, tree, node, kids.get(node, []), p)
            if accepted is None:
                return Verification(path, int(sampler.sample_from(p)))
            path.append(accepted)
            node = accepted

    @staticmethod
    def _choose_child(sampler, tree: DraftTree, node: int, children: list[int], p: torch.Tensor):
        """Recursive rejection over ``children``: (accepted child or None, the residual target)."""
        if not children:
            return None, p
        q = tree.draft_probs.get(node)
        q = None if q is None else q.to(torch.float32).clone()
        draws = sampler.uniform(len(children)).tolist()
        for child, u in zip(children, draws):
            x = tree.tokens[child]
            px = float(p[x])
            qx = 1.0 if q is None else float(q[x])
            if qx > 0 and u * qx < px:  # u < p(x) / q(x)
                return child, p
            p = residual(p, q, x)
            if q is not None:
                q[x] = 0.0
                total_q = float(q.sum())
                if total_q > 0:
                    q /= total_q
        return None, p


def residual(p: torch.Tensor, q: torch.Tensor | None, rejected: int) -> torch.Tensor:
    """norm(max(0, p - q)) (q = None: a point mass on ``rejected``). When rounding leaves no mass
    (p == q, so the rejection had probability 0) fall back to p without the rejected token."""
    if q is None:
        out = p.clone()
        out[rejected] = 0.0
    else:
        out = torch.clamp(p - q, min=0.0)
    total = float(out.sum())
    if total <= 0:
        out = p.clone()
        out[rejected] = 0.0
        total = float(out.sum())
        if total <= 0:
            return torch.full_like(p, 1.0 / p.numel())
    return out / total


def make_verifier(state: DecodeState) -> Verifier:
    return GreedyVerifier() if state.sampler.is_greedy else SamplingVerifier()
