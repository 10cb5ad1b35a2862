"""Self-speculation from a compressed KV cache: the target drafts with a small cache and verifies
with its full one.

Papers: Sun et al., 2024, "TriForce: Lossless Acceleration of Long Sequence Generation with
Hierarchical Speculative Decoding"; Sadhukhan et al., 2024, "MagicDec: Breaking the
Latency-Throughput Tradeoff for Long Context Generation with Speculative Decoding". At long
context a step's cost is attention over the cache as much as the weights; the same model with a
small cache is a cheap and well-aligned draft model. Lossless: the full-cache target verifies
every token with the project's verifiers (token-identical to plain greedy; plain sampling's
distribution under speculative sampling).

Choices the papers leave open (each one tested):
  * The draft's cache is a :mod:`~decodekit.models.kv_policy` policy over the target's own
    entries (``kv_cache``, default StreamingLLM with 4 sinks and a 256-token window, MagicDec's
    draft; TriForce retrieves chunks instead). It is made from the target's cache after the
    prompt (:meth:`NativeLlama.adopt`), so the prompt is not read twice; afterwards it follows
    ``state.tokens`` like any draft model (roll back to the common prefix, append what is missing).
  * Chains, one token per draft pass, with the chain drafters' confidence stop; the controller
    sizes them from measured costs, as for every drafter. No second-level draft (TriForce's
    hierarchy): ``hierarchy`` can combine ``kvdraft`` with the context drafters.
  * Native backend only (it owns the cache policies).
"""

from __future__ import annotations

import dataclasses

from ...engine.core import DecodeState
from ...errors import InvalidParameter
from ...models.kv_policy import parse_kv_cache
from ...options import OptionSpec, option_table
from . import register_drafter
from .base import CHAIN_OPTIONS
from .draft_model import DraftModelDrafter

DEFAULT_CACHE = "sink:4,window:256"

OPTIONS = option_table(
    OptionSpec("kv_cache", str, DEFAULT_CACHE, "the draft's cache policy (a --kv-cache spelling other than full)"),
    CHAIN_OPTIONS,
    dataclasses.replace(CHAIN_OPTIONS["stochastic"], default=True),
)


class CompressedCacheDrafter(DraftModelDrafter):
    """The target model with a compressed cache drafts chains (TriForce, MagicDec). Lossless
    under the project's verifiers. Options: ``kv_cache`` (the draft's policy), ``confidence``,
    ``stochastic``, ``max_draft`` (see the module docstring)."""

    name = "kvdraft"

    def __init__(self, *, kv_cache: str = DEFAULT_CACHE, max_draft: int = 6, confidence: float = 0.3,
                 stochastic: bool = True):
        super().__init__(draft_model=None, max_draft=max_draft, confidence=confidence, stochastic=stochastic)
        self.policy = parse_kv_cache(kv_cache)
        if not self.policy.one_sequence():
            raise InvalidParameter(f"kvdraft needs a compressed kv_cache (e.g. {DEFAULT_CACHE} or int8), got {self.policy.spec!r}")

    def _parse_spec(self, spec: object) -> object:
        return None  # the draft is the target itself, found at begin()

    def begin(self, state: DecodeState) -> None:
        target = state.backend
        if not hasattr(target, "with_kv_cache"):
            raise InvalidParameter(f"kvdraft needs the native backend, not {target.info.architecture}")
        if target.kv_policy.one_sequence():
            raise InvalidParameter(f"kvdraft drafts for a full cache; this model's is {target.kv_policy.spec}")
        self.backend = target.memory(("kvdraft", self.policy.spec), lambda: target.with_kv_cache(self.policy))
        prompt = state.tokens[: target.length]
        self.backend.adopt(target, prompt)
        self._cached = list(prompt)


register_drafter(
    "kvdraft", "the target with a compressed KV cache drafts chains, its full cache verifies (kv_cache=POLICY)",
    stochastic=True, options=OPTIONS,
)(CompressedCacheDrafter)
