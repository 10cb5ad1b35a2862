"""The drafter interface: propose a token tree below the pending token, learn from the verdict."""

from __future__ import annotations

from abc import ABC, abstractmethod

from ...engine.core import DecodeState
from ..tree import DraftTree, Verification


class Drafter(ABC):
    """Proposes continuations. Must not leave the target backend's cache changed (a drafter
    that runs the target, like layer skipping, rolls back what it wrote)."""

    name: str = "drafter"

    def begin(self, state: DecodeState) -> None:
        """Called once per request after prefill (e.g. index the prompt)."""

    @abstractmethod
    def draft(self, state: DecodeState, budget: int) -> DraftTree:
        """A tree of at most ``budget`` nodes continuing ``state.tokens`` (whose last token is the root)."""

    def update(self, state: DecodeState, tree: DraftTree, verdict: Verification, logits) -> None:
        """Called after each verification with the target's logits for [root] + tree nodes
        (``[N + 1, V]``), before ``state.tokens`` is extended by the accepted tokens."""
