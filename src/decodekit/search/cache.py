"""A record of what each KV-cache row holds, so search methods reuse shared prefixes.

Search methods revisit prefixes all the time (the prompt, a partial solution, a judge prompt that
starts with the answer). :class:`PrefixCache` keeps the token ids behind every backend row; a new
request for ``ids`` picks the row with the longest common prefix, rolls it back to that prefix and
runs only the rest, instead of a fresh prefill.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..models.backend import Backend, common_prefix


class PrefixCache:
    """The one owner of a backend during a request; ``rows[i]`` are the ids cached in row i."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.rows: list[list[int]] = []
        self.passes = 0  # forward passes run through this object
        self.tokens_run = 0  # positions computed (prefill and decode)
        self.first_prefill_s = 0.0

    def fork(self, ids: Sequence[int], n: int = 1) -> torch.Tensor:
        """Leave ``n`` rows holding ``ids``; return the next-token logits ``[n, V]``."""
        ids = list(ids)
        if not ids:
            raise ValueError("cannot run an empty prefix")
        best, keep = self._best_row(ids)
        t0 = time.perf_counter()
        if keep == 0:
            logits = self.backend.prefill(ids)
            if not self.passes:
                self.first_prefill_s = time.perf_counter() - t0
        else:
            if self.backend.batch_size != 1 or best != 0:
                self.backend.reorder(torch.tensor([best]))
            self.backend.truncate(keep)
            logits = self.backend.append(torch.tensor([ids[keep:]]), last_only=True).logits[:, -1]
        self.passes += 1
        self.tokens_run += len(ids) - keep
        if n > 1:
            self.backend.reorder(torch.zeros(n, dtype=torch.long))
            logits = logits.expand(n, -1)
        self.rows = [list(ids) for _ in range(n)]
        return logits

    def _best_row(self, ids: list[int]) -> tuple[int, int]:
        """(row, tokens to keep): at least the last id is always re-run to get its logits."""
        best, keep = 0, 0
        for i, row in enumerate(self.rows):
            c = common_prefix(row, ids)
            if c > keep:
                best, keep = i, c
        return best, min(keep, len(ids) - 1)

    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append one token per row; logits ``[B, V]``."""
        logits = self.backend.step(torch.tensor(list(tokens), dtype=torch.long))
        for row, token in zip(self.rows, tokens):
            row.append(int(token))
        self.passes += 1
        self.tokens_run += len(tokens)
        return logits

    def select(self, rows: Sequence[int]) -> None:
        """Keep (and repeat) the given rows, in order."""
        rows = list(rows)
        self.backend.reorder(torch.tensor(rows, dtype=torch.long))
        self.rows = [list(self.rows[r]) for r in rows]
