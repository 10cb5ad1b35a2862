"""The one draft–verify loop every lossless speculative method runs.

Each step: the pending token (the last chosen one, not yet in the cache) is the tree root; the
controller grants a budget; the drafter proposes a tree below the root; the controller keeps the
part worth verifying; one ``verify_tree`` pass scores [root] + nodes; the verifier picks the
accepted path and a bonus token; the cache keeps root + path; the bonus becomes pending.
An empty tree is a plain step. Output is exactly plain decoding's (greedy: token-identical;
sampling: token-identical to plain sampling with the same seed, see :class:`~.verify.KeyedVerifier`),
whatever the drafter proposes.

Where the sampler's constraint fixes the text that comes next (a JSON key, a literal: the grammar's
forced tokens), that text is the draft, whatever the controller's budget: a chain accepted whenever
the mask leaves its tokens the only choice, which costs no drafting and gains in every step. It
is verified like any draft, because a grammar's forced text may have other spellings the mask
allows; the controller's acceptance statistics and the drafter's timing leave these steps out, and
once the model has refused more than half of the forced tokens offered, drafting returns to the drafter.
Drafts the constraint refuses are dropped before verification, with what hangs below them
(:meth:`SpeculativeMethod._allowed`): they could never be accepted.

``drafter.update`` also follows plain steps (an empty tree, the step's logits as ``[1, V]``), so
drafters that learn from target logits (token recycling) keep learning while speculation rests.
The loop calls every hook of the :class:`~.drafters.base.Drafter` contract unconditionally
(``begin``, ``draft``, ``update``, ``observe``, ``report``, ``finish``; ``trimmable``); the
optional ones default to doing nothing.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import torch

from ..engine.core import DecodeState, StepDecoder, StepMethod
from ..models.backend import Backend
from ..models.kv_policy import KVPolicy
from ..options import OptionSpec, option_table, parse_options
from .controller import Controller, prepare
from .drafters import Drafter
from .tree import DraftTree, Verification, select_nodes
from .verify import PathVerifier, Verifier, make_verifier, node_histories

FORCED = "forced"  # the source of draft tokens a constraint fixed (``accepted_by_source`` counts them)
FORCED_TRIAL = 16  # forced tokens offered before their acceptance may stop them

#: Options of every speculative method (the controller's), besides the drafter's own.
COMMON_OPTIONS = option_table(
    OptionSpec("max_draft", int, 32, "cap on draft-tree nodes per step", lo=1),
    OptionSpec("budget", int, None, "fixed number of draft nodes per step; disables the adaptive controller", lo=0),
    OptionSpec("cost_table", dict, None, "{tokens: seconds} verify costs to use instead of measuring them (a JSON object after --opt)"),
)


class SpeculativeMethod(StepMethod):
    """Draft with ``drafter``, size with ``controller``, verify losslessly: greedy requests by
    :class:`GreedyVerifier`, sampled ones by ``verifier`` (default :class:`KeyedVerifier`;
    :class:`SamplingVerifier` for speculative sampling)."""

    def __init__(self, drafter: Drafter, controller: Controller, verifier: Verifier | None = None):
        self.drafter = drafter
        self.controller = controller
        self.sampled_verifier = verifier
        self.name = drafter.name

    def check_kv_cache(self, policy: KVPolicy) -> None:
        self.drafter.check_kv_cache(policy)

    def check(self, backend: Backend) -> None:
        self.drafter.check(backend)
        if self.controller.fixed is None and self.controller.cost is None:
            # a model's first request measures its verify costs (a minute on a slow machine, once)
            # here, before the decode loop's timed prefill: prefill_s is the prompt's reading alone
            prepare(backend)

    def begin(self, state: DecodeState) -> None:
        self.drafter.begin(state)  # first: it may read what prefill left in the backend (trained drafters' features)
        self.controller.begin(state.backend, self.drafter.name)
        self.verifier = make_verifier(state, self.sampled_verifier)
        state.keyed_drafts = self.verifier.keyed_drafts
        self.verifications = self.accepted = self.drafted = self.plain_steps = 0
        self.draft_s = self.verify_s = 0.0
        self.by_source: dict[str, int] = {}
        self.forced_drafted = self.forced_accepted = 0
        self.refused = 0  # drafts a constraint refused, dropped before verification

    def step(self, state: DecodeState) -> list[int]:
        first: list[int] = []
        if state.pending is None:  # right after prefill: the prefill logits give the root
            first = [self._pick(state, state.next_logits())]
            state.commit(first)
            if first[0] in state.eos or state.tokens_left == 0:  # the request ends there: no pass more
                return first
        self.controller.context = len(state.tokens)  # what this step's passes attend to
        t0 = time.perf_counter()
        # a chain's deepest position must fit the context (a window's: its slots), and no token of it
        # past the request's end (a verification adds one more than it accepts)
        room = min(state.backend.info.max_length - len(state.tokens), state.backend.pass_room()) - 1
        if state.tokens_left is not None:
            room = min(room, state.tokens_left - 1)
        forced = self._forced(state, min(room, self.controller.max_draft))
        if forced:
            with torch.inference_mode():
                produced = self._verify(state, DraftTree.chain(forced, source=FORCED), learn=False)
            self.forced_drafted += len(forced)
            self.forced_accepted += len(produced) - 1
            return first + produced
        budget = min(self.controller.budget(), room)
        if budget <= 0:  # speculation rests: as lean as plain decoding's step, which it replaces
            produced = self._plain_step(state)
            self.drafter.observe(1, time.perf_counter() - t0)
            return first + produced
        return first + self._speculate(state, budget, t0)

    # Inference mode: no autograd bookkeeping per small op, and backends may write caches they
    # (re)allocated inside their own inference-mode forward passes.
    @torch.inference_mode()
    def _speculate(self, state: DecodeState, budget: int, t0: float) -> list[int]:
        tree = self._draft(state, budget)
        t1 = time.perf_counter()
        self.draft_s += t1 - t0
        produced = self._verify(state, tree) if len(tree) else self._plain_step(state)
        t2 = time.perf_counter()
        if len(tree):
            self.verify_s += t2 - t1
            self.controller.observe_step(len(produced), t2 - t0)
        self.drafter.observe(len(produced), t2 - t0)  # e.g. the bandit of `auto`: tokens per second
        return produced

    def _forced(self, state: DecodeState, most: int) -> list[int]:
        """The text the constraint fixes next, at most ``most`` tokens; none once the model has
        refused more than half of the forced tokens it was offered (it prefers other spellings)."""
        if most <= 0 or (self.forced_drafted >= FORCED_TRIAL and 2 * self.forced_accepted < self.forced_drafted):
            return []
        return state.sampler.forced(state.generated)[:most]

    def _draft(self, state: DecodeState, budget: int) -> DraftTree:
        t0 = time.perf_counter()
        tree = self.drafter.draft(state, budget)
        self.controller.observe_draft(len(tree), time.perf_counter() - t0)  # empty drafts cost too
        if len(tree) > budget:
            tree = tree.truncated(budget)
        if not isinstance(self.verifier, PathVerifier):  # speculative sampling: the tree as drafted
            self.controller.keep_whole()  # (see SamplingVerifier: no trim may read the drawn tree)
            return tree
        return self._allowed(state, self.controller.select(tree, trimmable=self.drafter.trimmable))

    def _allowed(self, state: DecodeState, tree: DraftTree) -> DraftTree:
        """``tree`` without the drafts a constraint refuses (and what hangs below them): they could
        never be accepted, and each costs a row of the verification pass. Only where the verifier
        follows plain decoding's choices (greedy, keyed), whose tokens do not depend on the tree
        (rejection sampling's draws do, sibling by sibling), and the drafter's trees may be trimmed."""
        if (not len(tree) or not state.sampler.refuses_tokens or not isinstance(self.verifier, PathVerifier)
                or not self.drafter.trimmable):
            return tree
        generated, paths, allowed = state.generated, tree.paths(), set()
        leaves = set(range(len(tree))) - set(tree.parents)
        for leaf in sorted(leaves):  # one check a root-to-leaf path: its allowed prefix, node by node
            taken = state.sampler.allowed_prefix(generated, paths[leaf])
            node = leaf
            for _ in range(len(paths[leaf]) - taken):
                node = tree.parents[node]
            while node >= 0 and node not in allowed:
                allowed.add(node)
                node = tree.parents[node]
        self.refused += len(tree) - len(allowed)
        return tree if len(allowed) == len(tree) else select_nodes(tree, sorted(allowed))

    def _verify(self, state: DecodeState, tree: DraftTree, learn: bool = True) -> list[int]:
        """One verification pass over ``tree``; ``learn``: the controller counts its acceptance
        (not for forced tokens, which say nothing of the drafter's)."""
        t0 = time.perf_counter()
        if state.sampler.looks_ahead:  # e.g. each node's grammar mask, computed while the pass runs
            state.sampler.prepare([row[state.prompt_len:] for row in node_histories(state, tree)])
        tokens = torch.tensor([state.tokens[-1], *tree.tokens])
        logits = state.backend.verify_tree(tokens, [-1, *[p + 1 for p in tree.parents]]).logits[0]
        state.stats.forward_passes += 1
        t1 = time.perf_counter()
        self.controller.observe_cost(len(tokens), t1 - t0)
        verdict = self.verifier.verify(state, tree, logits)
        state.backend.commit_path([0, *[i + 1 for i in verdict.path]])
        self.drafter.update(state, tree, verdict, logits)
        produced = [tree.tokens[i] for i in verdict.path] + [verdict.bonus]
        state.commit(produced)
        if learn:  # what a speculative step costs beyond its forward pass and drafting: verifier bookkeeping
            self.controller.observe(tree, verdict, overhead_s=time.perf_counter() - t1)
        self.verifications += 1
        self.accepted += len(verdict.path)
        self.drafted += len(tree)
        self._count_sources(tree, verdict)
        return produced

    def _plain_step(self, state: DecodeState) -> list[int]:
        t0 = time.perf_counter()
        logits = state.next_logits()
        self.controller.observe_cost(1, time.perf_counter() - t0)
        token = self._pick(state, logits)
        self.drafter.update(state, DraftTree(), Verification([], token), logits[None])
        state.commit([token])
        self.plain_steps += 1
        return [token]

    @staticmethod
    def _pick(state: DecodeState, logits: torch.Tensor) -> int:
        return state.sampler.pick_at(logits, len(state.tokens), state.history())

    def _count_sources(self, tree: DraftTree, verdict: Verification) -> None:
        for i in verdict.path:
            source = tree.source[i] if tree.source else self.drafter.name
            self.by_source[source] = self.by_source.get(source, 0) + 1

    def finish(self, state: DecodeState) -> None:
        steps = self.verifications
        extra: dict[str, Any] = {
            "drafter": self.drafter.name,
            "verifications": steps,
            "plain_steps": self.plain_steps,
            "drafted": self.drafted,  # draft tokens verified
            "accepted": self.accepted,  # of which accepted
            # Spec-Bench's "mean accepted tokens": accepted draft tokens + the bonus, per verification
            "mean_accepted": round((self.accepted + steps) / steps, 3) if steps else 1.0,
            "acceptance_rate": round(self.accepted / self.drafted, 3) if self.drafted else 0.0,
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
        }
        if self.by_source:
            extra["accepted_by_source"] = dict(self.by_source)
        if self.forced_drafted:
            extra["forced_drafted"] = self.forced_drafted
        if self.refused:
            extra["refused_drafts"] = self.refused
        extra.update(self.drafter.report())
        state.stats.extra.update(extra)
        self.drafter.finish(state)


# Options and registration ------------------------------------------------------------------------


def make_controller(options: dict[str, Any]) -> Controller:
    """A controller from the common options (removed from ``options``)."""
    given = {name: options.pop(name) for name in list(options) if name in COMMON_OPTIONS}
    common = parse_options("the speculative loop", COMMON_OPTIONS, given)
    budget = common["budget"]
    if budget is not None:
        budget = min(budget, common["max_draft"])
    return Controller(common["max_draft"], budget=budget, cost_table=common["cost_table"])


def method_builder(factory: Callable[..., Drafter]) -> Callable[..., StepDecoder]:
    """``build(**options)`` for the registry (which has checked the options against the drafter's
    and the common ones): the controller takes the common options, the drafter its own."""

    takes_max_draft = "max_draft" in inspect.signature(factory).parameters

    def build(**options: Any) -> StepDecoder:
        options = dict(options)
        asked = options.get("max_draft")
        controller = make_controller(options)
        if takes_max_draft:  # a chain drafter's own cap on its chains gives way to what the request says:
            if controller.fixed is not None:  # a fixed budget is the chain's length
                options["max_draft"] = max(controller.fixed, 1)
            elif asked is not None:  # the common cap, given, is the chain's
                options["max_draft"] = controller.max_draft
        return StepDecoder(SpeculativeMethod(factory(**options), controller))

    return build
