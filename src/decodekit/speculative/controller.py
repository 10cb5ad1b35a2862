"""How much to speculate: a measured verify-cost table plus learned acceptance.

The right tree size depends on the machine: on this CPU a 16-token pass costs ~7x a 1-token
pass in float32 on GGUF blocks but ~3x in bfloat16. :class:`CostTable` measures the target's
forward cost per number of tokens once (cached as JSON under ``cache_root()``, keyed by model,
dtype and torch thread count), every size up to 8 tokens because the curve has steps there.
:func:`prepare` does that when a model is set up (``decodekit bench`` calls it before any
timing), so the first request does not pay for the measurement.
In a process, one table per backend follows the timed passes of every request on it, each observation
clamped so that one stalled pass cannot make speculation look cheap; only measured tables are
written to disk. :class:`Controller` keeps an exponential moving average of the
probability that a draft node is accepted given its parent was, per (drafter, depth, sibling
rank), and each step keeps the subset of the drafted tree that maximises expected tokens per
second — ``(1 + sum of the kept nodes' acceptance probabilities) / (cost(n + 1) + overhead)`` —
against plain decoding's ``1 / cost(1)``. Keeping nothing (a plain step) is a choice, so
speculation that does not pay falls back to plain decoding. (Our design; the per-node model is
the one behind EAGLE-2's and Sequoia's tree sizing, with counts instead of draft confidences.)

Acceptance estimates, drafting costs and realised speed are kept in the backend's memory, per
drafter, across requests. A cold start must not be paid for by the first requests (our choices):
  * Conservative prior. A first-level node never verified is assumed accepted with
    probability ``PRIOR_ACCEPT`` / (1 + rank): too little to pay for a verification unless
    verifying is nearly free, so a guess alone never verifies a large tree. A deeper node never verified
    borrows the estimate of the nearest level above it (the closest evidence).
  * Fast first estimates. The prior counts as ``PRIOR_WEIGHT`` observations: the first outcomes
    of a node key are averaged with it (one accepted probe lifts 0.1 to 0.4), and only then does
    the moving average take over.
  * Cheap probes. With nothing learnt, a tree is not verified unless verifying is nearly free;
    the controller backs off one plain step and then probes (below). Every probe verifies one node, whatever the drafter
    (also a lookahead window, which is otherwise verified whole). A drafter that finds no match
    proposes nothing, and nothing is verified.
When the best choice is a plain step the controller stops drafting for 1, 2, 4, ... steps and
then explores with the single best node, so acceptance estimates keep being refreshed; the
longest pause (4 to 512 steps) is set so such probes cost about 1% of decode time (a probe of a
draft model that must first catch up with the context costs several forward passes).

The per-node model can be optimistic (acceptance estimates lag, a lookahead window is all or
nothing), so the controller also measures what speculation *realises*: tokens per second of
its speculative steps, drafting and bookkeeping included (ratio of moving averages). When that
falls below plain decoding's ``1 / cost(1)``, it backs off as above whatever the model expects,
and only probes until speculation measurably pays again: never slower than plain decoding by
measurement, not only by estimate. (Our design.)

Drafting itself can cost as much as verifying (a draft model, or the target with layers
skipped). The controller times drafting per drafted node, and when that is not negligible it
decides *before* drafting how deep a chain is worth drafting — maximising
``(1 + expected accepted) / (depth * draft cost per node + cost(depth + 1) + overhead)`` — and
takes a plain step without drafting when no depth beats plain decoding. Once a tree is drafted
its cost is spent, so :meth:`Controller.select` weighs only verification.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameter
from ..models.backend import Backend
from .tree import DraftTree, Verification, select_nodes

MEASURE_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)
MEASURE_CONTEXT = 256  # tokens of context a set-up measurement puts before its passes (a typical prompt)
MAX_BACKOFF = 512
MIN_REALISED_STEPS = 8  # speculative steps measured before their realised speed can veto drafting
EXPLORE_SHARE = 0.01  # at most ~1% of decode time spent on probes that do not pay
MAX_DEPTH_KEY = 15
MAX_RANK_KEY = 7
CHEAP_DRAFT = 0.02  # drafting a full budget under 2% of a plain step: no need to plan the depth
PRIOR_ACCEPT = 0.1  # assumed P(accepted) of a first-level node never verified (rank 0)
PRIOR_WEIGHT = 2.0  # ... worth this many observations: the first ones are averaged with it


class CostTable:
    """Seconds per forward pass of ``n`` new tokens, linearly interpolated between measured sizes."""

    def __init__(self, table: Mapping[int, float]):
        if not table or 1 not in table:
            raise InvalidParameter("a cost table needs at least the cost of 1 token (key 1)")
        if any(not (isinstance(v, (int, float)) and v > 0) for v in table.values()):
            raise InvalidParameter("cost table values must be positive seconds")
        self.sizes = sorted(int(k) for k in table)
        self.costs = [float(table[k]) for k in self.sizes]

    def __call__(self, n: int) -> float:
        sizes, costs = self.sizes, self.costs
        if n <= sizes[0]:
            return costs[0]
        for i in range(1, len(sizes)):
            if n <= sizes[i]:
                t = (n - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
                return costs[i - 1] + t * (costs[i] - costs[i - 1])
        if len(sizes) == 1:
            return costs[0] * n
        slope = (costs[-1] - costs[-2]) / (sizes[-1] - sizes[-2])
        return costs[-1] + slope * (n - sizes[-1])

    def as_dict(self) -> dict[str, float]:
        return {str(k): v for k, v in zip(self.sizes, self.costs)}

    def observe(self, n: int, seconds: float, weight: float = 0.2, max_jump: float = 1.5) -> None:
        """Blend a timed pass of ``n`` tokens into the nearest measured size (scaled by the table's
        own shape), so a table measured under other load follows the machine as it is now. The
        observation is clamped to within ``max_jump`` times the current value: a pass stalled by
        another process moves the table by at most 10%, a lasting change still within a few passes."""
        anchor = min(range(len(self.sizes)), key=lambda i: abs(math.log(self.sizes[i] / n)))
        current = self.costs[anchor]
        target = min(max(seconds * current / self(n), current / max_jump), current * max_jump)
        self.costs[anchor] += weight * (target - current)

    @staticmethod
    def key(backend: Backend) -> str:
        info = backend.info
        dtype = str(info.dtype).removeprefix("torch.")
        return f"{info.name}|{info.architecture}|{dtype}|threads={torch.get_num_threads()}"

    @classmethod
    def measure(cls, backend: Backend, sizes=MEASURE_SIZES, rounds: int = 3) -> "CostTable":
        """Time ``append`` of n tokens after the current cache, then roll back (the cache is left
        as it was). An empty cache (set-up, before any request) first gets ``MEASURE_CONTEXT``
        tokens of context, since a pass's cost grows with the context it attends to. Sizes are
        interleaved over ``rounds`` rounds after a warm-up and the minimum kept, so a burst of
        load does not skew one size only."""
        start = backend.length
        if start == 0:
            backend.reset(1)
            context = max(1, min(MEASURE_CONTEXT, backend.info.max_length - max(sizes) - 1))
            backend.append(torch.zeros(1, context, dtype=torch.long), last_only=True)
        origin = backend.length
        room = backend.info.max_length - origin
        sizes = [n for n in sizes if n <= room] or [1]
        best = {n: math.inf for n in sizes}
        try:
            for rnd in range(rounds + 1):
                for n in sizes:
                    t0 = time.perf_counter()
                    backend.append(torch.zeros(1, n, dtype=torch.long))
                    elapsed = time.perf_counter() - t0
                    backend.truncate(origin)
                    if rnd:
                        best[n] = min(best[n], elapsed)
        finally:
            backend.truncate(start)
        return cls(best)

    @staticmethod
    def _path():
        from ..models.cache import cache_root

        return cache_root() / "speculative" / "verify_cost.json"

    @classmethod
    def cached(cls, backend: Backend) -> "CostTable":
        """The cached table for this model/dtype/threads, measured (and saved) the first time, or
        again when the cached one lacks a size this version measures or is damaged."""
        from ..models.cache import read_json

        saved = read_json(cls._path())  # None when missing or failing its check (reported)
        entry = saved.get(cls.key(backend)) if isinstance(saved, dict) else None
        if isinstance(entry, dict) and {str(n) for n in MEASURE_SIZES} <= set(entry):
            try:
                return cls({int(k): v for k, v in entry.items()})
            except (InvalidParameter, ValueError):
                pass  # written by a version that stored something else: measure again
        table = cls.measure(backend)
        table.save(backend)
        return table

    @classmethod
    def shared(cls, backend: Backend) -> "CostTable":
        """The one in-memory table of ``backend``, which every request's timings refine."""
        return backend.memory("speculative.cost_table", lambda: cls.cached(backend))

    def save(self, backend: Backend) -> None:
        """Store this table as the one for ``backend``'s model/dtype/threads (other keys kept)."""
        from ..models.cache import update_json

        key, table = self.key(backend), self.as_dict()

        def with_table(saved: object) -> dict:
            return {**(saved if isinstance(saved, dict) else {}), key: table}

        try:
            update_json(self._path(), with_table)
        except OSError:
            pass  # a read-only cache only costs a re-measurement next time


def prepare(backend: Backend) -> CostTable:
    """Make ``backend``'s verify-cost table ready before its first request: read from the disk
    cache, or measured now (about a second) the first time this model, dtype and thread count
    run on the machine. Whoever sets a model up calls it once per backend, outside any timed
    region (``decodekit bench`` does, before its warm-up), so that no request pays for it."""
    return CostTable.shared(backend)


@dataclass
class DrafterRecord:
    """What the controller has learnt about one drafter on one backend, kept across requests.
    Averages are exponential moving averages."""

    accept: dict[tuple[str, int, int], float] = field(default_factory=dict)  # P(accepted | parent) per node key
    seen: dict[tuple[str, int, int], int] = field(default_factory=dict)  # verifications behind each estimate
    draft_seconds: float = 0.0  # per draft call
    draft_nodes: float = 0.0  # proposed per draft call
    draft_calls: int = 0
    backoff: int = 0  # plain steps between probes at the current back-off level
    step_tokens: float = 0.0  # tokens per speculative step
    step_seconds: float = 0.0  # seconds per speculative step, drafting and bookkeeping included
    spec_steps: int = 0
    chain_source: str = ""  # source of the last tree's first node: whose acceptance plans a chain

    @property
    def draft_node_s(self) -> float:
        """Seconds of drafting per drafted node (a ratio of averages: empty drafts cost too)."""
        return self.draft_seconds / max(self.draft_nodes, 1e-3)


def prior_acceptance(rank: int) -> float:
    """Starting guess for P(accepted) of a first-level node of sibling rank ``rank`` never verified:
    conservative, so that a guess alone never buys a verification where verifying costs."""
    return PRIOR_ACCEPT / (1 + rank)


class Controller:
    """Chooses each step's draft budget and the part of the drafted tree worth verifying."""

    def __init__(
        self,
        max_draft: int = 32,
        *,
        budget: int | None = None,
        cost_table: CostTable | Mapping[int, float] | None = None,
        ema: float = 0.15,
    ):
        self.max_draft = max_draft
        self.fixed = budget
        self.cost = cost_table if isinstance(cost_table, CostTable) or cost_table is None else CostTable(cost_table)
        self.ema = ema
        self.learnt = DrafterRecord()  # this request's until begin() finds the drafter's record
        self.overhead = 0.0  # seconds of verifier bookkeeping per speculative step (EMA)
        self._skip = 0  # plain steps left before drafting again
        self._explore = False
        self.learn_costs = False  # True for a measured table: it follows observed pass times

    def begin(self, backend: Backend, drafter: str = "") -> None:
        """Per request: take the backend's cost table (measured on first use) and the record of
        what earlier requests of the same drafter on the same model learnt. The back-off level
        carries over, the pause does not: a new prompt is judged afresh at its first step."""
        if self.fixed is None and self.cost is None:
            self.cost = CostTable.shared(backend)
            self.learn_costs = True
        if drafter:
            records: dict[str, DrafterRecord] = backend.memory("speculative.records", dict)
            self.learnt = records.setdefault(drafter, self.learnt)

    def observe_cost(self, n: int, seconds: float) -> None:
        """A timed forward pass of ``n`` tokens (1 = a plain step)."""
        if self.learn_costs and self.cost is not None:
            self.cost.observe(n, seconds)

    @property
    def draft_node_s(self) -> float:
        return self.learnt.draft_node_s

    # Decisions -----------------------------------------------------------------------------

    def budget(self) -> int:
        """Nodes the drafter may propose this step (0: take a plain step without drafting)."""
        if self.fixed is not None:
            return self.fixed
        if self._skip > 0:
            self._skip -= 1
            self._explore = self._skip == 0
            return 0
        if not self._explore and not self.speculation_pays():
            self._back_off()  # measured slower than plain decoding: rest, then probe
            return 0
        if not self.costly_drafting():  # drafting is nearly free: let select() trim the tree,
            return 1 if self._explore else self.max_draft  # but a probe is one node whatever the drafter
        depth = self.best_chain_depth()
        if depth > 0:
            self.learnt.backoff = 0
        elif not self._explore:
            self._back_off()
        else:
            depth = 1  # a one-node probe keeps the acceptance estimate fresh
        return depth

    def speculation_pays(self) -> bool:
        """Whether speculative steps have realised at least plain decoding's tokens per second
        (assumed until ``MIN_REALISED_STEPS`` of them are measured)."""
        learnt = self.learnt
        if learnt.spec_steps < MIN_REALISED_STEPS:
            return True
        return learnt.step_tokens / learnt.step_seconds >= 1.0 / self.cost(1)

    def costly_drafting(self) -> bool:
        """Whether drafting a full budget costs more than a small share of a plain step."""
        return self.draft_node_s * self.max_draft >= CHEAP_DRAFT * self.cost(1)

    def best_chain_depth(self) -> int:
        """The chain depth (0 = none) with the best expected tokens per second, counting
        drafting at the measured cost per node."""
        best_depth, best_rate = 0, 1.0 / self.cost(1)
        expected, reach = 1.0, 1.0
        for depth in range(1, self.max_draft + 1):
            reach *= self._accept((self.learnt.chain_source, min(depth - 1, MAX_DEPTH_KEY), 0))
            expected += reach
            rate = expected / (depth * self.draft_node_s + self.cost(depth + 1) + self.overhead)
            if rate > best_rate:
                best_depth, best_rate = depth, rate
        return best_depth

    def select(self, tree: DraftTree, *, trimmable: bool = True) -> DraftTree:
        """The part of ``tree`` to verify (possibly empty: a plain step pays better)."""
        if self.fixed is not None:
            return tree.truncated(self.fixed)
        if not len(tree):
            return tree
        probs = self.node_probs(tree)
        order = sorted(range(len(tree)), key=lambda i: -probs[i]) if trimmable else list(range(len(tree)))
        best_n, best_rate = 0, 1.0 / self.cost(1)
        expected = 1.0
        for n, node in enumerate(order, start=1):
            expected += probs[node]
            rate = expected / (self.cost(n + 1) + self.overhead)
            if rate > best_rate and (trimmable or n == len(order)):
                best_n, best_rate = n, rate
        explore, self._explore = self._explore, False
        if best_n == 0:
            self._back_off()
            if not explore:
                return DraftTree()
            best_n = 1 if trimmable else len(order)
        elif not self.costly_drafting() and self.speculation_pays():
            self.learnt.backoff = 0  # (costly drafting: budget() decides when to back off)
        return select_nodes(tree, order[:best_n]) if best_n < len(tree) else tree

    def _back_off(self) -> None:
        """Plain steps before drafting again: 1, 2, 4, ... up to :meth:`_max_backoff`."""
        self.learnt.backoff = min(self._max_backoff(), max(1, 2 * self.learnt.backoff))
        self._skip = self.learnt.backoff

    def _max_backoff(self) -> int:
        """Plain steps between probes, so that a probe costs about EXPLORE_SHARE of the time. A probe
        loses what a one-node step costs beyond a plain step, or, once measured, what speculative
        steps took beyond the plain steps their tokens would have needed, if that is more."""
        extra = (self.cost(2) + self.overhead + self.draft_node_s) / self.cost(1) - 1.0
        learnt = self.learnt
        if learnt.spec_steps >= MIN_REALISED_STEPS:
            extra = max(extra, learnt.step_seconds / self.cost(1) - learnt.step_tokens)
        return max(4, min(MAX_BACKOFF, math.ceil(extra / EXPLORE_SHARE)))

    def node_probs(self, tree: DraftTree) -> list[float]:
        """Estimated P(node on the accepted path) for every node."""
        probs: list[float] = []
        for parent, key in zip(tree.parents, node_keys(tree)):
            probs.append((1.0 if parent < 0 else probs[parent]) * self._accept(key))
        return probs

    # Learning ------------------------------------------------------------------------------

    def observe_draft(self, nodes: int, seconds: float) -> None:
        """A timed draft call that proposed ``nodes`` nodes (before trimming). Calls that propose
        nothing (a confidence stop, no match) still cost time: the per-node cost is the ratio of
        the averages of seconds and of nodes per call."""
        learnt = self.learnt
        if learnt.draft_calls == 0:
            learnt.draft_seconds, learnt.draft_nodes = seconds, float(nodes)
        else:
            learnt.draft_seconds += self.ema * (seconds - learnt.draft_seconds)
            learnt.draft_nodes += self.ema * (nodes - learnt.draft_nodes)
        learnt.draft_calls += 1

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A speculative step (drafting, verification and bookkeeping took ``seconds``) produced ``tokens``."""
        learnt = self.learnt
        if learnt.spec_steps == 0:
            learnt.step_tokens, learnt.step_seconds = float(tokens), seconds
        else:
            learnt.step_tokens += self.ema * (tokens - learnt.step_tokens)
            learnt.step_seconds += self.ema * (seconds - learnt.step_seconds)
        learnt.spec_steps += 1

    def observe(self, tree: DraftTree, verdict: Verification, overhead_s: float) -> None:
        """Update acceptance estimates from the children of every accepted node (and the root);
        ``overhead_s`` is the step's verifier bookkeeping beyond its forward pass."""
        first = self.overhead == 0.0
        self.overhead = overhead_s if first else self.overhead + self.ema * (overhead_s - self.overhead)
        if self.fixed is not None:
            return
        if len(tree):
            self.learnt.chain_source = tree.source[0] if tree.source else ""
        learnt = self.learnt
        on_path = {-1, *verdict.path}
        for i, (parent, key) in enumerate(zip(tree.parents, node_keys(tree))):
            if parent in on_path:
                seen = learnt.seen.get(key, 0)
                # the first outcomes are averaged with the starting guess (worth PRIOR_WEIGHT of them),
                # so a few probes move it far; later ones feed a moving average that follows the text
                rate = max(self.ema, 1.0 / (seen + 1 + PRIOR_WEIGHT))
                old = self._accept(key)
                learnt.accept[key] = old + rate * ((i in on_path) - old)
                learnt.seen[key] = seen + 1

    def _accept(self, key: tuple[str, int, int]) -> float:
        """Estimated P(accepted | parent accepted) for ``key``. A depth never verified borrows the
        estimate of the nearest depth above it with the same source and rank (the closest
        evidence: a drafter that is right at depth 0 is usually right below it too); a first
        level never verified starts from :func:`prior_acceptance`."""
        source, depth, rank = key
        while (value := self.learnt.accept.get((source, depth, rank))) is None:
            if depth == 0:
                return prior_acceptance(rank)
            depth -= 1
        return value


def node_keys(tree: DraftTree) -> list[tuple[str, int, int]]:
    """(source, depth, sibling rank) of every node, capped: the keys acceptance is tracked under."""
    keys: list[tuple[str, int, int]] = []
    depth: list[int] = []
    rank_of: dict[int, int] = {}
    for i, parent in enumerate(tree.parents):
        rank = rank_of.get(parent, 0)
        rank_of[parent] = rank + 1
        depth.append(0 if parent < 0 else depth[parent] + 1)
        source = tree.source[i] if tree.source else ""
        keys.append((source, min(depth[i], MAX_DEPTH_KEY), min(rank, MAX_RANK_KEY)))
    return keys
