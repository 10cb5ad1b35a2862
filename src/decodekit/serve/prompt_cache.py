"""The server's prompt cache: the keys and values of prompts that left their slots, in host memory.

A slot keeps what its last request read (:attr:`~decodekit.models.backend.Backend.kept_ids`), so a
chat's next turn on that slot reads only its new part. With more conversations than slots, a slot
is soon taken by another prompt, and what it held would be lost. Before that, the scheduler copies
it here (:meth:`PromptCache.put`); a prompt that starts like an entry, more than like any idle slot,
starts from a copy of it (:meth:`PromptCache.longest`), as llama.cpp's server (its host-memory prompt
cache) and vLLM (automatic prefix caching) do. The copy is the cache's own entries, so the answer is
the same bits as reading the whole prompt (the backend's :meth:`reuses_prefix` promise).

Entries are kept up to a byte budget, the least recently used dropped first. An entry whose tokens
start another's is dropped for the longer one (the longer serves every prompt the shorter did). On a
machine short of memory (less than :data:`MEMORY_RESERVE` left beside an entry), nothing more is kept:
the cache saves reading, and must never be what pushes the machine out of memory.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from .. import machine
from ..models.backend import CachedPrefix, common_prefix

MEMORY_RESERVE = 512 * 2**20  # bytes of memory an entry must leave free, for the slots' caches to grow


class PromptCache:
    """Cached prefixes up to ``budget_bytes``, least recently used dropped first; thread-safe."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def covers(self, ids: Sequence[int]) -> bool:
        """Whether an entry already starts with all of ``ids`` (copying them again would add nothing)."""
        with self._lock:
            return self._covered(tuple(ids))

    def _covered(self, ids: tuple[int, ...]) -> bool:
        n = len(ids)  # (called with the lock held)
        return any(len(key) >= n and key[:n] == ids for key in self._entries)

    def put(self, prefix: CachedPrefix) -> None:
        """Keep ``prefix`` as the most recently used entry, unless an entry already covers it or it
        alone exceeds the budget; entries it covers are dropped, then the oldest until it fits."""
        free = machine.available_memory()
        if free is not None and free < prefix.nbytes + MEMORY_RESERVE:
            return
        with self._lock:
            if prefix.nbytes > self.budget_bytes or self._covered(prefix.ids):
                return
            for key in [k for k in self._entries if k == prefix.ids[: len(k)]]:
                self._drop(key)
            while self._entries and self._bytes + prefix.nbytes > self.budget_bytes:
                self._drop(next(iter(self._entries)))
            self._entries[prefix.ids] = prefix
            self._bytes += prefix.nbytes

    def longest(self, prompt_ids: Sequence[int], beyond: int = 0) -> tuple[CachedPrefix | None, int]:
        """The entry sharing the most leading tokens with the prompt, more than ``beyond`` (what the
        prompt's slot shares already), and how many it shares (as a prefill takes them: never the
        prompt's last token, which is read for its logits); (None, 0) where none shares more. The
        entry found, which will be used, becomes the most recently used."""
        head = prompt_ids[: len(prompt_ids) - 1]
        with self._lock:
            best, shared = None, beyond
            for key, entry in self._entries.items():
                if key[0:1] == tuple(head[0:1]):  # (most entries share nothing: skip them cheaply)
                    n = common_prefix(key, head)
                    if n > shared:
                        best, shared = entry, n
            if best is None:
                return None, 0
            self._entries.move_to_end(best.ids)
            return best, shared

    def _drop(self, key: tuple[int, ...]) -> None:
        self._bytes -= self._entries.pop(key).nbytes
