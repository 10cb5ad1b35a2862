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
        # the ids of the last fork and their next-token logits, while no pass has run since: a
        # second fork of the same ids (CoT-decoding branches after looking at the first logits)
        # then needs no pass
        self.last_fork: tuple[list[int], torch.Tensor] | None = None

    def fork(self, ids: Sequence[int], n: int = 1) -> torch.Tensor:
        """Leave ``n`` rows holding ``ids``; return the next-token logits ``[n, V]``."""
        ids = list(ids)
        if not ids:
            raise ValueError("cannot run an empty prefix")
        if n > 1:  # one line where n caches of this one's size cannot fit (growing, each is checked again)
            self.backend.check_rows(n)
        best, common = self._best_row(ids)
        if self.last_fork is not None and self.last_fork[0] == ids and common == len(ids):
            self._keep(best, common)
            logits = self.last_fork[1].clone()  # a caller may change its logits in place
        else:
            t0 = time.perf_counter()
            keep = min(common, len(ids) - 1)  # the last id is re-run for its logits
            if keep < self.backend.rollback_floor():  # an evicting cache past its reach: read it all again
                keep = 0
            if keep == 0:
                logits = self.backend.prefill(ids)
                if not self.passes:
                    self.first_prefill_s = time.perf_counter() - t0
            else:
                self._keep(best, keep)
                logits = self.backend.append(torch.tensor([ids[keep:]]), last_only=True).logits[:, -1]
            self.passes += 1
            self.tokens_run += len(ids) - keep
            self.last_fork = (ids, logits.clone())
        if n > 1:
            self.backend.reorder(torch.zeros(n, dtype=torch.long))
            logits = logits.expand(n, -1)
        self.rows = [list(ids) for _ in range(n)]
        return logits

    def _keep(self, row: int, length: int) -> None:
        """Leave only ``row``, rolled back to its first ``length`` tokens."""
        if self.backend.batch_size != 1 or row != 0:
            self.backend.reorder(torch.tensor([row]))
        self.backend.truncate(length)

    def _best_row(self, ids: list[int]) -> tuple[int, int]:
        """(row, its common prefix with ``ids``): the row sharing the longest prefix."""
        best, keep = 0, 0
        for i, row in enumerate(self.rows):
            c = common_prefix(row, ids)
            if c > keep:
                best, keep = i, c
        return best, keep

    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append one token per row; logits ``[B, V]``."""
        self.last_fork = None
        logits = self.backend.step(torch.tensor(list(tokens), dtype=torch.long))
        for row, token in zip(self.rows, tokens):
            row.append(int(token))
        self.passes += 1
        self.tokens_run += len(tokens)
        return logits

    def select(self, rows: Sequence[int]) -> None:
        """Keep (and repeat) the given rows, in order."""
        rows = list(rows)
        self.last_fork = None
        self.backend.reorder(torch.tensor(rows, dtype=torch.long))
        self.rows = [list(self.rows[r]) for r in rows]
