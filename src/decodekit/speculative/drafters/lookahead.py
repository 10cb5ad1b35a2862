"""Lookahead decoding (Fu et al. 2024, "Break the sequential dependency of LLM inference using
lookahead decoding"): Jacobi iterations produce an n-gram pool; pool n-grams that start with
the root are verified in the same forward pass.

One tree carries both branches: the *lookahead branch* is the Jacobi window, a chain of
``window`` guessed tokens below the root; the *verification branch* is up to ``guesses``
pool n-grams keyed by the root token (merged where they share a prefix). After the pass, the
window's logits give the next Jacobi iterate (guess i+1 = argmax after window token i), and the
diagonals of the last ``ngram`` - 1 iterates give new n-grams, as in the paper's 2-D window.
Only the verifier's accepted path is committed, so the output is exact; window tokens that
happen to match the target are accepted like any draft.

Choices the paper leaves open, ours: the window is not realigned when tokens are accepted
(the paper's window also keeps its offsets); it starts from prompt tokens; the pool keeps the
``guesses`` most recent distinct n-grams per key; the controller may verify the whole tree or
nothing (the window's value lies in later steps, so it is not trimmed node by node).
"""

from __future__ import annotations

import torch

from ...engine.core import DecodeState
from ...models.kernels import MAX_ROWS
from ...options import OptionSpec, option_table
from ..tree import DraftTree, Verification, add_chain
from . import register_drafter
from .base import Drafter


OPTIONS = option_table(
    # bounded by what one verification pass holds (MAX_ROWS): a larger window only costs memory and time
    OptionSpec("window", int, 6, "Jacobi window: guessed tokens below the root", lo=1, hi=MAX_ROWS),
    OptionSpec("ngram", int, 3, "length of the pool's n-grams", lo=2, hi=MAX_ROWS),
    OptionSpec("guesses", int, 4, "pool n-grams verified per step", lo=0, hi=MAX_ROWS),
)


@register_drafter("lookahead", "lookahead decoding: Jacobi-iteration n-gram pool verified in the same pass",
                  options=OPTIONS)
class LookaheadDrafter(Drafter):
    name = "lookahead"
    trimmable = False

    def __init__(self, window: int = 6, ngram: int = 3, guesses: int = 4):
        self.window_size = OPTIONS["window"].parse(window)
        self.ngram = OPTIONS["ngram"].parse(ngram)
        self.guesses = OPTIONS["guesses"].parse(guesses)

    def begin(self, state: DecodeState) -> None:
        prompt = state.tokens[: state.prompt_len] or [0]
        self.window = [prompt[(7 * i) % len(prompt)] for i in range(self.window_size)]
        self.levels: list[list[int]] = []  # earlier Jacobi iterates (oldest first), ngram - 2 kept
        self.pool: dict[int, dict[tuple[int, ...], None]] = {}  # first token -> continuations (insertion-ordered)

    def draft(self, state: DecodeState, budget: int) -> DraftTree:
        tree = DraftTree()
        root = state.tokens[-1]
        for continuation in reversed(list(self.pool.get(root, {}))):  # most recent first
            if len(tree) + len(continuation) > budget:
                break
            add_chain(tree, list(continuation), -1, "lookahead")
        room = budget - len(tree)
        if room > 0:
            add_chain(tree, self.window[:room], -1, "lookahead:window")
        return tree

    def update(self, state: DecodeState, tree: DraftTree, verdict: Verification, logits: torch.Tensor) -> None:
        if "lookahead:window" not in tree.source:  # a plain step, or another's draft (forced text): no Jacobi step ran
            return
        guesses = logits.argmax(dim=-1).tolist()
        new = list(self.window)
        new[0] = guesses[0]
        computed, node = 1, -1
        for token in self.window[:-1]:  # follow the window chain through the verified tree
            node = tree.child_with_token(node, token)
            if node is None:
                break
            new[computed] = guesses[node + 1]
            computed += 1
        self._collect(new, computed)
        self.levels = (self.levels + [self.window])[-(self.ngram - 2) :] if self.ngram > 2 else []
        self.window = new

    def _collect(self, new: list[int], computed: int) -> None:
        """Add the diagonal n-grams (levels[0][j-n+1], ..., window[j-1], new[j]) for j < computed."""
        history = self.levels + [self.window]
        if len(history) < self.ngram - 1:
            return
        n = self.ngram
        for j in range(n - 1, computed):
            gram = tuple(history[k][j - n + 1 + k] for k in range(n - 1)) + (new[j],)
            bucket = self.pool.setdefault(gram[0], {})
            bucket.pop(gram[1:], None)
            bucket[gram[1:]] = None
            while len(bucket) > self.guesses:
                del bucket[next(iter(bucket))]
