"""``auto``: choose the drafter online with a bandit on measured tokens per second.

After BanditSpec (Hou et al. 2025, "BanditSpec: adaptive speculative decoding via bandit
algorithms"): each step is one pull of an arm (a drafter); the reward is that step's tokens
per second, measured around the whole draft–verify step. We use discounted UCB (Garivier &
Moulines 2011) — UCB1 whose counts decay by ``discount`` per pull, so the choice follows a
request whose character changes (a summary copies the prompt, an essay does not) — with the
exploration bonus scaled by the rewards' pooled standard deviation, since tokens/s is not
bounded in [0, 1]. The statistics live in the backend's memory, so they carry across requests.
Every arm sees every verification (``update``), so all their tables stay current; arms that are
also levels of the ``hierarchy`` arm are the same instances (one index, one update per step).

Lossless: each step is verified exactly, whichever drafter proposed it. Choices depend on
timings, but a sampled token is fixed by the seed and its position (keyed draws), whatever was
drafted: with a seed, the tokens are plain sampling's, exactly.
"""

from __future__ import annotations

import math

from ...engine.core import DecodeState
from ...options import OptionSpec, option_table
from ..tree import DraftTree
from . import DRAFTER_SPECS, register_drafter
from .base import CompositeDrafter
from .hierarchy import NEEDS_ITS_OWN_OPTIONS, parse_names

#: Bandits a model keeps, one per setting of ``discount`` and ``exploration`` (the most recently
#: used): requests varying them must not grow memory without bound.
KEPT_BANDITS = 4

DEFAULT_ARMS = ("hierarchy", "pld", "recycling", "suffix")


class DiscountedUCB:
    """Discounted UCB over arms with real-valued rewards."""

    def __init__(self, arms: list[str], discount: float = 0.98, exploration: float = 1.0):
        self.arms = list(arms)
        self.discount = discount
        self.exploration = exploration
        self.count = {a: 0.0 for a in arms}
        self.total = {a: 0.0 for a in arms}
        self.squares = {a: 0.0 for a in arms}

    def choose(self) -> str:
        for arm in self.arms:  # every arm once first
            if self.count[arm] == 0:
                return arm
        pulls = sum(self.count.values())
        scale = self._spread()
        return max(
            self.arms,
            key=lambda a: self.total[a] / self.count[a]
            + self.exploration * scale * math.sqrt(2 * math.log(max(pulls, 1.0 + 1e-9)) / self.count[a]),
        )

    def reward(self, arm: str, value: float) -> None:
        for a in self.arms:
            self.count[a] *= self.discount
            self.total[a] *= self.discount
            self.squares[a] *= self.discount
        self.count[arm] += 1.0
        self.total[arm] += value
        self.squares[arm] += value * value

    def _spread(self) -> float:
        n = sum(self.count.values())
        mean = sum(self.total.values()) / n
        variance = sum(self.squares.values()) / n - mean * mean
        return math.sqrt(max(variance, 0.0)) or abs(mean) or 1.0

    def report(self) -> dict[str, float]:
        return {a: round(self.total[a] / self.count[a], 2) for a in self.arms if self.count[a] > 0}


OPTIONS = option_table(
    OptionSpec("arms", object, DEFAULT_ARMS, "drafters to choose from (a list or comma-separated names)"),
    OptionSpec("discount", float, 0.98, "weight of past rewards per step", lo=0.0, hi=1.0, lo_open=True),
    OptionSpec("exploration", float, 1.0, "UCB exploration weight", lo=0.0),
)


@register_drafter("auto", "picks the drafter each step with a discounted-UCB bandit on measured tokens/s",
                  options=OPTIONS)
class BanditDrafter(CompositeDrafter):
    name = "auto"

    def __init__(self, arms=DEFAULT_ARMS, discount: float = 0.98, exploration: float = 1.0):
        names = parse_names("arms", arms, set(DRAFTER_SPECS) - {"auto"} - NEEDS_ITS_OWN_OPTIONS)
        self.names = list(dict.fromkeys(names))
        arms_by_name = {n: DRAFTER_SPECS[n].factory() for n in self.names}
        for arm in list(arms_by_name.values()):  # an arm that is also part of a composite arm is shared
            for leaf in arm.leaves() if isinstance(arm, CompositeDrafter) else []:
                if not isinstance(arms_by_name.get(leaf.name, arm), CompositeDrafter):
                    arms_by_name[leaf.name] = leaf
        self.parts = [arms_by_name[n] for n in self.names]
        self.discount = OPTIONS["discount"].parse(discount)
        self.exploration = OPTIONS["exploration"].parse(exploration)

    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        key = ("auto.bandit", tuple(self.names), self.discount, self.exploration)
        self.bandit = state.backend.memory(key, lambda: DiscountedUCB(self.names, self.discount, self.exploration),
                                           keep=KEPT_BANDITS)
        self.chosen: str | None = None
        self.pulls = {n: 0 for n in self.names}

    def draft(self, state: DecodeState, budget: int) -> DraftTree:
        self.chosen = self.bandit.choose()
        self.pulls[self.chosen] += 1
        return self.parts[self.names.index(self.chosen)].draft(state, budget)

    @property
    def trimmable(self) -> bool:  # type: ignore[override]
        """The arm that drafted this step's tree says (lookahead's is all or nothing)."""
        chosen = getattr(self, "chosen", None)  # (None before a request begins)
        return chosen is None or self.parts[self.names.index(chosen)].trimmable

    def observe(self, tokens: int, seconds: float) -> None:
        """The loop reports each step's output; steps without a draft (controller backoff) are not pulls."""
        if self.chosen is not None and seconds > 0:
            self.bandit.reward(self.chosen, tokens / seconds)
        self.chosen = None

    def report(self) -> dict:
        return {"arm_pulls": dict(self.pulls), "arm_tokens_per_s": self.bandit.report()}
