"""The one interface every decoding algorithm uses to talk to a model.

A backend owns a key/value cache holding ``length`` committed tokens per row. Algorithms
append tokens (getting logits for each new position), roll the cache back, or verify a
whole token tree in one forward pass and keep only the accepted root-to-leaf path.
Nothing outside ``decodekit.models`` touches attention masks, caches or hidden states.
"""

from __future__ import annotations

import copy
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..errors import InvalidModel, InvalidParameter


#: What :meth:`Backend.check_rows` tells a user whose sequences would not fit, unless told otherwise.
SEARCH_REMEDY = "ask for fewer samples or beams"


@dataclass(frozen=True)
class ModelInfo:
    """What algorithms may need to know about the model behind a backend."""

    name: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    max_length: int  # the longest sequence the backend takes (beyond the model's own context where its cache keeps a window)
    dtype: torch.dtype
    architecture: str
    #: The context the model was trained for, where max_length goes past it (0: max_length is it).
    trained_length: int = 0

    def length_limit(self) -> str:
        """``max_length`` as an error message says it: a windowed cache's bound, or the model's context."""
        return (f"the {self.max_length} tokens a sequence may have under its windowed cache" if self.trained_length
                else f"the model's context of {self.max_length}")


@dataclass
class StepOutput:
    """Result of one forward pass.

    ``logits`` is float32 ``[B, k, V]``: row b, position i predicts the token after the
    i-th new token. ``hidden`` maps a layer index ``l`` (0 = embeddings, ``num_layers`` =
    last decoder layer, before the final norm) to ``[B, k, D]`` states, when requested.
    ``features`` is the final norm's output ``[B, k, D]`` (the output head's input) at every new
    position, ``last_only`` or not, where the backend has it for free (the native backend); trained
    drafters (EAGLE, Medusa, Hydra) read it.
    """

    logits: torch.Tensor
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    features: torch.Tensor | None = None


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node of a tree given in topological order (parent index < child index).

    A parent of -1 attaches the node directly to the committed context (depth 0).
    """
    depths: list[int] = []
    for i, parent in enumerate(parents):
        if parent >= i:
            raise ValueError(f"tree nodes must be topologically ordered: node {i} has parent {parent}")
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def tree_ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """Boolean ``[N, N]`` matrix: entry (i, j) is True when node j is node i or one of its ancestors."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def tree_layout(start: int, parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention visibility ``[N, start + N]`` and positions ``[N]`` of a tree placed after ``start``
    cached tokens: every node sees the whole context plus itself and its ancestors, at position
    ``start + depth``."""
    n = len(parents)
    visible = torch.ones(n, start + n, dtype=torch.bool)
    visible[:, start:] = tree_ancestor_mask(parents)
    return visible, start + torch.tensor(tree_depths(parents))


T = TypeVar("T")

_MEMORY_LOCK = threading.RLock()  # each entry made once, whichever thread asks first (re-entrant: a factory may use memory too)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


@dataclass(frozen=True)
class CachedPrefix:
    """A copy of what a cache held for ``ids`` (:meth:`Backend.snapshot`), for another cache of the
    same model, policy and numerics to start from (:meth:`Backend.restore`): a server's prompt cache."""

    ids: tuple[int, ...]
    owner: object  # what the tensors fit: caches with an equal owner key (NativeLlama._prefix_owner)
    tensors: tuple[torch.Tensor, ...]
    #: The target's features at these positions, where a feature drafter kept them (EAGLE reads the
    #: earlier positions' features: see speculative.drafters.base.FeatureHistory); None otherwise.
    features: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        held = self.tensors if self.features is None else (*self.tensors, self.features)
        return sum(t.numel() * t.element_size() for t in held)


class Interrupted(Exception):
    """A long prompt abandoned between two of its passes: the request's ``should_stop`` said so
    (:attr:`Backend.interrupt`). The cache then holds part of the prompt; the next request resets it."""


class Backend(ABC):
    """A causal LM with an appendable, rollback-able, tree-verifiable KV cache."""

    info: ModelInfo
    #: The token ids the cache holds from the last request, when whoever ran it says so (the
    #: engine does after plain and speculative decoding, the server after a teacher-forced pass of
    #: log-probabilities): a next prompt that starts the same way re-reads only the rest (:meth:`prefill`).
    kept_ids: list[int] | None = None
    request_thread: int | None = None  # the thread whose request holds the cache now (Engine.generate)
    #: Asked between the passes of a long append read in several (a prompt; :meth:`check_interrupt`):
    #: a request's ``should_stop`` while it runs, so that a client gone while its long prompt is read
    #: frees the slot.
    interrupt: Callable[[], bool] | None = None
    #: The files the weights were read from (a GGUF file or safetensors), set by the loader; what
    #: a trained drafter's record of its target is checked against. Empty for models built in memory.
    weights_files: tuple = ()
    #: :attr:`StepOutput.features` of the latest pass (``append``, ``step`` or ``verify_tree``),
    #: or None where the backend does not produce them.
    last_features: torch.Tensor | None = None
    #: Whether the passes produce those features (what trained drafters read and train on).
    gives_features: bool = False

    def reuses_prefix(self) -> bool:
        """Whether reading a prompt's rest after a cached prefix gives the same bits as reading the
        whole prompt (true where every pass computes each token's row on its own)."""
        return False

    def keep(self, token_ids: Sequence[int]) -> None:
        """Say that the cache holds ``token_ids`` (as far as it holds anything: the last token decoded
        is not read yet) for a next prompt that starts the same way."""
        self.kept_ids = list(token_ids[: self.length])

    def shared_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` :meth:`prefill` would take from the cache (at
        least one token is always read, for its logits)."""
        kept = self.kept_ids
        if not kept or self.batch_size != 1 or not self.reuses_prefix():
            return 0
        return common_prefix(kept[: self.length], token_ids[: len(token_ids) - 1])

    def snapshot(self, max_bytes: int | None = None) -> CachedPrefix | None:
        """A copy of the cache's entries for :attr:`kept_ids`, or None where there is nothing to copy
        (nothing kept, several rows), the backend cannot hand its entries over, or the copy would
        take more than ``max_bytes`` (a prompt cache's whole budget: not made only to be dropped)."""
        return None

    def restore(self, prefix: CachedPrefix, length: int | None = None) -> None:
        """Make the cache hold what ``prefix`` holds for its first ``length`` tokens (None: all of
        them), as if they had just been read and kept: a next :meth:`prefill` that starts with them
        reads only the rest, the same bits as reading the whole prompt (where :meth:`reuses_prefix`).
        A prompt that shares a few tokens of a long entry copies those only: the rest would be
        copied, and the cache grown for it, to be dropped by the prefill at once."""
        raise NotImplementedError(f"{type(self).__name__} cannot take a cached prefix")

    def memory(self, key: str | tuple, factory: Callable[[], T], keep: int | None = None) -> T:
        """What algorithms learn about this model across requests (a suffix corpus, a recycling
        table, the controller's cost table and acceptance records, a bandit), kept here under
        ``key``: the value made by ``factory()`` the first time. The one home of per-model state:
        :meth:`clone` starts with an empty memory, so a clone never sees what its parent learnt.

        ``keep``: for a tuple key whose later parts come from a request's options (a draft cache's
        spelling, a draft model), at most that many values of its family (``key[0]``) are kept, the
        least recently used dropped first, so that requests varying an option cannot grow memory
        without bound."""
        with _MEMORY_LOCK:
            store: dict[Any, Any] = self.__dict__.setdefault("_memory", {})
            if key in store:
                store[key] = store.pop(key)  # the most recently used last
                return store[key]
            if keep is not None:
                family = [k for k in store if isinstance(k, tuple) and k[0] == key[0]]
                for old in family[: max(len(family) - keep + 1, 0)]:
                    del store[old]
            store[key] = factory()
            return store[key]

    def own_clone(self, other: "Backend", role: str, keep: int) -> "Backend":
        """A clone of ``other`` in a ``role`` (a judge, a draft model) kept for this backend's
        requests, which hold :attr:`lock` and so use it one at a time: ``other`` itself may be
        decoding a request of its own on another thread, and a pass on its cache would overwrite
        that one's. ``keep``: as :meth:`memory`'s, for requests that name other backends."""
        # the entry holds ``other`` itself (so its id is not reused for another backend while kept,
        # and ``other`` stays in memory as long as its clone: ``keep`` bounds both)
        _, clone = self.memory((role + ".clone", id(other)), lambda: (other, other.clone()), keep=keep)
        return clone

    def weight_traffic(self) -> tuple[int, int] | None:
        """(bytes a one-token pass reads from the weights, multiply-adds per token), for judging a
        pass's speed against the machine's bandwidth and arithmetic rate; None where unknown."""
        return None

    @property
    def lock(self) -> threading.RLock:
        """Held for a whole request: the cache holds one request at a time, and what methods learn
        across requests (:meth:`memory`) is updated by one request at a time. A clone has its own."""
        return self.memory("request-lock", threading.RLock)

    @property
    @abstractmethod
    def length(self) -> int:
        """Number of committed tokens in the cache (the same for every row)."""

    @property
    @abstractmethod
    def batch_size(self) -> int:
        """Number of rows currently held in the cache."""

    @abstractmethod
    def reset(self, batch_size: int = 1) -> None:
        """Empty the cache and set the number of rows."""

    @abstractmethod
    def append(
        self,
        tokens: torch.Tensor,
        *,
        hidden_layers: Sequence[int] = (),
        skip_layers: frozenset[int] = frozenset(),
        last_only: bool = False,
    ) -> StepOutput:
        """Run ``tokens`` ``[B, k]`` after the cache, commit them, return their logits.

        ``skip_layers`` runs those decoder layers as the identity (self-speculative drafting);
        the cache entries written with skipped layers must be rolled back before the positions
        are trusted. ``last_only`` computes logits for the last position only (prefill).
        """

    @abstractmethod
    def truncate(self, length: int) -> None:
        """Roll the cache back to its first ``length`` tokens."""

    def rollback_floor(self) -> int:
        """The shortest length :meth:`truncate` takes now: 0 but for a cache that keeps only its
        last tokens as they were (an evicting one), which refuses to go back past them."""
        return 0

    def compaction_held(self) -> AbstractContextManager:
        """While entered, passes leave the cache as they find it but for what they write: a chain of
        drafted passes, rolled back after, then leaves an evicting cache as it was (a compaction
        would keep the window of the drafted length, and the rollback would leave it short). Nothing
        to hold by default."""
        return nullcontext()

    def chain_reach(self) -> int | None:
        """How many one-token passes a chain drafted on this cache (under :meth:`compaction_held`)
        can append and all roll back (None: any number)."""
        return None

    #: The most tokens a verification pass takes (None: any): a backend whose row kernels take so
    #: many gives one-token steps' bits up to there only.
    max_pass_tokens: int | None = None

    def pass_room(self) -> int:
        """The most tokens the next pass can hold (a verification's root and tree included)."""
        return self.info.max_length - self.length

    # Tree verification: shared bookkeeping here, the cache work in three small hooks that
    # a backend implements (or it overrides verify_tree/commit_path wholesale, as test doubles do).

    @torch.inference_mode()
    def verify_tree(self, tokens: torch.Tensor, parents: Sequence[int]) -> StepOutput:
        """Run a token tree (batch 1) in one pass; node i sees the context and its ancestors.

        ``tokens`` is ``[N]``, ``parents[i]`` the index of node i's parent (-1 = child of the
        context), nodes in topological order. Returns logits ``[1, N, V]``. The cache is left
        uncommitted until :meth:`commit_path`.
        """
        if self.batch_size != 1:
            raise ValueError("tree verification needs a batch of one row")
        most = self.max_pass_tokens
        if most is not None and len(parents) > most:  # refused before a cache policy evicts or quantises for it
            raise InvalidParameter(f"a tree of {len(parents)} tokens is more than a pass holds ({most})")
        self._make_room(len(parents))
        start, position = self._next_slot()
        visible, positions = tree_layout(start, parents)
        out = self._run_tree(tokens.view(1, -1), positions + (position - start), visible)
        self._pending_tree = start
        self.last_features = out.features
        return out

    @torch.inference_mode()
    def commit_path(self, nodes: Sequence[int]) -> None:
        """Keep the tree nodes ``nodes`` (a root-to-leaf path, in order) and drop the rest."""
        start = getattr(self, "_pending_tree", None)
        if start is None:
            raise RuntimeError("commit_path() needs a preceding verify_tree()")
        nodes = list(nodes)
        if nodes != list(range(len(nodes))):  # a path that is a prefix of the node order is already in place
            self._move_entries(torch.tensor(nodes) + start, start)
        self._pending_tree = None
        self._set_length(start + len(nodes))

    def _make_room(self, incoming: int) -> None:
        """Called before a pass of ``incoming`` tokens: a cache policy may evict entries here."""

    def _next_slot(self) -> tuple[int, int]:
        """(cache slot, position) of the next token: both ``length`` unless a cache policy has
        evicted entries (see ``models/kv_policy.py``)."""
        return self.length, self.length

    def _run_tree(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> StepOutput:
        """Forward ``tokens`` ``[1, N]`` at ``positions`` with boolean ``visible`` ``[N, length + N]``,
        writing their cache entries after the committed ones without committing them."""
        raise NotImplementedError("a backend implements these hooks or overrides verify_tree/commit_path")

    def _move_entries(self, src: torch.Tensor, dst: int) -> None:
        """Copy the cache entries at slots ``src`` to ``dst, dst + 1, ...``."""
        raise NotImplementedError("a backend implements these hooks or overrides verify_tree/commit_path")

    def _set_length(self, length: int) -> None:
        """Make the first ``length`` cache slots the committed ones."""
        raise NotImplementedError("a backend implements these hooks or overrides verify_tree/commit_path")

    def check_rows(self, rows: int, remedy: str = SEARCH_REMEDY) -> None:
        """Refuse, in one line that ends with ``remedy`` (what the user can ask for instead), ``rows``
        sequences at once where their cache, at the capacity this cache has now, cannot fit (a search
        asks before it builds anything per sequence; the server before it makes its slots). Nothing
        is checked by default."""

    @abstractmethod
    def reorder(self, rows: torch.Tensor) -> None:
        """Replace the cache rows by ``rows`` (indices into the current rows; may repeat).

        Forking one prompt into N samples is ``reorder(torch.zeros(N, dtype=torch.long))``.
        """

    # Conveniences shared by every backend -------------------------------------------------

    def check_interrupt(self) -> None:
        """Raise :class:`Interrupted` where :attr:`interrupt` says to abandon the tokens being read."""
        if self.interrupt is not None and self.interrupt():
            raise Interrupted

    def clone(self) -> "Backend":
        """A backend over the same weights with its own, empty cache.

        What methods learnt across requests lives in :meth:`memory`, which a clone starts empty
        (the benchmark gives each method its own clone, as if it ran in its own process).
        """
        twin = copy.copy(self)
        twin.__dict__["_memory"] = {}
        twin.request_thread = twin.interrupt = None
        twin.reset(1)
        return twin

    # What trained drafters read from their target (EAGLE's token embeddings, a reduced output head).

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """The residual stream's start for ``tokens`` (any shape): float32 ``[*tokens.shape, D]``."""
        raise InvalidParameter(f"trained drafters need the native backend, not {self.info.architecture}")

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the output head, float32 ``[len(ids), D]`` (the logits of those tokens
        are the features times these rows)."""
        raise InvalidParameter(f"trained drafters need the native backend, not {self.info.architecture}")

    def matrix(self, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> x @ weight.T`` for a trained drafter's float ``[out, in]`` matrix, run by this
        backend's own few-row kernels where it has them (the native backend holds it as Q8_0 blocks)."""
        w = weight.detach().float().contiguous()
        return lambda x: torch.nn.functional.linear(x, w)

    def truncated(self, num_layers: int) -> "Backend":
        """A backend running this model's first ``num_layers`` decoder layers (then the final norm
        and the lm head), sharing its weights, with a cache and a memory of its own: the
        download-free draft model of self-speculative drafting."""
        raise InvalidParameter(
            f"truncating a model to its first layers needs the native backend, not {self.info.architecture}"
        )

    def prefill(self, token_ids: Sequence[int], batch_size: int = 1) -> torch.Tensor:
        """Reset, run the prompt once, fork it to ``batch_size`` rows; return last logits ``[B, V]``.
        A prompt that starts with :attr:`kept_ids` keeps that part of the cache and reads the rest."""
        shared = self.shared_prefix(token_ids) if batch_size == 1 else 0
        if shared:
            self.truncate(shared)
            self.kept_ids = None
            rest = torch.tensor([list(token_ids[shared:])], dtype=torch.long)
            return self._finite(self.append(rest, last_only=True).logits[:, -1])
        self.reset(1)
        out = self.append(torch.tensor([list(token_ids)], dtype=torch.long), last_only=True)
        self._finite(out.logits)
        if batch_size > 1:
            self.reorder(torch.zeros(batch_size, dtype=torch.long))
            return out.logits[:, -1].expand(batch_size, -1).clone()
        return out.logits[:, -1]

    def _finite(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits``, where none is NaN or +infinity: a request's first logits are checked, since a
        model whose weights hold a NaN or an infinity (a damaged file) gives such logits for every
        token, and would otherwise decode token 0 over and over, silently (-infinity is a token a
        model rules out). Their sum first: finite for almost every pass, and a tenth of the cost."""
        if not bool(torch.isfinite(logits.sum())) and (
                bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any())):
            raise InvalidModel(f"{self.info.name}: the model's logits are not finite (NaN or infinity); its weights are "
                               "damaged, or its arithmetic overflows")
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row (``[B]``) and return the next-token logits ``[B, V]``."""
        return self.append(tokens.view(-1, 1)).logits[:, -1]
