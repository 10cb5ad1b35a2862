"""Self-speculation from a compressed KV cache: the target drafts while attending to a small part
of its cache, and verifies with all of it.

Papers: Sun et al., 2024, "TriForce: Lossless Acceleration of Long Sequence Generation with
Hierarchical Speculative Decoding"; Sadhukhan et al., 2024, "MagicDec: Breaking the
Latency-Throughput Tradeoff for Long Context Generation with Speculative Decoding". At long
context a step's cost is attention over the cache as much as the weights; the same model
attending to a small cache is a cheap and well-aligned draft. Lossless: the full-cache target
verifies every token with the project's verifiers (token-identical to plain greedy, and to plain
sampling with the same seed by keyed sampling; plain sampling's distribution under speculative
sampling, ``SamplingVerifier``).

Choices the papers leave open (each one tested):
  * ``draft_cache="sink:S,window:W"`` (the default, ``sink:4,window:1024``: MagicDec's StreamingLLM
    draft, with the window that paid best at 6,000 tokens in docs/BENCHMARKS.md): the draft is the
    target itself, its passes attending only to the first S and the last W entries of the
    target's own cache (:meth:`NativeLlama.append_windowed`), at the tokens' own positions; a
    draft's entries are rolled back after it. The draft's cache is thus a view of the target's, as
    in both papers: nothing is copied and nothing falls behind (so ``every:E``, how often a
    StreamingLLM cache compacts, changes nothing here: each draft pass sees exactly S + W entries).
  * Any other compressed policy (``snapkv:...``, ``h2o:...``, ``int8``; TriForce retrieves
    chunks instead): a clone of the target with that cache, made from the target's entries after
    the prompt (:meth:`NativeLlama.adopt`: a second read of the prompt only where the policy observes it,
    SnapKV's last window and H2O's whole prompt), then kept in step with
    ``state.tokens`` like any draft model (roll back to the common prefix, append what is missing).
  * Chains, one token per draft pass, with the chain drafters' confidence stop; the controller
    sizes them from measured costs, as for every drafter. No second-level draft (TriForce's
    hierarchy): ``hierarchy`` can combine ``kvdraft`` with the context drafters.
  * Native backend; the target's cache keeps every token (``full``, or ``int8`` for windowed
    drafts, which then match the int8 cache's greedy output; not ``int4``, whose codes every
    query reads, so a window over it cannot be drawn, nor an ``int4`` draft cache, which would
    cost a full step).
"""

from __future__ import annotations

import dataclasses

import torch

from ...engine.core import DecodeState
from ...errors import InvalidParameter
from ...models.backend import Backend
from ...models.kv_policy import KVPolicy, StreamingPolicy, parse_kv_cache
from ...options import OptionSpec, option_table
from . import register_drafter
from .base import CHAIN_CAP, CHAIN_CONFIDENCE, CHAIN_OPTIONS
from .draft_model import KEPT_DRAFTS, DraftModelDrafter

DEFAULT_CACHE = "sink:4,window:1024"

OPTIONS = option_table(
    OptionSpec("draft_cache", str, DEFAULT_CACHE, "the draft's cache policy (a --kv-cache spelling other than full, "
               "int4 or int2; the target keeps its own cache)"),
    CHAIN_OPTIONS,
    dataclasses.replace(CHAIN_OPTIONS["stochastic"], default=True),
)


class CompressedCacheDrafter(DraftModelDrafter):
    """The target model with a compressed cache drafts chains (TriForce, MagicDec). Lossless
    under the project's verifiers. Options: ``draft_cache`` (the draft's policy; named apart from the
    model's own ``kv_cache``, which ``decodekit.generate`` takes), ``confidence``,
    ``stochastic``, ``max_draft`` (see the module docstring)."""

    name = "kvdraft"

    def __init__(self, *, draft_cache: str = DEFAULT_CACHE, max_draft: int | None = CHAIN_CAP, confidence: float = CHAIN_CONFIDENCE,
                 stochastic: bool = True):
        super().__init__(draft_model=None, max_draft=max_draft, confidence=confidence, stochastic=stochastic)
        try:
            self.policy = parse_kv_cache(draft_cache)
        except InvalidParameter as err:
            raise InvalidParameter(f"draft_cache: {err}", param="draft_cache") from None
        if not self.policy.one_sequence() or self.policy.kivi:
            raise InvalidParameter(f"kvdraft needs a compressed draft_cache other than int4/int2 (e.g. {DEFAULT_CACHE} or int8), "
                                   f"got {self.policy.spec!r}", param="draft_cache")
        self.windowed = isinstance(self.policy, StreamingPolicy)  # drafts on the target's own cache
        self._target = None
        self._origin = 0

    def _parse_spec(self, spec: object) -> object:
        return None  # the draft is the target itself, found at check()

    def check_kv_cache(self, policy: KVPolicy) -> None:
        # windowed drafts read an int8 cache as they read a float one, not int4's
        if policy.quantised and policy.code_bits == 8 and not self.windowed:
            raise InvalidParameter(f"under the model's int8 cache kvdraft drafts through a window of it: draft_cache "
                                   f"must be sink:S,window:W, got {self.policy.spec}", param="draft_cache")
        if policy.evicts() or policy.quantised and policy.code_bits != 8:
            raise InvalidParameter(f"kvdraft drafts for a cache that keeps every token (full, or int8 with sink:S,window:W "
                                   f"drafts); this model's is {policy.spec}", param="method")

    def check(self, target: Backend) -> None:
        if not hasattr(target, "with_kv_cache"):
            raise InvalidParameter(f"kvdraft needs the native backend, not {target.info.architecture}", param="method")
        self.check_kv_cache(target.kv_policy)
        peak = self.policy.peak_slots(1)
        # as --kv-cache refuses it (it would compress nothing); the default's is let be on a model of a short context
        if self.policy.spec != DEFAULT_CACHE and peak is not None and peak > target.info.max_length:
            raise InvalidParameter(f"draft_cache {self.policy.spec} needs up to {peak} entries, more than the model's "
                                   f"context of {target.info.max_length}", param="draft_cache")
        if self.windowed:
            return
        try:
            self.backend = target.memory(("kvdraft", self.policy.spec), lambda: target.with_kv_cache(self.policy),
                                         keep=KEPT_DRAFTS)
        except InvalidParameter as err:
            if self.policy.evicts():  # Gemma 3's windows take no evicting cache (its message would suggest full)
                err = f"{target.info.name} cannot hold an evicting cache; kvdraft drafts on it through sink:S,window:W or int8"
            raise InvalidParameter(f"draft_cache {self.policy.spec}: {err}", param="draft_cache") from None

    def begin(self, state: DecodeState) -> None:
        target = state.backend
        self.check(target)  # again for a drafter used without the loop: the draft's backend is kept, not rebuilt
        self._target = target
        if self.windowed:
            return
        assert self.backend is not None
        prompt = state.tokens[: target.length]
        self.backend.adopt(target, prompt)
        self._cached = list(prompt)

    # The windowed draft: passes on the target's own cache, rolled back after each draft.

    def _start(self, state: DecodeState, budget: int) -> tuple[torch.Tensor | None, int]:
        if not self.windowed:
            return super()._start(state, budget)
        if self._target is None:
            raise RuntimeError("kvdraft.draft() before begin()")
        self._origin = self._target.length
        budget = self.within_rollback(min(budget, self._target.info.max_length - len(state.tokens)), self._target)
        if budget <= 0:
            return None, 0
        return self._windowed(state.tokens[self._origin :]), budget

    def _advance(self, token: int) -> torch.Tensor:
        if not self.windowed:
            return super()._advance(token)
        return self._windowed([token])

    def _windowed(self, tokens: list[int]) -> torch.Tensor:
        assert self._target is not None and isinstance(self.policy, StreamingPolicy)
        self.last_steps += 1
        out = self._target.append_windowed(torch.tensor([tokens]), self.policy.sink, self.policy.window)
        return out.logits[0, -1]

    def _stop(self, state: DecodeState) -> None:
        if self.windowed and self._target is not None and self._target.length > self._origin:
            self._target.truncate(self._origin)


register_drafter(
    "kvdraft", "the target attending to a compressed KV cache drafts chains, its full cache verifies (draft_cache=POLICY)",
    options=OPTIONS,
)(CompressedCacheDrafter)
