"""The drafter contract and the mechanisms several drafters share.

:class:`Drafter` is the whole interface the loop uses: ``draft`` is required; ``check``,
``begin``, ``update``, ``observe``, ``report``, ``finish`` and ``trimmable`` are optional hooks
whose defaults do nothing, so the loop calls them unconditionally. Shared mechanisms:
:class:`ContextDrafter` (index the growing context one token at a time: pld, suffix),
:class:`ChainDrafter` (autoregressive chains from a draft model: draft, layerskip),
:class:`FeatureDrafter` (trained networks on the target's features: eagle, medusa, hydra) and
:class:`CompositeDrafter` (drafters made of drafters: hierarchy, auto).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from ...engine.core import DecodeState
from ...errors import InvalidParameter
from ...models.backend import Backend
from ...models.kv_policy import KVPolicy
from ...samplers import Histories, Sampler
from ...options import OptionSpec, any_value, check_int, option_table
from ..trained import store
from ..tree import DraftTree, Verification


class Drafter(ABC):
    """Proposes continuations. Must not leave the target backend's cache changed (a drafter
    that runs the target, like layer skipping, rolls back what it wrote)."""

    name: str = "drafter"
    #: False: the controller verifies the whole tree or nothing (a lookahead window's value
    #: lies in later steps, so it is not trimmed node by node).
    trimmable: bool = True

    def check(self, backend: Backend) -> None:
        """Called by the loop before prefill: refuse (:class:`InvalidParameter`) a target this
        drafter cannot draft for, before the prompt is read. Drafters whose check prepares what
        ``begin`` uses (a draft model, a trained network) check again in ``begin`` where it was
        not done for this target (a drafter used without the loop)."""

    def check_kv_cache(self, policy: KVPolicy) -> None:
        """Called before the model loads: refuse a model cache policy this drafter cannot draft
        under (what :meth:`check` would refuse once the model is loaded, known from the policy alone)."""

    def begin(self, state: DecodeState) -> None:
        """Called once per request after prefill (e.g. index the prompt)."""

    @abstractmethod
    def draft(self, state: DecodeState, budget: int) -> DraftTree:
        """A tree of at most ``budget`` nodes continuing ``state.tokens`` (whose last token is the root)."""

    def update(self, state: DecodeState, tree: DraftTree, verdict: Verification, logits: torch.Tensor) -> None:
        """Called after each verification with the target's logits for [root] + tree nodes
        (``[N + 1, V]``), before ``state.tokens`` is extended by the accepted tokens; also after
        plain steps (an empty tree, the step's logits as ``[1, V]``)."""

    def observe(self, tokens: int, seconds: float) -> None:
        """Called after every step: it produced ``tokens`` tokens in ``seconds`` (drafting included)."""

    def report(self) -> dict[str, Any]:
        """Figures added to the request's ``stats.extra`` when it ends."""
        return {}

    def finish(self, state: DecodeState) -> None:
        """Called once per request after the last step (e.g. remember its output)."""


# Context drafters ---------------------------------------------------------------------------------


class ContextDrafter(Drafter):
    """A drafter over the request's own tokens, indexed one token at a time as they arrive
    (each token is indexed once, never the whole context per step)."""

    def begin(self, state: DecodeState) -> None:
        self.reset()
        self.seen = 0
        self.sync(state)

    def sync(self, state: DecodeState) -> None:
        """Index the tokens added since the last call (``state.tokens`` only ever grows)."""
        tokens = state.tokens
        for position in range(self.seen, len(tokens)):
            self.push(tokens, position)
        self.seen = len(tokens)

    @abstractmethod
    def reset(self) -> None:
        """Forget the previous request's context."""

    @abstractmethod
    def push(self, tokens: list[int], position: int) -> None:
        """Index ``tokens[position]`` (every earlier token is indexed already)."""


# Chain drafters ------------------------------------------------------------------------------------


def choose_token(
    logits: torch.Tensor, sampler: Sampler, history: list[int], sample: bool, prompt_len: int = 0
) -> tuple[int | None, float, torch.Tensor]:
    """One draft choice from draft logits ``[V]``: (token, top-1 probability, distribution q).

    q is the request sampler's processed distribution (softmax of the processed logits, also
    for greedy samplers, so that the confidence is meaningful). The token is None when
    ``sample`` is set: the caller draws it after the confidence test.
    """
    # the frequency and presence penalties count generated ids only: the history knows where the prompt ends
    histories = Histories([history], prompt_len) if sampler.needs_history else None
    q = torch.softmax(sampler.process(logits[None], histories)[0], dim=-1)
    top = int(q.argmax())
    return (None if sample else top), float(q[top]), q


#: A chain drafter's own cap on its chains (the controller sizes them below it, unless a request
#: gives ``max_draft`` or a fixed ``budget``), and its default confidence stop (SWIFT's).
CHAIN_CAP = 6
CHAIN_CONFIDENCE = 0.3

#: The options every chain drafter takes (a subclass may change a default, e.g. ``stochastic``).
#: ``max_draft`` is not among them: a chain drafter's own cap (its constructor's) gives way to the
#: loop's common ``max_draft`` where a request gives one, and to a fixed ``budget`` (``method_builder``).
CHAIN_OPTIONS = option_table(
    OptionSpec("confidence", float, CHAIN_CONFIDENCE, "stop before a draft token whose top-1 probability is below this",
               lo=0.0, hi=1.0),
    OptionSpec("stochastic", bool, False, "sample drafts when the request samples"),
)


class ChainDrafter(Drafter):
    """Drafts a chain autoregressively from some draft model, one token per forward pass.

    Subclasses say how the draft model starts (logits after the root) and advances (append a
    token, return the next logits) and how it cleans up; this class owns the greedy/sampled
    choice, draft distributions and the confidence stop (as in SWIFT: drafting ends before a
    token whose draft top-1 probability is below ``confidence``; the test uses only q, before
    any draw, so sampled tokens stay exactly q-distributed). ``last_steps`` counts the draft
    forward passes of the latest :meth:`draft`. ``max_draft``: a cap of the drafter's own on the
    chains the controller sizes (None: none); a fixed ``budget`` given to the method replaces it.
    """

    def __init__(self, *, max_draft: int | None, confidence: float, stochastic: bool):
        self.max_draft = None if max_draft is None else check_int("max_draft", max_draft, 1)
        self.confidence = CHAIN_OPTIONS["confidence"].parse(confidence)
        self.stochastic = CHAIN_OPTIONS["stochastic"].parse(stochastic)
        self.last_steps = 0

    @abstractmethod
    def _start(self, state: DecodeState, budget: int) -> tuple[torch.Tensor | None, int]:
        """Logits ``[V]`` after the root (None: cannot draft now) and the usable budget."""

    @abstractmethod
    def _advance(self, token: int) -> torch.Tensor:
        """Feed a drafted token to the draft model; return the logits ``[V]`` after it."""

    def _stop(self, state: DecodeState) -> None:
        """Called after drafting, also on error (e.g. roll a shared cache back)."""

    @staticmethod
    def within_rollback(budget: int, backend: Backend) -> int:
        """``budget`` cut to the one-token passes ``backend``'s cache can take and then roll back
        (a chain drafted on a cache is rolled back past what the target did not accept)."""
        reach = backend.chain_reach()
        return budget if reach is None else min(budget, reach)

    def _chain_cache(self) -> AbstractContextManager:
        """Held while the chain's passes run (:meth:`Backend.compaction_held` of the cache they write
        to, rolled back after); nothing where they write to none of their own."""
        return nullcontext()

    def draft(self, state: DecodeState, budget: int) -> DraftTree:
        self.last_steps = 0
        tree = DraftTree()
        if self.max_draft is not None:
            budget = min(budget, self.max_draft)
        if budget <= 0:
            return tree
        try:
            logits, budget = self._start(state, budget)
            if logits is None:
                return tree
            sampler = state.sampler
            sample = self.stochastic and not sampler.is_greedy
            history = list(state.tokens)
            with self._chain_cache():
                self._chain(state, tree, logits, budget, sampler, sample, history)
        finally:
            self._stop(state)
        return tree

    def _chain(self, state: DecodeState, tree: DraftTree, logits: torch.Tensor, budget: int, sampler, sample: bool,
               history: list[int]) -> None:
        """Up to ``budget`` drafted tokens into ``tree``, from the root's ``logits`` on."""
        for i in range(budget):
            if i:
                logits = self._advance(tree.tokens[-1])
            token, top_prob, q = choose_token(logits, sampler, history, sample, state.prompt_len)
            if top_prob < self.confidence:
                break
            if sample:  # keyed: the target's noise at this position, which agrees with it where q ~ p
                token = sampler.sample_at(q, len(history)) if state.keyed_drafts else int(sampler.sample_from(q))
                tree.draft_probs[i - 1] = q
            tree.add(token, i - 1, self.name)
            history.append(token)


# Feature drafters ----------------------------------------------------------------------------------

#: Options of both trained drafters (``eagle`` adds its own).
TRAINED_OPTIONS = option_table(
    OptionSpec("drafter", Path, None, "the drafter file (default: the one trained for this model)", local=any_value),
    OptionSpec("candidates", int, 4, "candidates per draft position (EAGLE-2's top-k; named apart from the sampler's top_k)",
               lo=1, hi=64),
)


class FeatureHistory:
    """The target's features at every position of its backend's last request that a feature
    drafter decoded, kept in the backend's memory: a next prompt whose beginning the cache kept (a
    chat's next turn) reads only the rest, and its drafter takes the features of the beginning
    from here, as if it had read the whole prompt."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.chunks: list[torch.Tensor] = []  # [rows, D] each, from position 0 on (joined only when read)

    def before(self, tokens: list[int], position: int) -> torch.Tensor | None:
        """The features of positions ``0 .. position - 1`` where the last request had them for the
        same tokens; None otherwise."""
        if sum(len(c) for c in self.chunks) < position or self.tokens[:position] != tokens[:position]:
            return None
        return torch.cat(self.chunks)[:position]


def feature_history(backend: Backend) -> FeatureHistory:
    """The backend's :class:`FeatureHistory` (in its memory: its clones start without one)."""
    return backend.memory("features.history", FeatureHistory)


def kept_features(backend: Backend, ids: Sequence[int]) -> torch.Tensor | None:
    """The features the backend's history holds for every position of ``ids`` (its kept tokens),
    or None: what a server's prompt cache keeps beside the cache's entries."""
    return feature_history(backend).before(list(ids), len(ids))


def give_features(backend: Backend, ids: Sequence[int], features: torch.Tensor) -> None:
    """Make ``features`` (one row a position of ``ids``) the backend's history: a cache whose
    entries for ``ids`` came from elsewhere (a server's prompt cache) drafts as if it had read them."""
    history = feature_history(backend)
    history.tokens, history.chunks = list(ids), [features]


class FeatureDrafter(Drafter):
    """What EAGLE, Medusa and Hydra share: their network, loaded for the target, and the target's features
    at the committed positions, taken from every pass the loop runs (and, for a prompt whose
    beginning the cache kept from the last request, from its :class:`FeatureHistory`)."""

    kind = ""
    #: Whether drafting reads the features of earlier positions (EAGLE's network attends to them),
    #: so that a prompt's kept beginning needs its features from the last request (FeatureHistory).
    reads_earlier_features = False

    def __init__(self, *, drafter: str | None = None, candidates: int = 4):
        self.path = drafter
        self.candidates = TRAINED_OPTIONS["candidates"].parse(candidates)
        self.net, self._net_for = None, None  # the network, and the target it was loaded for

    def check(self, backend: Backend) -> None:
        if not backend.gives_features:
            raise InvalidParameter(f"method {self.kind} needs a backend that gives features (the native backend)")
        self.net, self._net_for = store.load(backend, self.kind, self.path), backend

    def begin(self, state: DecodeState) -> None:
        if self.net is None or self._net_for is not state.backend:  # a drafter used without the loop
            self.check(state.backend)
        features = state.backend.last_features
        if features is None or features.shape[1] > len(state.tokens):
            raise InvalidParameter(f"method {self.kind} needs the features of the prompt's last pass")
        self.chunks = [features[0].float()]  # the known features, in passes' chunks, from position chunk_start
        self.chunk_start = len(state.tokens) - features.shape[1]
        self.known = len(state.tokens)  # positions chunk_start .. known - 1 have their feature
        self.history_chunks = None  # every position's features, for the next request's history
        if self.reads_earlier_features:
            if self.chunk_start > 0:  # the cache kept the prompt's beginning
                earlier = feature_history(state.backend).before(state.tokens, self.chunk_start)
                if earlier is not None:
                    self.chunks.insert(0, earlier)
                    self.chunk_start = 0
            if self.chunk_start == 0:
                self.history_chunks = list(self.chunks)

    def update(self, state: DecodeState, tree: DraftTree, verdict: Verification, logits: torch.Tensor) -> None:
        features = state.backend.last_features
        if features is None or features.shape[1] != len(tree) + 1 or self.known != len(state.tokens) - 1:
            return  # not the pass the loop says it ran: learn nothing rather than misalign
        rows = [0] + [i + 1 for i in verdict.path]  # the root and the accepted nodes
        self.chunks.append(features[0, rows].float())
        if self.history_chunks is not None:
            self.history_chunks.append(self.chunks[-1])
        self.known += len(rows)

    def finish(self, state: DecodeState) -> None:
        if self.history_chunks is not None:
            history = feature_history(state.backend)
            history.tokens, history.chunks = list(state.tokens), self.history_chunks

    def features_from(self, position: int) -> torch.Tensor:
        """The features of positions ``position .. known - 1`` (earlier ones are dropped from the
        chunks drafting reads, which stay short; ``history_chunks`` keeps them for the next request)."""
        while self.chunks and self.chunk_start + len(self.chunks[0]) <= position:
            self.chunk_start += len(self.chunks.pop(0))
        return torch.cat(self.chunks)[position - self.chunk_start :]

    def last_feature(self, state: DecodeState) -> torch.Tensor | None:
        """The feature at the position before the root (it predicted the root), when known."""
        if self.known != len(state.tokens) - 1:
            return None
        return self.features_from(self.known - 1)[-1]


# Composite drafters --------------------------------------------------------------------------------


class CompositeDrafter(Drafter):
    """Shared plumbing of drafters made of drafters: begin/update/finish reach every leaf drafter
    once, even when composites share parts."""

    parts: list[Drafter]

    def leaves(self) -> list[Drafter]:
        out: list[Drafter] = []
        for part in self.parts:
            for leaf in part.leaves() if isinstance(part, CompositeDrafter) else [part]:
                if all(leaf is not seen for seen in out):
                    out.append(leaf)
        return out

    @property
    def trimmable(self) -> bool:  # type: ignore[override]
        """A tree with an all-or-nothing part in it (lookahead's) is all or nothing too."""
        return all(part.trimmable for part in self.parts)

    def check_kv_cache(self, policy: KVPolicy) -> None:
        for leaf in self.leaves():
            leaf.check_kv_cache(policy)

    def check(self, backend: Backend) -> None:
        for leaf in self.leaves():
            leaf.check(backend)

    def begin(self, state: DecodeState) -> None:
        for leaf in self.leaves():
            leaf.begin(state)

    def update(self, state: DecodeState, tree: DraftTree, verdict: Verification, logits: torch.Tensor) -> None:
        for leaf in self.leaves():
            leaf.update(state, tree, verdict, logits)

    def finish(self, state: DecodeState) -> None:
        for leaf in self.leaves():
            leaf.finish(state)
