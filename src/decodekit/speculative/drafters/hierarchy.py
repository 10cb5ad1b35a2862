"""Hierarchy drafting (Cho et al. 2024, "Lossless acceleration of large language models with
hierarchical drafting based on temporal locality in speculative decoding").

Drafters are asked in priority order of temporal locality — the request's own context
(prompt lookup), then model-dependent tables (token recycling), then statistics over earlier
outputs (suffix automaton with the cross-request corpus) — and their proposals are merged into
one tree with shared prefixes deduplicated; every node's ``source`` names the drafter that
proposed it. Model-free; lossless through the verifier.

Choice the paper leaves open: each drafter but the last may use at most half of the remaining
budget (so a long context match still leaves room for the next level); the last takes the rest.
"""

from __future__ import annotations

from ...engine.core import DecodeState
from ...errors import InvalidParameter, UnknownMethod
from ...options import OptionSpec, option_table
from ..tree import DraftTree, merge_into
from . import DRAFTER_SPECS, register_drafter
from .base import CompositeDrafter

DEFAULT_ORDER = ("pld", "recycling", "suffix")
LEVEL_OPTIONS = {"suffix": {"corpus": True}}  # the statistics level draws on earlier outputs


def parse_names(option: str, value, allowed: set[str] | None = None) -> list[str]:
    """A list of drafter names from a list or a comma-separated string."""
    if isinstance(value, str):
        names = [v.strip() for v in value.split(",")]
    elif isinstance(value, (list, tuple)):
        names = list(value)
    else:
        raise InvalidParameter(f"{option} must be a list or a comma-separated string of drafter names, got {value!r}")
    if not names or not all(isinstance(n, str) and n for n in names):
        raise InvalidParameter(f"{option} must name drafters, got {value!r}")
    for n in names:
        if n not in DRAFTER_SPECS or (allowed is not None and n not in allowed):
            choices = ", ".join(sorted(allowed if allowed is not None else DRAFTER_SPECS))
            if n in DRAFTER_SPECS:  # known, but not here
                raise InvalidParameter(f"drafter {n!r} cannot be one of {option} (it is a combination itself, or needs "
                                       f"options of its own); choose from: {choices}", param=option)
            raise UnknownMethod(f"unknown drafter {n!r} in {option}; choose from: {choices}", param=option)
    return names


#: Drafters that cannot be built without an option of their own, which a combination does not pass on.
NEEDS_ITS_OWN_OPTIONS = frozenset({"draft"})  # its draft_model

OPTIONS = option_table(
    OptionSpec("order", object, DEFAULT_ORDER, "drafters in priority order (a list or comma-separated names)"),
)


@register_drafter("hierarchy", "hierarchy drafting: context n-grams, then recycled tokens, then the output corpus",
                  options=OPTIONS)
class HierarchyDrafter(CompositeDrafter):
    name = "hierarchy"

    def __init__(self, order=DEFAULT_ORDER):
        names = parse_names("order", order, set(DRAFTER_SPECS) - {"hierarchy", "auto"} - NEEDS_ITS_OWN_OPTIONS)
        # a drafter named twice is one level (as ``auto``'s arms): a second would only repeat the first's
        # proposals, and a second suffix level would add each output to the corpus twice
        self.parts = [DRAFTER_SPECS[n].factory(**LEVEL_OPTIONS.get(n, {})) for n in dict.fromkeys(names)]

    def draft(self, state: DecodeState, budget: int) -> DraftTree:
        tree = DraftTree()
        for i, part in enumerate(self.parts):
            left = budget - len(tree)
            if left <= 0:
                break
            share = left if i == len(self.parts) - 1 else max(1, left // 2)
            merge_into(tree, part.draft(state, share), len(tree) + share)
        return tree
