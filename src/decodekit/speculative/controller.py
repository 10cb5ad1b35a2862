"""How much to speculate: a measured verify-cost table plus learned acceptance.

The right tree size depends on the machine, the numerics and the context: a many-token pass
costs several 1-token passes, more so after a long prompt (every row attends to the whole
context). :class:`CostTable` measures the target's forward cost per number of tokens once, at
two context lengths and the current one where it is longer (cached as JSON under
``cache_root()`` or in ``$DECODEKIT_COST_TABLE``, keyed by model, dtype, torch thread count,
kernels and cache policy), every size up to 8 tokens because the curve has steps there; the
controller prices each step's passes at the request's current length.
:func:`prepare` does that when a model is set up (``decodekit bench`` calls it before any
timing), so the first request does not pay for the measurement.
In a process, one table per backend follows the timed passes of every request on it, each observation
clamped so that one stalled pass cannot make speculation look cheap; only measured tables are
written to disk. :class:`Controller` keeps an exponential moving average of the
probability that a draft node is accepted given its parent was, per (drafter, depth, sibling
rank), and each step keeps the subset of the drafted tree that maximises expected tokens per
second — ``(1 + sum of the kept nodes' acceptance probabilities) / (cost(n + 1) + overhead)`` —
against plain decoding's ``1 / cost(1)``, which a tree must beat by ``GAIN_MARGIN`` (the
estimates err both ways, and a step that loses costs as much as one that wins gains). Keeping
nothing (a plain step) is a choice, so
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
Batches (``decodekit serve``): a request whose passes run with other sequences' weighs the whole
batch, as SmartSpec's goodput rule does (Liu et al., 2024, "Optimizing Speculative Decoding for
Serving Large Language Models Using Goodput"): with ``B`` other sequences carrying ``R`` rows (the
last batch it joined), verifying ``n`` nodes expecting ``E`` tokens yields ``(B + 1 + E) / cost(R +
n + 1)`` tokens per second for the batch, against ``(B + 1) / cost(R + 1)`` for a plain step. Past the
few rows where a pass costs little more than one row, extra rows slow every sequence of the batch, so
speculation backs off as the batch fills. Alone, this is the rule above. The 5% margin applies to
the batch's rate. (Our reading: SmartSpec chooses every request's length jointly; here each request
decides for itself, assuming each other sequence keeps its rows.)

When the best choice is a plain step the controller stops drafting for 1, 2, 4, ... steps and
then explores with the single best node, so acceptance estimates keep being refreshed; the
longest pause (4 to 512 steps) is set so such probes cost about 1% of decode time: a probe's
expected loss is its time in plain steps less the tokens it is expected to give (one, and its
node's estimate), so a drafter whose probes are mostly accepted is probed often, one whose
probes fail rarely (a probe of a draft model that must first catch up with the context costs
several forward passes).

The per-node model can be optimistic (acceptance estimates lag, a lookahead window is all or
nothing), so the controller also measures what speculation *realises*: tokens per second of
its speculative steps, drafting and bookkeeping included (ratio of moving averages). When that
falls below plain decoding's ``1 / cost(1)``, it backs off as above whatever the model expects,
and only probes until speculation measurably pays again: never slower than plain decoding by
measurement, not only by estimate. The model can be pessimistic too: the prior is learnt away
one probe at a time. So where a costly drafter's speculative steps have realised plain decoding's
speed and the 5% margin, it keeps drafting (one node a step at least, learning at every step)
while its estimates say no depth pays. (Our design.)

Drafting itself can cost as much as verifying (a draft model, or the target with layers
skipped). The controller times drafting per draft call and per drafted node; when a call is not
negligible against a plain step it
decides *before* drafting how deep a chain is worth drafting — maximising
``(1 + expected accepted) / (depth * draft cost per node + cost(depth + 1) + overhead)`` — and
takes a plain step without drafting when no depth beats plain decoding. Once a tree is drafted
its cost is spent, so :meth:`Controller.select` weighs only verification.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from typing import Any
from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameter
from ..models.backend import Backend
from ..models.kernels import sources_digest
from ..models.threads import GOVERNOR
from ..options import finite
from .tree import DraftTree, Verification, select_nodes

MEASURE_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)
MEASURE_CONTEXTS = (256, 1024)  # contexts a measurement puts before its passes (a typical prompt, a long one)
#: How long a measurement runs passes of one size before it moves on (the fastest is kept). On some
#: CPUs a pass right after passes of another size costs far more than in a run of its own size, for
#: up to about this long (docs/BENCHMARKS.md has the figures), and decoding runs passes of one size
#: in a row: plain steps, or verifications.
RUN_S = 0.1
MAX_BACKOFF = 512
MIN_REALISED_STEPS = 8  # speculative steps measured before their realised speed can veto drafting
EXPLORE_SHARE = 0.01  # at most ~1% of decode time spent on probes that do not pay
MAX_DEPTH_KEY = 15
MAX_RANK_KEY = 7
CHEAP_DRAFT = 0.02  # a draft call under 2% of a plain step: no need to plan the depth
PRIOR_ACCEPT = 0.1  # assumed P(accepted) of a first-level node never verified (rank 0)
PRIOR_WEIGHT = 2.0  # ... worth this many observations: the first ones are averaged with it
GAIN_MARGIN = 0.05  # speculate only where the estimate beats plain decoding by 5%: estimates err both ways


def _interpolate(xs: list[int], ys: list[float], x: int) -> float:
    """Piecewise-linear ``y(x)`` through the points, extended by the last segment's slope where it
    rises (a falling one, as a user's table may have, would price large passes at zero and below)."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    if len(xs) == 1:
        return ys[0] * x
    return ys[-1] + max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])) * (x - xs[-1])


def _non_decreasing(row: Mapping[int, float]) -> dict[int, float]:
    """Each size's cost, or a larger size's if that is lower (the lower envelope from the right)."""
    out: dict[int, float] = {}
    lowest = math.inf
    for n in sorted(row, reverse=True):
        lowest = out[n] = min(lowest, row[n])
    return out


def _line_at_or_above_zero(points: Mapping[int, float]) -> tuple[float, float]:
    """Least-squares ``a + b x`` through ``{x: y}`` with a, b >= 0."""
    xs, ys = list(points), list(points.values())
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0
    a = mean_y - b * mean_x
    if b < 0:  # flat: the mean
        return max(mean_y, 0.0), 0.0
    if a < 0:  # through zero
        return 0.0, max(sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs), 0.0)
    return a, b


def checked_costs(table: Mapping[Any, Any]) -> dict[int, float]:
    """A cost table given by a user, as ``{tokens: seconds}``: keys token counts >= 1 (integers,
    or their digits as JSON writes keys), values seconds from a nanosecond to an hour, the cost of
    1 token among them; anything else one InvalidParameter line."""
    if not isinstance(table, Mapping):
        raise InvalidParameter(f"cost_table must be a mapping of tokens to seconds, got {table!r:.60}", param="cost_table")
    out: dict[int, float] = {}
    for key, value in table.items():
        size = key if isinstance(key, int) and not isinstance(key, bool) else \
            int(key) if isinstance(key, str) and key.strip().isdigit() else None
        if size is None or size < 1:
            raise InvalidParameter(f"cost_table keys must be token counts >= 1, got {key!r:.40}", param="cost_table")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (finite(value) and 1e-9 <= value <= 3600):
            raise InvalidParameter(f"cost_table values must be seconds from 1e-9 to 3600, got {value!r:.40} for {size} "
                                   "tokens", param="cost_table")
        if size in out:
            raise InvalidParameter(f"cost_table gives the cost of {size} tokens twice", param="cost_table")
        out[size] = float(value)
    if 1 not in out:
        raise InvalidParameter("a cost table needs at least the cost of 1 token (key 1)", param="cost_table")
    return out


class CostTable:
    """Seconds per forward pass of ``n`` new tokens after ``context`` cached ones.

    ``table`` holds the costs at context ``at``, linearly interpolated between measured sizes;
    ``per_context`` (same sizes) the extra seconds per token of context, since every row of a
    pass attends to the whole context: a second row costs more after 1,000 tokens than after
    100, so a tree that pays after a short prompt may not after a long one. Without it (or
    without a context) the cost does not depend on the context."""

    def __init__(self, table: Mapping[int, float], *, at: int = 0, per_context: Mapping[int, float] | None = None):
        table = checked_costs(table)
        self.sizes = sorted(table)
        self.costs = [table[k] for k in self.sizes]
        self.at = int(at)
        per_context = per_context or {}
        if per_context and (set(map(int, per_context)) != set(self.sizes)
                            or any(not (isinstance(v, (int, float)) and 0 <= v < math.inf) for v in per_context.values())):
            raise InvalidParameter("per-context costs need the same sizes as the table, each finite and >= 0")
        self.slopes = [float(per_context.get(n, per_context.get(str(n), 0.0))) for n in self.sizes]
        self._anchors: dict[int, int] = {}

    def __call__(self, n: int, context: int | None = None) -> float:
        cost = _interpolate(self.sizes, self.costs, n)
        if context is None or not any(self.slopes):
            return cost
        # never below a tenth of the measured cost: a short context still pays for the weights
        return max(cost + (context - self.at) * _interpolate(self.sizes, self.slopes, n), 0.1 * cost)

    def as_dict(self) -> dict[str, float]:
        return {str(k): v for k, v in zip(self.sizes, self.costs)}

    def observe(self, n: int, seconds: float, context: int | None = None, weight: float = 0.2,
                max_jump: float = 1.5) -> None:
        """Blend a timed pass of ``n`` tokens into the nearest measured size (scaled by the table's
        own shape and context term), so a table measured under other load follows the machine as it
        is now. The observation is clamped to within ``max_jump`` times the prediction: a pass
        stalled by another process moves the table by at most 10%, a lasting change still within
        a few passes."""
        anchor = self._anchors.get(n)
        if anchor is None:  # the measured size nearest in ratio (computed once per n: this runs every step)
            anchor = self._anchors[n] = min(range(len(self.sizes)), key=lambda i: abs(math.log(self.sizes[i] / n)))
        ratio = min(max(seconds / self(n, context), 1.0 / max_jump), max_jump)
        factor = 1.0 + weight * (ratio - 1.0)
        self.costs[anchor] *= factor
        self.slopes[anchor] *= factor

    @staticmethod
    def key(backend: Backend) -> str:
        info = backend.info
        dtype = str(info.dtype).removeprefix("torch.")
        policy = getattr(backend, "kv_policy", None)  # a cache policy changes what a pass costs
        cache = f"|kv={policy.spec}" if policy is not None and policy.spec != "full" else ""
        return f"{info.name}|{info.architecture}|{dtype}|threads={GOVERNOR.full_count()}|kernels={sources_digest()}{cache}"

    @classmethod
    def measure(cls, backend: Backend, sizes=MEASURE_SIZES, rounds: int = 2) -> "CostTable":
        """Time ``append`` of n tokens after ``MEASURE_CONTEXTS`` tokens of context, and after the
        current cache too where it is longer; the cache is left as it was. The shortest context
        gives the table, the longest its per-context term. Each size is timed over a run of passes
        of its own (:data:`RUN_S`), in each of ``rounds`` rounds over the sizes, and the fastest pass
        kept, so a burst of load does not skew one size only.

        A backend holding tokens is measured at the standard contexts on an empty twin (its own
        cache must stay), and at its own length in place, each pass rolled back, where its cache
        can be (not int4's or an evicting one's): a table taken at one long context alone would
        price every pass of a later short request at the long context's cost."""
        start = backend.length
        policy = getattr(backend, "kv_policy", None)
        in_place = policy is None or policy.rolls_back_anywhere()
        limit = backend.info.max_length - max(sizes) - 1
        peak = policy.peak_slots(max(sizes)) if policy is not None and policy.evicts() else None
        if peak is not None:
            # a window's pass attends to at most `peak` entries, as a full cache's pass does after that
            # many tokens: timed so, on a full-cache twin, which rolls each pass back instead of reading
            # its context again (a small window reads a prompt in chunks of a few tokens)
            in_place, timed = False, _twin(backend.with_kv_cache("full"))
            limit = min(limit, peak, timed.info.max_length - max(sizes) - 1)  # the twin holds the model's context only
        else:
            timed = backend if start == 0 and in_place else _twin(backend)
        contexts = sorted({max(1, min(c, limit)) for c in MEASURE_CONTEXTS})
        if timed.length == 0:
            timed.reset(1)
        rows: dict[int, dict[int, float]] = {}
        with GOVERNOR.hold():  # all threads for every pass: a table must not mix thread counts
            try:
                for context in contexts:
                    if timed.length < context:
                        timed.append(torch.zeros(1, context - timed.length, dtype=torch.long), last_only=True)
                    rows[timed.length] = cls._time_passes(timed, sizes, rounds)
            finally:
                if timed is backend:
                    backend.truncate(start)
            if in_place and start > max(rows) and start <= limit:
                rows[start] = cls._time_passes(backend, sizes, rounds)  # each pass rolled back to `start`
        return cls.from_rows(rows)

    @staticmethod
    def _time_passes(backend: Backend, sizes, rounds: int) -> dict[int, float]:
        """The fastest timed ``append`` of each size after the cache (rolled back each time), over
        ``rounds`` rounds of the sizes; in each, a size runs for :data:`RUN_S` (two passes at least),
        its first pass untimed."""
        origin = backend.length
        room = backend.info.max_length - origin
        best = {n: math.inf for n in [n for n in sizes if n <= room] or [1]}
        for _ in range(rounds):
            for n in best:
                end, passes = time.perf_counter() + RUN_S, 0
                while passes < 2 or time.perf_counter() < end:
                    t0 = time.perf_counter()
                    backend.append(torch.zeros(1, n, dtype=torch.long))
                    elapsed = time.perf_counter() - t0
                    # every policy measured here rolls its last pass back (a window, which compacts
                    # within a pass, is timed on a full-cache twin: measure())
                    backend.truncate(origin)
                    if passes:
                        best[n] = min(best[n], elapsed)
                    passes += 1
        return best

    @classmethod
    def from_rows(cls, rows: Mapping[int, Mapping[int, float]]) -> "CostTable":
        """A table from costs measured at one or more contexts (``{context: {n: seconds}}``): the
        shortest context's row, and the per-context term from the shortest to the longest.

        Measurements are cleaned of what noise does to them: a pass of n tokens never costs more
        than one of more tokens (another process only ever adds time), so each size keeps the
        lowest cost measured at it or at any larger size; and the per-context term is the line
        a + b n through the sizes' terms (least squares, a, b >= 0): every row of a pass reads
        the context once (memory, a) and attends to it (arithmetic, b per row), while the terms
        of single sizes, differences of two noisy times, would be extrapolated to long prompts."""
        rows = {context: _non_decreasing(row) for context, row in rows.items()}
        (near, table), (far, longer) = min(rows.items()), max(rows.items())
        if far == near:
            return cls(table, at=near)
        # sizes timed at both contexts only (a size with no room at the long one says nothing of its term)
        slopes = {n: (longer[n] - cost) / (far - near) for n, cost in table.items() if n in longer}
        if not slopes:
            return cls(table, at=near)
        a, b = _line_at_or_above_zero(slopes)
        return cls(table, at=near, per_context={n: a + b * n for n in table})

    def as_entry(self) -> dict[str, object]:
        """What the disk cache stores (read back by :meth:`from_entry`)."""
        return {"at": self.at, "costs": self.as_dict(), "per_context": {str(k): v for k, v in zip(self.sizes, self.slopes)}}

    @classmethod
    def from_entry(cls, entry: object) -> "CostTable | None":
        """The table a cache entry holds; None when it lacks a size or a part this version
        measures (written by another version, or damaged): then it is measured again."""
        if not isinstance(entry, dict) or not isinstance(entry.get("costs"), dict) or not isinstance(entry.get("per_context"), dict):
            return None
        wanted = {str(n) for n in MEASURE_SIZES}
        if not (wanted <= set(entry["costs"]) and set(entry["costs"]) == set(entry["per_context"])):
            return None
        try:
            return cls({int(k): v for k, v in entry["costs"].items()}, at=int(entry.get("at", 0)),
                       per_context={int(k): v for k, v in entry["per_context"].items()})
        except (InvalidParameter, ValueError, TypeError, OverflowError):  # (int(Infinity) overflows)
            return None

    @staticmethod
    def _path():
        """Where measured tables are kept: ``$DECODEKIT_COST_TABLE``, or the cache's
        ``speculative/verify_cost.json`` (the test suite keeps its own: its tables are measured
        two test processes to two cores, and would misprice every pass of later real use)."""
        import os
        from pathlib import Path

        from ..models.cache import cache_root

        override = os.environ.get("DECODEKIT_COST_TABLE")
        return Path(override) if override else cache_root() / "speculative" / "verify_cost.json"

    @classmethod
    def cached(cls, backend: Backend) -> "CostTable":
        """The cached table for this model/dtype/threads, measured (and saved) the first time, or
        again when the cached one lacks a size this version measures or is damaged."""
        from ..models.cache import read_json

        saved = read_json(cls._path())  # None when missing or failing its check (reported)
        table = cls.from_entry(saved.get(cls.key(backend)) if isinstance(saved, dict) else None)
        if table is not None:
            return table
        # minutes on a slow machine, once: said, so that a first speculative request is not taken for a hang
        print(f"decodekit: timing passes of {', '.join(map(str, MEASURE_SIZES))} tokens on this machine for the "
              f"speculative controller (once per model and settings; kept in {cls._path()})", file=sys.stderr, flush=True)
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

        key, table = self.key(backend), self.as_entry()

        def with_table(saved: object) -> dict:
            return {**(saved if isinstance(saved, dict) else {}), key: table}

        try:
            update_json(self._path(), with_table)
        except OSError as err:  # a read-only cache only costs a re-measurement next time; said, not hidden
            reason = f"{err.strerror}: {err.filename}" if err.strerror and err.filename else err.strerror or err
            print(f"decodekit: the verify costs could not be kept in {self._path()} ({reason}); "
                  "they are measured again by the next process", file=sys.stderr, flush=True)


def _twin(backend: Backend) -> Backend:
    """An empty copy of ``backend`` sharing its weights, running its passes alone (not in a batch)."""
    twin = backend.clone()
    if getattr(twin, "batcher", None) is not None:
        twin.batcher = None
    return twin


def prepare(backend: Backend) -> CostTable:
    """Make ``backend``'s verify-cost table ready before its first request: read from the disk
    cache, or measured now (a few passes of each size) the first time this model, dtype and thread count
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
        self.context = 0  # tokens in the request so far (set by the loop every step): passes cost more after more
        self._batch = None  # () -> (other sequences, their rows) in this request's passes, when it is batched

    def begin(self, backend: Backend, drafter: str = "") -> None:
        """Per request: take the backend's cost table (measured on first use) and the record of
        what earlier requests of the same drafter on the same model learnt. The back-off level
        carries over, the pause does not: a new prompt is judged afresh at its first step."""
        self._skip, self._explore = 0, False
        if self.fixed is None and self.cost is None:
            self.cost = CostTable.shared(backend)
            self.learn_costs = True
        if drafter:
            records: dict[str, DrafterRecord] = backend.memory("speculative.records", dict)
            self.learnt = records.setdefault(drafter, self.learnt)
        batcher = getattr(backend, "batcher", None)
        self._batch = None if batcher is None else (lambda: batcher.others(backend))

    def pass_cost(self, n: int) -> float:
        """Seconds for a forward pass of ``n`` tokens at the current context."""
        assert self.cost is not None
        return self.cost(n, self.context)

    def _others(self) -> tuple[int, int]:
        """Other sequences in this request's passes, and their rows ((0, 0) alone)."""
        return self._batch() if self._batch is not None else (0, 0)

    def rate(self, expected: float, rows: int, extra_s: float = 0.0) -> float:
        """Tokens per second of the pass this request's ``rows`` rows join, expecting ``expected``
        tokens from them (the other sequences one each), ``extra_s`` added to the pass's time."""
        others, other_rows = self._others()
        return (others + expected) / (self.pass_cost(other_rows + rows) + self.overhead + extra_s)

    def plain_step_s(self) -> float:
        """Seconds of a plain step's pass, with this request's batch."""
        return self.pass_cost(self._others()[1] + 1)

    def observe_cost(self, n: int, seconds: float) -> None:
        """A timed forward pass of ``n`` tokens (1 = a plain step) at the current context. Not while
        batched: the pass carried other sequences' rows too, and waited for them."""
        if self.learn_costs and self.cost is not None and self._batch is None:
            self.cost.observe(n, seconds, self.context)

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
        if depth == 0 and self.speculation_measurably_pays():
            depth = 1  # the estimates lag what speculative steps have realised: keep stepping, and learning
        if depth > 0:
            self.learnt.backoff = 0
        elif not self._explore:
            self._back_off()
        else:
            depth = 1  # a one-node probe keeps the acceptance estimate fresh
        return depth

    def realised_rate(self) -> float | None:
        """Tokens per second that speculative steps have realised (drafting and bookkeeping
        included); None until ``MIN_REALISED_STEPS`` of them are measured."""
        learnt = self.learnt
        if learnt.spec_steps < MIN_REALISED_STEPS:
            return None
        return learnt.step_tokens / learnt.step_seconds

    def speculation_pays(self) -> bool:
        """Whether speculative steps have realised at least plain decoding's tokens per second
        (assumed until they are measured)."""
        rate = self.realised_rate()
        return rate is None or rate >= 1.0 / self.plain_step_s()

    def speculation_measurably_pays(self) -> bool:
        """Whether speculative steps, measured, have realised plain decoding's tokens per second and
        the ``GAIN_MARGIN`` besides."""
        rate = self.realised_rate()
        return rate is not None and rate >= (1.0 + GAIN_MARGIN) / self.plain_step_s()

    def costly_drafting(self) -> bool:
        """Whether a draft call costs more than a small share of a plain step. Judged per call, not
        per node: a lookup in the context costs the same whether it finds nothing or 30 nodes
        (per node, mostly empty drafts would look dear), while a draft model pays for every node."""
        return self.learnt.draft_seconds >= CHEAP_DRAFT * self.pass_cost(1)

    def _rate_to_beat(self) -> float:
        """A plain step's tokens per second (without the speculative step's overhead) and the
        ``GAIN_MARGIN``: what speculation must promise to be chosen."""
        return (1.0 + GAIN_MARGIN) * self.rate(1.0, 1, -self.overhead)

    def best_chain_depth(self) -> int:
        """The chain depth (0 = none) with the best expected tokens per second, counting
        drafting at the measured cost per node."""
        best_depth, best_rate = 0, self._rate_to_beat()
        expected, reach = 1.0, 1.0
        for depth in range(1, self.max_draft + 1):
            reach *= self._accept((self.learnt.chain_source, min(depth - 1, MAX_DEPTH_KEY), 0))
            if reach * (self.max_draft - depth + 1) < 1e-3 * expected:
                break  # deeper nodes could add under 0.1% to the expected tokens: no depth beyond pays
            expected += reach
            rate = self.rate(expected, depth + 1, depth * self.draft_node_s)
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
        best_n, best_rate = 0, self._rate_to_beat()
        expected = 1.0
        for n, node in enumerate(order, start=1):
            expected += probs[node]
            rate = self.rate(expected, n + 1)
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

    def keep_whole(self) -> None:
        """A drafted tree is verified whole, unselected (speculative sampling's; the budget before
        drafting was the plan): a probe it was is spent."""
        self._explore = False

    def _back_off(self) -> None:
        """Plain steps before drafting again: 1, 2, 4, ... up to :meth:`_max_backoff`."""
        self.learnt.backoff = min(self._max_backoff(), max(1, 2 * self.learnt.backoff))
        self._skip = self.learnt.backoff

    def _max_backoff(self) -> int:
        """Plain steps between probes, so that a probe costs about EXPLORE_SHARE of the time. A probe
        loses what a one-node step costs beyond the plain steps its expected tokens would have
        needed (1 and its node's estimate), or, once measured, what speculative steps took beyond
        the plain steps their tokens would have needed, if that is more."""
        probe = self._accept((self.learnt.chain_source, 0, 0))
        extra = (self.pass_cost(2) + self.overhead + self.draft_node_s) / self.pass_cost(1) - (1.0 + probe)
        learnt = self.learnt
        if learnt.spec_steps >= MIN_REALISED_STEPS:
            extra = max(extra, learnt.step_seconds / self.pass_cost(1) - learnt.step_tokens)
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
        if learnt.draft_calls == 0:  # a first call that found nothing counts as one node, not as
            # drafting too dear ever to plan (the average of later calls soon takes over)
            learnt.draft_seconds, learnt.draft_nodes = seconds, float(max(nodes, 1))
        else:
            learnt.draft_seconds += self.ema * (seconds - learnt.draft_seconds)
            learnt.draft_nodes += self.ema * (nodes - learnt.draft_nodes)
        learnt.draft_calls += 1

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A speculative step (drafting, verification and bookkeeping took ``seconds``) produced ``tokens``.
        Not under a fixed budget: what its steps realise is the budget's, not the controller's choice,
        and the record is shared with later adaptive requests of the drafter (a fixed budget of bad
        drafts would veto their speculation)."""
        if self.fixed is not None:
            return
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
