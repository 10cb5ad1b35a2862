"""Self-speculative decoding by layer skipping: the target, with some decoder layers run as the
identity, is its own draft model.

Papers: Xia et al. 2024, "SWIFT: On-the-Fly Self-Speculative Decoding for LLM Inference
Acceleration"; Chen et al. 2025, "CLaSp: In-Context Layer Skip for Self-Speculative Decoding".
Lossless: drafts are only proposals, verified with all layers (greedy: token-identical to
plain greedy; sampling: keyed sampling gives plain sampling's tokens for the same seed, and
speculative sampling, ``SamplingVerifier``, keeps the target distribution).

Choices made here (each one tested):
  * Drafting writes the target's own cache after the committed context (first the pending
    root, then each draft token, all with the skip set) and truncates back before returning;
    verification rewrites those positions with all layers.
  * Initial skip set, no training: ``round(skip_ratio * L)`` of the layers 1 .. L-2 (the first
    and last always run), the least important by block influence (1 - cosine similarity of a
    layer's input and output hidden states; ShortGPT, Men et al. 2024, in the spirit of
    CLaSp's similarity criterion), measured once per request on a probe of the last
    ``PROBE_TOKENS`` prompt tokens run after the cache and rolled back.
  * Adaptation (SWIFT-style on-the-fly search; real drafts are the evaluation instead of
    SWIFT's separate optimisation passes, so it costs no extra forward passes): a skip set is
    scored over ``WINDOW`` verification rounds by its estimated speed relative to plain
    decoding, ``(accepted + rounds) / (draft passes * (1 - skipped/L) + rounds)`` (our
    assumption: a verification costs one full forward pass). When the score is below 1 (not
    paying off), the next window tries a neighbour chosen by accepted tokens per draft pass:
    at least ``GROW_ACCEPT`` (drafts right but too dear) skips one more layer; below
    ``SHRINK_ACCEPT`` (drafts mostly wrong) runs the most important quarter of the skipped
    layers again (never below one skipped layer); in between swaps one skipped layer for one
    of the ``NEIGHBOUR_POOL`` least important kept layers (fixed-seed RNG). A trial is kept if
    it scores better, else the previous set returns. ``skip_ratio`` is only the starting size.
  * Early stop as in SWIFT: drafting ends before a token whose draft top-1 probability is
    below ``confidence``.
  * Greedy drafts by default; ``stochastic=True`` samples drafts from the request's processed
    distribution when the request samples, recording q for speculative sampling.
"""

from __future__ import annotations

import random
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from ...engine.core import DecodeState
from ...errors import InvalidParameter
from ...models.backend import Backend
from ...options import OptionSpec, option_table
from ..tree import DraftTree, Verification
from . import register_drafter
from .base import CHAIN_CAP, CHAIN_CONFIDENCE, CHAIN_OPTIONS, ChainDrafter

WINDOW = 6  # verification rounds per evaluation of a skip set
GROW_ACCEPT = 0.8  # accepted tokens per draft pass above which a poor set tries skipping more
SHRINK_ACCEPT = 0.5  # ... below which it tries skipping a quarter fewer
NEIGHBOUR_POOL = 4  # a trial skips one of this many least important kept layers
PROBE_TOKENS = 16  # recent tokens run once per request to rank layers


def initial_skip_set(num_layers: int, n_skip: int, importance: list[float] | None = None) -> frozenset[int]:
    """``n_skip`` of the layers 1 .. L-2: the least important ones when ``importance`` is given,
    else spread evenly."""
    middle = list(range(1, num_layers - 1))
    n_skip = min(n_skip, len(middle))
    if n_skip <= 0:
        return frozenset()
    if importance is not None:
        return frozenset(sorted(middle, key=lambda i: importance[i])[:n_skip])
    step = len(middle) / n_skip
    return frozenset(middle[int(step * i + step / 2)] for i in range(n_skip))


def layer_importance(backend: Backend, tokens: list[int]) -> list[float] | None:
    """Block influence of each layer on a probe of the recent tokens, run once more after the
    cache with all layers and rolled back. None when the probe does not fit."""
    probe = tokens[-PROBE_TOKENS:]
    origin, layers = backend.length, backend.info.num_layers
    if not probe or origin + len(probe) > backend.info.max_length:
        return None
    policy = getattr(backend, "kv_policy", None)
    if policy is not None and not policy.rolls_back_anywhere() and len(probe) > policy.recent:
        return None  # a cache that could not roll the probe back (evicting, int4 with a short residual)
    try:
        hidden = backend.append(torch.tensor([probe]), hidden_layers=range(layers + 1)).hidden
    finally:
        backend.truncate(origin)
    cos = torch.nn.functional.cosine_similarity
    return [1.0 - float(cos(hidden[i][0].float(), hidden[i + 1][0].float(), dim=-1).mean()) for i in range(layers)]


@dataclass
class SkipSearch:
    """Hill climbing over skip sets, scored by estimated speed (pure bookkeeping: feed it
    :meth:`record` signals, read :attr:`current`)."""

    num_layers: int
    current: frozenset[int]
    importance: list[float] | None = None  # per layer; guides which layers a trial moves
    window: int = WINDOW
    seed: int = 0
    best: frozenset[int] = field(init=False)
    best_score: float = field(init=False, default=0.0)
    trial: bool = field(init=False, default=False)
    changes: int = field(init=False, default=0)
    _sums: list[int] = field(init=False, default_factory=lambda: [0, 0, 0])  # accepted, passes, rounds

    def __post_init__(self) -> None:
        self.best = self.current
        self._rng = random.Random(self.seed)

    def record(self, accepted: int, passes: int) -> None:
        """One verification round: ``accepted`` draft tokens from ``passes`` draft forward passes."""
        if passes <= 0:
            return
        sums = self._sums
        sums[0] += accepted
        sums[1] += passes
        sums[2] += 1
        if sums[2] >= self.window:
            accepted, passes, rounds = sums
            self._sums = [0, 0, 0]
            self._judge(self.speed(accepted, passes, rounds, len(self.current)), accepted / passes)

    def speed(self, accepted: int, passes: int, rounds: int, n_skip: int) -> float:
        """Tokens per full-forward-pass equivalent (plain decoding = 1)."""
        return (accepted + rounds) / (passes * (1 - n_skip / self.num_layers) + rounds)

    def _judge(self, score: float, per_pass: float) -> None:
        if self.trial:
            self.trial = False
            if score > self.best_score:
                self.best, self.best_score = self.current, score
            else:
                self._set(self.best)
            return
        self.best_score = score  # a fresh measurement of the best set on the current text
        if score < 1.0:
            candidate = self._neighbour(self.best, per_pass)
            if candidate != self.best:
                self.trial = True
                self._set(candidate)

    def _set(self, skip: frozenset[int]) -> None:
        if skip != self.current:
            self.current = skip
            self.changes += 1

    def _rank(self, layers: list[int]) -> list[int]:
        """Least important first (layer order without an importance estimate)."""
        return sorted(layers, key=lambda i: self.importance[i]) if self.importance is not None else layers

    def _neighbour(self, skip: frozenset[int], per_pass: float) -> frozenset[int]:
        kept = self._rank([i for i in range(1, self.num_layers - 1) if i not in skip])
        pool = kept[:NEIGHBOUR_POOL] if self.importance is not None else kept
        if per_pass >= GROW_ACCEPT:  # drafts are right but too dear: skip one more layer
            return skip | {self._rng.choice(pool)} if pool else skip
        if per_pass < SHRINK_ACCEPT:  # drafts are mostly wrong: run the most important quarter again
            drop = max(1, len(skip) // 4)
            return frozenset(self._rank(sorted(skip))[: max(1, len(skip) - drop)])
        if not skip or not pool:
            return skip
        return (skip - {self._rng.choice(sorted(skip))}) | {self._rng.choice(pool)}


OPTIONS = option_table(
    OptionSpec("skip_ratio", float, 0.4, "fraction of layers skipped at the start", lo=0.0, hi=1.0, hi_open=True),
    OptionSpec("adapt", bool, True, "search the skip set on the fly"),
    CHAIN_OPTIONS,
)


class LayerSkipDrafter(ChainDrafter):
    """Self-speculative drafting with skipped layers (SWIFT, Xia et al. 2024; CLaSp, Chen et
    al. 2025). Options: ``skip_ratio`` (fraction of layers skipped at the start),
    ``max_draft`` (chain length cap), ``confidence`` (early-stop threshold on the draft's top-1
    probability), ``adapt`` (search the skip set on the fly), ``stochastic`` (sampled drafts
    when the request samples). See the module docstring for the choices made."""

    name = "layerskip"

    def __init__(
        self,
        *,
        skip_ratio: float = 0.4,
        max_draft: int | None = CHAIN_CAP,
        confidence: float = CHAIN_CONFIDENCE,
        adapt: bool = True,
        stochastic: bool = False,
    ):
        super().__init__(max_draft=max_draft, confidence=confidence, stochastic=stochastic)
        self.skip_ratio = OPTIONS["skip_ratio"].parse(skip_ratio)
        self.adapt = OPTIONS["adapt"].parse(adapt)
        self.search: SkipSearch | None = None
        self._backend: Backend | None = None
        self._origin = 0

    @property
    def skip_layers(self) -> frozenset[int]:
        return self.search.current if self.search is not None else frozenset()

    def begin(self, state: DecodeState) -> None:
        layers = state.backend.info.num_layers
        n_skip = round(self.skip_ratio * layers)
        importance = layer_importance(state.backend, state.tokens) if n_skip else None
        self.search = SkipSearch(layers, initial_skip_set(layers, n_skip, importance), importance)

    def _start(self, state: DecodeState, budget: int) -> tuple[torch.Tensor | None, int]:
        if self.search is None:
            raise RuntimeError("LayerSkipDrafter.draft() before begin()")
        self._backend = state.backend
        self._origin = state.backend.length
        budget = self.within_rollback(min(budget, state.backend.info.max_length - len(state.tokens)), state.backend)
        if budget <= 0:
            return None, 0
        if state.pending is None:  # the root is cached: its full-model logits are known
            return state.next_logits(), budget
        return self._advance(state.pending), budget

    def _chain_cache(self) -> AbstractContextManager:
        assert self._backend is not None
        return self._backend.compaction_held()  # (the root's own pass, in _start, compacts as a step would)

    def _advance(self, token: int) -> torch.Tensor:
        assert self._backend is not None
        try:
            out = self._backend.append(torch.tensor([[token]]), skip_layers=self.skip_layers)
        except NotImplementedError as err:
            raise InvalidParameter(f"method 'layerskip': {err}") from None
        self.last_steps += 1
        return out.logits[0, -1]

    def _stop(self, state: DecodeState) -> None:
        if self._backend is not None and self._backend.length > self._origin:
            self._backend.truncate(self._origin)

    def update(self, state: DecodeState, tree: DraftTree, verdict: Verification, logits) -> None:
        passes, self.last_steps = self.last_steps, 0  # a plain step after no draft records nothing
        if self.search is None or not self.adapt:
            return
        accepted = sum(1 for node in verdict.path if not tree.source or tree.source[node] == self.name)
        self.search.record(accepted, passes)

    def report(self) -> dict[str, Any]:
        if self.search is None:
            return {}
        return {"skip_layers": sorted(self.search.current), "skip_set_changes": self.search.changes}


register_drafter("layerskip", "self-speculative drafting: the target with some layers skipped (SWIFT)",
                 options=OPTIONS)(LayerSkipDrafter)
