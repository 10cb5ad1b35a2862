"""Verifiers: choose the accepted root-to-leaf path of a draft tree and the bonus token after it.

Both are lossless: the tokens they return are distributed exactly as plain decoding with the
same sampler would produce them.

* :class:`GreedyVerifier` — follow, from the root, the child whose token is the target's argmax
  (of the *processed* logits, so greedy decoding with penalties stays exact); the bonus is the
  argmax after the last accepted node.
* :class:`KeyedVerifier` — the default for sampled requests: the target's token at each position
  is drawn with noise keyed by (seed, position), so the output is token-identical to plain
  sampling with the same seed, and a draft is accepted when it equals that token.
* :class:`SamplingVerifier` — speculative sampling (Leviathan et al. 2023, "Fast inference from
  transformers via speculative decoding"; Chen et al. 2023, "Accelerating large language model
  decoding with speculative sampling") generalised to trees by recursive rejection sampling over
  siblings (SpecInfer, Miao et al. 2024; Recursive Speculative Decoding, Jeon et al. 2024).

Target distributions are the sampler's processed verification logits: one batched call, or, with
history-dependent processors (a grammar, the penalties), each row's own when the walk from the root
reaches it, its history the context plus its path (the prompt length travels with it, for the
penalties that count generated ids only).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from ..engine.core import DecodeState
from ..errors import InvalidParameter
from ..models.kernels import argmax_rows
from ..samplers import Histories
from .tree import DraftTree, Verification


def children_index(tree: DraftTree) -> dict[int, list[int]]:
    """parent (-1 = root) -> children in proposal order."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)
    return kids


def node_histories(state: DecodeState, tree: DraftTree) -> list[list[int]]:
    """Each row's tokens for [root] + tree nodes: the context, then the node's path."""
    base = state.tokens
    return [base] + [base + path for path in tree.paths()]


def processed_logits(state: DecodeState, tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
    """The sampler's processed logits ``[N + 1, V]`` for [root] + tree nodes, each row seeing its
    own history (context + path) when the sampler needs one."""
    if not state.sampler.processors:
        return logits
    if not state.sampler.needs_history:
        return state.sampler.process(logits)
    return state.sampler.process(logits, Histories(node_histories(state, tree), state.prompt_len))


def row_histories(state: DecodeState, tree: DraftTree) -> Callable[[int], Histories] | None:
    """``row -> `` that row's history as the sampler takes one row's, where the sampler's processors
    depend on the history (a grammar's mask, the penalties); None where they do not.

    The verifiers then process a row only when their walk from the root reaches it, as plain decoding
    processes its one row: the rows of rejected drafts, most of a tree, cost nothing (a grammar's
    mask costs about twice the argmax of its row). Processors see each row on its own either way,
    so a row's values do not depend on which other rows were processed with it."""
    if not state.sampler.needs_history:
        return None
    histories = node_histories(state, tree)
    return lambda row: Histories([histories[row]], state.prompt_len)


class Verifier(ABC):
    #: Whether a drafter that samples its drafts draws them with the target's keyed noise (coupled
    #: to the token plain sampling would draw there: accepted more often), or else from the
    #: request's generator, independent of every other draw (what speculative sampling assumes).
    keyed_drafts = True

    @abstractmethod
    def verify(self, state: DecodeState, tree: DraftTree, logits: torch.Tensor) -> Verification:
        """``logits`` ``[N + 1, V]``: row 0 follows the root, row i + 1 follows node i."""


class PathVerifier(Verifier):
    """Follows, from the root, the child whose token is the one plain decoding would choose at
    that position; the bonus is the choice after the last accepted node. Exact whatever the
    drafter proposed, since every returned token is plain decoding's own choice."""

    def verify(self, state: DecodeState, tree: DraftTree, logits: torch.Tensor) -> Verification:
        choose = self.chooser(state, tree, logits)
        child_of = {}
        for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
            child_of.setdefault((parent, token), i)
        path: list[int] = []
        node = -1
        while True:
            want = choose(node + 1, len(path))
            child = child_of.get((node, want))
            if child is None:
                return Verification(path, want)
            path.append(child)
            node = child

    def chooser(self, state: DecodeState, tree: DraftTree, logits: torch.Tensor) -> Callable[[int, int], int]:
        """``choose(row, depth)``: plain decoding's token after row ``row`` of ``logits`` (``[N + 1,
        V]``, unprocessed), which sits ``depth`` tokens below the root; rows processed as the walk
        reaches them where the processors depend on the history (:func:`row_histories`)."""
        history, base = row_histories(state, tree), len(state.tokens)
        if history is not None:  # plain decoding's own choice for one row (a mask: its masked argmax)
            return lambda row, depth: state.sampler.pick_at(logits[row], base + depth, history(row))
        return self.choice_of_rows(state, processed_logits(state, tree, logits))

    @abstractmethod
    def choice_of_rows(self, state: DecodeState, processed: torch.Tensor) -> Callable[[int, int], int]:
        """``choose(row, depth)`` from every row's processed logits ``[N + 1, V]`` at once."""


class GreedyVerifier(PathVerifier):
    """Longest root path whose tokens are the target's argmax at every step; bonus = the next argmax
    (of the *processed* logits, so greedy decoding with penalties or a grammar stays exact)."""

    def choice_of_rows(self, state: DecodeState, processed: torch.Tensor) -> Callable[[int, int], int]:
        targets = argmax_rows(processed)
        return lambda row, depth: targets[row]


class KeyedVerifier(PathVerifier):
    """Seeded sampling, token-identical to plain sampling: the target's token at each position is
    :meth:`~decodekit.samplers.Sampler.sample_at` of the processed distribution, drawn with noise
    keyed by (seed, position); a child is accepted when it is that token. A point-mass draft is
    then accepted with probability p(x), as in speculative sampling; a draft sampled with the
    same keyed noise from q is accepted as often as that coupling of q and p allows (our choice:
    reproducibility over the last few points of acceptance of rejection sampling; see
    :class:`SamplingVerifier` for the latter)."""

    def choice_of_rows(self, state: DecodeState, processed: torch.Tensor) -> Callable[[int, int], int]:
        base = len(state.tokens)  # the root's child sits at this position
        return lambda row, depth: state.sampler.sample_at(torch.softmax(processed[row], dim=-1), base + depth)


class SamplingVerifier(Verifier):
    """Speculative sampling over a tree, exact for stochastic and deterministic drafts.

    At a node whose children were sampled without replacement from ``q = tree.draft_probs[node]``,
    child x is accepted with probability min(1, p(x) / q(x)); after a rejection the target becomes
    norm(max(0, p - q)) and q is renormalised without x (Recursive SD). Deterministic children
    (no draft_probs: q is a point mass on each proposed child) are the special case: accept x with
    probability p(x), else remove x from p and renormalise. When no child is accepted the bonus is
    drawn from what is left of p; after a leaf it is drawn from the leaf's p. All draws go through
    ``state.sampler`` (uniform / sample_from).

    The proof assumes two things that the speculative loop provides for this verifier: drafts drawn
    independently of every other draw (:attr:`keyed_drafts` False: a plain step at a drafted
    position, keyed, would otherwise reuse that draft's noise), and a verified tree that is the
    drafted one (no trim after drafting: whether a node is verified must not depend on its own draw,
    and a chain's length, which a trim reads, follows its tokens).
    """

    keyed_drafts = False

    def verify(self, state: DecodeState, tree: DraftTree, logits: torch.Tensor) -> Verification:
        sampler = state.sampler
        history = row_histories(state, tree)
        every = None if history is not None else torch.softmax(processed_logits(state, tree, logits), dim=-1)

        def probs(row: int) -> torch.Tensor:  # a row's target, processed when the walk reaches it
            if every is not None:
                return every[row]
            return torch.softmax(sampler.process(logits[row][None], history(row))[0], dim=-1)

        kids = children_index(tree)
        path: list[int] = []
        node = -1
        while True:
            p = probs(node + 1)
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


def make_verifier(state: DecodeState, sampled: Verifier | None = None) -> Verifier:
    """Greedy requests: :class:`GreedyVerifier` (the sampling verifiers would draw from the
    unscaled distribution: a greedy sampler has no temperature to make it a point mass); sampled
    ones: ``sampled``, by default :class:`KeyedVerifier`, so that a seed gives the same tokens with
    or without speculation. A :class:`GreedyVerifier` for sampled requests is refused: it would
    return the argmax where the request asked for a sample."""
    if state.sampler.is_greedy:
        return GreedyVerifier()
    if isinstance(sampled, GreedyVerifier):
        raise InvalidParameter("a GreedyVerifier cannot verify a sampled request; give KeyedVerifier or SamplingVerifier",
                               param="verifier")
    return sampled or KeyedVerifier()
