"""A compact PyTorch Llama-family transformer (SmolLM2, Llama, Qwen2, Mistral) with a
preallocated KV cache, in the spirit of gpt-fast.

Why not transformers: a decode step through transformers spends much of its time on per-layer
Python and cache bookkeeping around the same math. Here q/k/v and gate/up are fused into one
matmul each, the cache is written in place, and rollback is just moving a length counter. The
weights it computes with (config, rotary tables, projections on the GGUF blocks) are
:mod:`.llama_weights`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..arguments import NUMERICS
from ..errors import InvalidParameter, NumericsUnavailable, PromptTooLong, RollbackRefused
from ..machine import available_memory
from .backend import SEARCH_REMEDY, Backend, CachedPrefix, ModelInfo, StepOutput
from .batching import PREFILL_CHUNK, PassBatcher
from .gguf_blocks import BlockMatrix
from .kivi import KiviStore, KiviView
from .kv_policy import KVPolicy, parse_kv_cache, streaming_keep
from .threads import GOVERNOR
from .kernels import (
    MAX_ROWS, DecoderLayers, SequencePart, decoder_layers, int8_cache_kernels, kivi_attention, layer_ops,
    layout_independent_attention, quantise_int8_rows,
)
from .llama_weights import (
    LlamaConfig, LlamaWeights, Projection, RopeTable, apply_rope, fast_numerics_unavailable,
    native_architecture, rms_norm,
)

#: ``ModelInfo.max_length`` under a policy that re-assigns positions within the cache (StreamingLLM):
#: a sequence can then run past the model's context window.
UNBOUNDED_LENGTH = 1 << 40


class NativeLlama(Backend):
    """The native backend: :class:`Backend` over :class:`LlamaWeights` with a preallocated cache.

    ``gguf_blocks``: the model's GGUF blocks (:func:`..gguf_blocks.read_block_matrices`), for
    float32 decode steps that stream them instead of float32 weights, with identical results.
    ``numerics``: one of :data:`NUMERICS` (``fast`` needs ``gguf_blocks``).

    The cache grows by doubling when full, so no capacity has to be guessed up front.

    ``batcher``: set on clones that serve concurrent requests; their passes then run together
    with the other clones' (:mod:`.batching`), with the same results as alone.

    ``kv_cache``: a :mod:`.kv_policy` (or its spelling) deciding which entries the cache keeps.
    The cache then holds ``slots`` entries for ``length`` tokens; a pass writes after the last
    slot, at the positions the policy assigns (the token's own, or its slot's).
    """

    weights_class = LlamaWeights
    gives_features = True
    takes_streaming_cache = True  # (a sink:S,window:W cache: what a too-long sequence is pointed to)
    max_pass_tokens = MAX_ROWS  # the row kernels' (longer: torch's sums, and no int8 or int4 cache)
    batcher: PassBatcher | None = None
    _observed_rows = False  # set during a pass whose attention weights go to the cache policy

    def __init__(
        self,
        config: LlamaConfig,
        state: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        name: str = "llama",
        initial_capacity: int = 512,
        gguf_blocks: Mapping[str, BlockMatrix] | None = None,
        numerics: str = "exact",
        kv_cache: KVPolicy | str | None = None,
        block_matches: dict[str, object] | None = None,
    ):
        if numerics not in NUMERICS:
            raise InvalidParameter(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
        if numerics == "fast" and dtype != torch.float32:
            raise NumericsUnavailable("the fast numerics runs on float32 activations; use --dtype float32")
        # Some real weights hold subnormal floats, on which multi-row matmul kernels run several times slower.
        torch.set_flush_denormal(True)
        self.config = config
        self.dtype = dtype
        self.numerics = numerics
        self.kv_policy = parse_kv_cache(kv_cache)
        self.weights = self.weights_class(config, state, dtype, gguf_blocks, numerics, block_matches)
        # fast runs on every projection's (packed) blocks; exact on those that matched
        uses_blocks = numerics == "fast" or any(p.on_blocks for p in self.weights.projections)
        self.info = ModelInfo(
            name=name,
            vocab_size=config.vocab_size,
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            max_length=config.max_position,
            dtype=dtype,
            architecture=native_architecture(dtype, uses_blocks, numerics),
        )
        self._rope = RopeTable(config.rope_theta, config.head_dim, config.max_position)
        self._ropes = [self._rope]  # every table a pass reads (Gemma adds its local layers')
        self._freqs, self._freqs_pairs = self._rope.angles, self._rope.pairs
        self._initial_capacity = initial_capacity
        self._attend = layout_independent_attention(dtype, config.head_dim)
        self._ops = layer_ops(dtype, config.hidden_size, config.intermediate_size)
        self._stack = self._float_stack = self._decoder_layers()
        self._use_policy(self.kv_policy)
        self.reset(1)

    @classmethod
    def check_policy(cls, policy: KVPolicy) -> None:
        """Refuse a cache policy this architecture cannot take, whatever the machine (one line; the
        loader asks before it caches anything for the model): every one, here."""

    def _use_policy(self, policy: KVPolicy) -> None:
        """Set the cache policy and what depends on it (the int8 and int4 caches have kernels of their own)."""
        self.kv_policy = policy
        self.info = self._info_for(policy)
        self._int8 = self._kivi_attention = None
        float32 = self.dtype == torch.float32
        if policy.code_bits == 8:
            self._int8 = int8_cache_kernels(self.config.head_dim) if float32 else None
        elif policy.kivi:
            self._kivi_attention = kivi_attention(self.config.head_dim) if float32 else None
        kernels = self._int8 or self._kivi_attention
        if policy.quantised and (kernels is None or self._ops is None):
            raise InvalidParameter(f"kv cache {policy.spec} needs a float32 model, the compiled kernels (a C "
                                   "compiler, AVX2 or AVX-512) and a head size that is a multiple of 16")
        # the int4 cache's passes carry their codes to forward.c (a KiviView), over the float path
        self._stack = self._decoder_layers(self._int8) if self._int8 is not None else self._float_stack
        self._row = self._int8.row if self._int8 is not None else self.config.head_dim  # cache elements a row

    def _decoder_layers(self, int8_cache=None) -> DecoderLayers | None:
        """The one-call path through every layer (``kernels/forward.c``), where every piece of
        the layer-by-layer kernel path is available (and no projection has a bias); over the int8
        cache's kernels with ``int8_cache``."""
        c, w = self.config, self.weights
        names = ("qkv", "o", "gate_up", "down")
        if self._ops is None or self._attend is None:
            return None
        if any(layer[n].kernel is None or layer[n].bias is not None for layer in w.layers for n in names):
            return None
        layers = [
            {"attn_norm": layer["attn_norm"], "mlp_norm": layer["mlp_norm"], **{n: layer[n].kernel for n in names}}
            for layer in w.layers
        ]
        return decoder_layers(
            self.dtype, self._ops, self._attend, hidden=c.hidden_size, inter=c.intermediate_size, n_heads=c.num_heads,
            n_kv_heads=c.num_kv_heads, head_dim=c.head_dim, eps=c.rms_norm_eps, layers=layers,
            int8_cache=int8_cache,
        )

    def _info_for(self, policy: KVPolicy) -> ModelInfo:
        peak = policy.peak_slots(1)  # what plain decoding needs; a longer pass is checked when it comes
        if peak is not None and peak > self.config.max_position:
            raise InvalidParameter(f"kv cache {policy.spec} needs up to {peak} entries, more than the model's context "
                                   f"of {self.config.max_position}")
        if policy.reassigns_positions:  # a window of the sequence: any length
            return dataclasses.replace(self.info, max_length=UNBOUNDED_LENGTH, trained_length=self.config.max_position)
        return dataclasses.replace(self.info, max_length=self.config.max_position, trained_length=0)

    def with_kv_cache(self, policy: KVPolicy | str) -> "NativeLlama":
        """This model with another cache policy, sharing its weights, with a cache and a memory
        of its own (:meth:`Backend.clone`): the drafter of ``kvdraft``."""
        view = copy.copy(self)
        view._use_policy(parse_kv_cache(policy))
        return view.clone()

    def truncated(self, num_layers: int) -> "NativeLlama":
        """This model's first ``num_layers`` layers (+ final norm + lm head), sharing its weights
        and rope tables, with a cache and a memory of its own (:meth:`Backend.clone`)."""
        if not 1 <= num_layers <= self.config.num_layers:
            raise InvalidParameter(f"cannot truncate a model of {self.config.num_layers} layers to {num_layers}")
        view = copy.copy(self)
        view.config = dataclasses.replace(self.config, num_layers=num_layers)
        view.weights = copy.copy(self.weights)
        view.weights.layers = self.weights.layers[:num_layers]
        view.info = dataclasses.replace(self.info, num_layers=num_layers, name=f"{self.info.name}[:{num_layers}]")
        return view.clone()  # the decoder-layers kernel runs as many layers as the cache has

    # Cache management ---------------------------------------------------------------------

    @property
    def length(self) -> int:
        return self._length

    @property
    def batch_size(self) -> int:
        return self._k.shape[1]

    def cache_bytes(self, peak: bool = False) -> int:
        """Bytes the committed keys and values take (what a policy saves; capacity not counted),
        with an evicting policy's bookkeeping (each entry's position and accumulated attention);
        under ``int4``, the quantised tokens and the float residual's slots. ``peak``: at the most
        entries held at once since the cache was reset (a prompt read whole before SnapKV
        compresses it, a verification tree's nodes)."""
        c = self.config
        slots = self._peak_slots if peak else self._slots
        held = 2 * c.num_layers * self.batch_size * c.num_kv_heads * slots * self._row * self._k.element_size()
        if self.kv_policy.evicts():
            held += c.num_layers * c.num_kv_heads * slots * (self._held.element_size() + self._mass.element_size())
        return held + (self._kivi.nbytes() if self._kivi is not None else 0)

    @property
    def slots(self) -> int:
        """Entries the cache holds (``length`` under the full cache; fewer once a policy evicts)."""
        return self._slots

    @torch.inference_mode()
    def reset(self, batch_size: int = 1) -> None:
        self.kv_policy.check_sequences(batch_size)
        self.kept_ids = None
        self.last_features = None
        self._length = self._slots = self._peak_slots = 0
        self._tail_from = 0  # tokens from here on sit in the last slots, in order (rollback reaches that far)
        self._first_pass = True
        self._compaction_held = False
        self._pending_tree = None
        capacity = min(self._initial_capacity, self.config.max_position)
        c, policy = self.config, self.kv_policy
        # int4, int2: the quantised tokens; the float cache then holds the residual, slot 0 at position _base
        self._kivi = KiviStore(c.num_layers, c.num_kv_heads, c.head_dim, policy.group, policy.bits) \
            if self._kivi_attention is not None else None
        self._base = 0
        if self._kivi is not None:  # the most the residual holds (_quantise_ahead): no more is allocated
            capacity = min(capacity, policy.recent + policy.residual + 2 * policy.group + MAX_ROWS)
        self._allocate(batch_size, capacity)

    def _check_memory(self, rows: int, capacity: int, remedy: str = SEARCH_REMEDY) -> None:
        """Refuse, in one line that ends with ``remedy``, a cache larger than the memory left (many
        samples or beams of a search, many server slots), rather than fail deep in the allocator or
        be killed by the system."""
        c = self.config
        need = 2 * c.num_layers * rows * c.num_kv_heads * capacity * self._row * self.dtype.itemsize
        free = available_memory()
        if free is not None and need > free:
            def size(n: int) -> str:
                return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

            raise InvalidParameter(f"{rows} sequences of {capacity} positions need a {size(need)} KV cache, more than "
                                   f"the {size(free)} of memory available; {remedy}")

    def check_rows(self, rows: int, remedy: str = SEARCH_REMEDY) -> None:
        self._check_memory(rows, self._k.shape[3], remedy)

    def _allocate(self, batch_size: int, capacity: int) -> None:
        c = self.config
        self._check_memory(batch_size, capacity)
        shape = (c.num_layers, batch_size, c.num_kv_heads, capacity, self._row)
        self._k = torch.zeros(shape, dtype=self.dtype)
        self._v = torch.zeros(shape, dtype=self.dtype)
        if self.kv_policy.evicts():
            # per slot and head: the token it holds, and the attention it has received (H2O, SnapKV)
            self._held = torch.zeros(c.num_layers, c.num_kv_heads, capacity, dtype=torch.long)
            self._mass = torch.zeros(c.num_layers, c.num_kv_heads, capacity)

    def _ensure_capacity(self, needed: int) -> None:
        self._peak_slots = max(self._peak_slots, needed)
        capacity = self._k.shape[3]
        if needed <= capacity:
            return
        if needed > self.config.max_position:
            if self.kv_policy.evicts():
                raise ValueError(f"kv cache {self.kv_policy.spec}: {needed} entries exceed the model's context of "
                                 f"{self.config.max_position}")
            raise ValueError(f"sequence of {needed} tokens exceeds the model's context of {self.config.max_position}")
        # room to grow past a long prompt: otherwise its first decode step copies the whole cache
        new_capacity = min(max(needed + needed // 4 + 64, 2 * capacity), self.config.max_position)
        old = (self._k, self._v) + ((self._held, self._mass) if self.kv_policy.evicts() else ())
        self._allocate(old[0].shape[1], new_capacity)
        self._k[:, :, :, :capacity] = old[0]
        self._v[:, :, :, :capacity] = old[1]
        if self.kv_policy.evicts():
            self._held[..., :capacity] = old[2]
            self._mass[..., :capacity] = old[3]

    def rollback_floor(self) -> int:
        return self._tail_from

    @torch.inference_mode()
    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} tokens to {length}")
        if length < self.rollback_floor():
            raise RollbackRefused(f"cannot roll back to {length} tokens: kv cache {self.kv_policy.spec} has evicted, "
                                  f"compacted or quantised the entries before token {self._tail_from}")
        self._slots -= self._length - length
        self._length = length
        self._pending_tree = None

    @torch.inference_mode()
    def reorder(self, rows: torch.Tensor) -> None:
        self.kv_policy.check_sequences(rows.numel())
        if rows.numel() > self._k.shape[1]:
            self._check_memory(rows.numel(), self._k.shape[3])
        self._k = self._k[:, rows].contiguous()
        self._v = self._v[:, rows].contiguous()

    @torch.inference_mode()
    def snapshot(self, max_bytes: int | None = None) -> CachedPrefix | None:
        kept = self.kept_ids
        if not kept or self.batch_size != 1 or not self.reuses_prefix():
            return None
        n = len(kept)  # (keep() cut them to the cache's length)
        if max_bytes is not None and 2 * self._k[:, :, :, :n].numel() * self._k.element_size() > max_bytes:
            return None
        return CachedPrefix(tuple(kept), self._prefix_owner(),
                            (self._k[:, :, :, :n].clone(), self._v[:, :, :, :n].clone()))

    @torch.inference_mode()
    def restore(self, prefix: CachedPrefix, length: int | None = None) -> None:
        if prefix.owner != self._prefix_owner() or not self.reuses_prefix():
            raise ValueError("this cached prefix was taken from a cache of another model, policy or numerics")
        n = len(prefix.ids) if length is None else length
        if not 0 < n <= len(prefix.ids):
            raise ValueError(f"cannot restore {n} tokens of a cached prefix of {len(prefix.ids)}")
        self.reset(1)
        self._ensure_capacity(n)
        self._k[:, :, :, :n], self._v[:, :, :, :n] = (t[:, :, :, :n] for t in prefix.tensors)
        self._length = self._slots = n
        self._first_pass = False
        self.kept_ids = list(prefix.ids[:n])

    def _prefix_owner(self) -> tuple:
        """What a cached prefix's entries depend on: the weights (and numerics) of this stack, and
        the cache's layout."""
        # the stack itself (compared by identity, and kept alive by the entries: an id could be
        # reused), and the layers this cache holds (a truncated view shares the stack)
        return (self._stack, self.config.num_layers, self.kv_policy.spec, self.dtype, self._row)

    # Forward passes -------------------------------------------------------------------------

    def reuses_prefix(self) -> bool:
        # a prompt is read in chunks through the row-independent kernels, alone or served, in either numerics
        if self.kv_policy.evicts() or self._kivi is not None:  # the cache does not hold the prompt's float entries
            return False
        return self._stack is not None

    @property
    def batch_key(self) -> object:
        """Passes of backends with the same key can run in one batched pass (the same layers)."""
        return self._stack

    def _one_call(self, tokens: torch.Tensor, hidden_layers, skip_layers) -> bool:
        """Whether a pass can take the one-call layer path: one sequence, no layer skipped, no
        hidden state asked for."""
        return (self._stack is not None and tokens.shape[0] == 1 and not hidden_layers and not skip_layers
                and not self._observed_rows)

    def _batched(self, tokens: torch.Tensor, hidden_layers, skip_layers) -> bool:
        """Whether this pass goes through the batcher (the one-call path, all of the model's layers)."""
        return (self.batcher is not None and self._one_call(tokens, hidden_layers, skip_layers)
                and self.config.num_layers == self._stack.num_layers)

    def _prefill_chunk(self, tokens: torch.Tensor, hidden_layers, skip_layers, observe: bool = False) -> int | None:
        """How many tokens of a long ``append`` go in one pass, or None for all at once.

        Batched (serving): :data:`.batching.PREFILL_CHUNK` while other requests are decoding, so that
        a long prompt joins the batch a chunk at a time and their steps keep coming; alone, the
        largest pass the batcher runs (fewer, fuller passes). Alone, where the kernels take the
        pass (either numerics; always for the int8 and int4 caches): their row limit, so that a
        prompt is read by the same kernels as every other pass; rows are independent there, so any
        chunking gives the same bits, alone or served (one pass through torch would round otherwise),
        except where a policy evicts between passes (H2O, whose prompt is then read 64 tokens a pass
        in either numerics, alone and served).
        A cache that evicts while it reads a prompt (StreamingLLM) reads it in chunks of its own,
        at most ``PREFILL_CHUNK``, alone and served alike: where it compacts depends on them. So does
        a pass whose attention a policy observes (H2O's every pass, SnapKV's window): it never goes
        through the batcher, and is chunked as it would be alone whatever else is served."""
        evicting = self.kv_policy.prefill_chunk()
        if evicting is not None:
            return min(evicting, PREFILL_CHUNK)
        if observe and self.kv_policy.observes_every_pass:  # H2O evicts between them: the kernels' passes on any path
            return MAX_ROWS
        if not observe and self._batched(tokens, hidden_layers, skip_layers):
            return PREFILL_CHUNK if self.batcher.active > 1 else self.batcher.max_rows
        # the kernels' passes; and only the kernels read and write the int8 and int4 caches
        return MAX_ROWS if self._one_call(tokens, hidden_layers, skip_layers) or self.kv_policy.quantised else None

    @torch.inference_mode()
    def append(self, tokens: torch.Tensor, *, hidden_layers: Sequence[int] = (), skip_layers: frozenset[int] = frozenset(),
               last_only: bool = False) -> StepOutput:
        policy, k, first = self.kv_policy, tokens.shape[1], self._first_pass
        observed = policy.observation_rows(self._slots, k, first)
        self._first_pass = False
        if 0 < observed < k:  # only the pass's last rows report their attention (SnapKV's window)
            parts = [self._append(tokens[:, :-observed], hidden_layers, skip_layers, last_only, False),
                     self._append(tokens[:, -observed:], hidden_layers, skip_layers, last_only, True)]
            out = _joined(parts, last_only)
        else:
            out = self._append(tokens, hidden_layers, skip_layers, last_only, observed > 0)
        if policy.compress_after(self._slots, first):
            self._compact()
        self.last_features = out.features
        return out

    def _append(self, tokens: torch.Tensor, hidden_layers, skip_layers, last_only: bool, observe: bool) -> StepOutput:
        chunk = self._prefill_chunk(tokens, hidden_layers, skip_layers, observe)
        if chunk is not None and tokens.shape[1] > chunk:
            parts = []
            for part in tokens.split(chunk, dim=1):
                self.check_interrupt()  # between passes: nothing of a batch is pending
                parts.append(self._append(part, hidden_layers, skip_layers, last_only, observe))
            return _joined(parts, last_only)
        def causal(start: int, k: int) -> torch.Tensor | None:
            # k == 1 attends to everything cached; otherwise causal within the new block.
            return None if k == 1 else torch.ones(k, start + k, dtype=torch.bool).tril(diagonal=start)

        return self._commit_pass(tokens, causal, hidden_layers, skip_layers, last_only, observe, causal=True)

    def _commit_pass(self, tokens: torch.Tensor, visibility, hidden_layers=(), skip_layers=frozenset(),
                     last_only: bool = False, observe: bool = False, causal: bool = False) -> StepOutput:
        """One pass of ``tokens`` ``[B, k]`` after the cache, committed: room made first (a policy may
        compact), then written at the next slots and positions, seeing ``visibility(start, k)`` (the
        mask over the ``start`` committed slots and the new ones; None: all)."""
        k = tokens.shape[1]
        self._make_room(k)
        start, position = self._next_slot()
        self._check_positions(position + k)
        positions = torch.arange(position, position + k)
        self._written(start, torch.arange(self._length, self._length + k))
        self._observed_rows = observe
        try:
            out = self._forward(tokens, positions, visibility(start, k), hidden_layers, skip_layers, last_only,
                                causal=causal)
        finally:
            self._observed_rows = False
        self._length += k
        self._slots += k
        self._pending_tree = None
        return out

    # What a cache policy needs: slots apart from tokens, compaction, attention weights -------------

    @torch.inference_mode()
    def append_windowed(self, tokens: torch.Tensor, sink: int, window: int) -> StepOutput:
        """Append ``tokens`` ``[1, k]`` attending only to the first ``sink`` and the last ``window``
        cached entries (and causally to each other), at the positions this cache assigns (the
        tokens' own under ``full`` and ``int8``): StreamingLLM's attention over this cache, without evicting anything (``kvdraft``'s draft passes, which
        the drafter rolls back). Committed like :meth:`append`. Not under ``int4``, whose
        quantised tokens every query sees."""
        if self._kivi is not None:
            raise InvalidParameter(f"kv cache {self.kv_policy.spec}: windowed passes are not supported")
        def sinks_and_window(start: int, k: int) -> torch.Tensor:
            visible = torch.zeros(k, start + k, dtype=torch.bool)
            visible[:, streaming_keep(start, sink, window)] = True
            visible[:, start:] = torch.ones(k, k, dtype=torch.bool).tril()
            return visible

        return self._commit_pass(tokens, sinks_and_window)

    @torch.inference_mode()
    def adopt(self, source: "NativeLlama", token_ids: Sequence[int]) -> None:
        """Start this cache from ``source``'s committed entries (a full cache of this model, batch 1,
        holding ``token_ids``), keeping what this cache's policy keeps, without reading the tokens
        again, except what the policy must observe: SnapKV reads the prompt's last ``window``
        tokens again, H2O the whole prompt (its accumulated attention counts the prompt's queries,
        which no cache holds). How a compressed cache is made from the target's after its prompt
        (``kvdraft``)."""
        if (source.kv_policy.one_sequence() or source.config != self.config or source.batch_size != 1
                or source.length != len(token_ids)):
            raise ValueError("adopt() needs a full cache of the same model holding one sequence")
        if self._kivi is not None:
            raise InvalidParameter(f"kv cache {self.kv_policy.spec} cannot be made from another cache; read the tokens")
        policy, n = self.kv_policy, source.length
        self.reset(1)
        observed = n if policy.observes_every_pass else policy.observation_rows(0, n, True)
        copied = n - observed
        if policy.reassigns_positions and policy.compact_before(copied, 1):
            keep = policy.keep(copied, None)  # only what is kept is copied
        else:
            keep = torch.arange(copied)
        self._ensure_capacity(keep.numel())
        span = slice(0, keep.numel())
        for mine, theirs in ((self._k, source._k), (self._v, source._v)):
            rows = theirs[:, :, :, keep]
            mine[:, :, :, span] = quantise_int8_rows(rows) if self._int8 is not None else rows
        if policy.evicts():
            self._held[..., span] = keep
        if policy.reassigns_positions:
            self._rotate_keys(keep.numel(), keep - torch.arange(keep.numel()))
        self._length, self._slots = copied, keep.numel()
        self._tail_from = copied - policy.recent if keep.numel() < copied else 0
        if observed:  # read again, observed, and compressed after (SnapKV) or as they come (H2O)
            self.append(torch.tensor([list(token_ids[copied:n])]), last_only=True)
        else:
            self._first_pass = False

    def _next_slot(self) -> tuple[int, int]:
        return self._slots, self._slots if self.kv_policy.reassigns_positions else self._length

    def pass_room(self) -> int:
        return min(self._context_room(), self.max_pass_tokens)

    def _context_room(self) -> int:
        # a window's positions are its slots: what is left of the context after the entries the
        # next pass finds (fewer if the pass compacts the cache first)
        if not self.kv_policy.reassigns_positions:
            return super().pass_room()
        policy, slots = self.kv_policy, self._slots
        if not self._compaction_held and policy.compact_before(slots, 1):
            slots = policy.keep(slots, None).numel()
        return self.config.max_position - slots

    def _check_positions(self, end: int) -> None:
        """Positions below ``end`` must have rotary angles (computed here, where they are not yet): a
        cache that evicts but keeps positions (H2O, SnapKV) is as bound by the context window as
        the full cache."""
        if end > self.config.max_position:
            if self.kv_policy.reassigns_positions:  # a window that leaves no room for a pass this long
                raise PromptTooLong(f"kv cache {self.kv_policy.spec}: a pass reaching cache slot {end} goes past the "
                                    f"model's context of {self.config.max_position}; a smaller window leaves room for it")
            raise PromptTooLong(f"sequence of {end} tokens exceeds the model's context of {self.config.max_position}"
                                + ("; a sink:S,window:W cache runs past it" if self.takes_streaming_cache else ""))
        for table in self._ropes:
            table.reach(end)

    @contextmanager
    def compaction_held(self) -> Iterator[None]:
        held, self._compaction_held = self._compaction_held, True
        try:
            yield
        finally:
            self._compaction_held = held

    def chain_reach(self) -> int | None:
        """Any number of passes, but under KIVI's codes (:meth:`KVPolicy.one_token_passes_rolled_back`)
        and a window whose positions are its slots: as many as the context has room for uncompacted."""
        reach = self.kv_policy.one_token_passes_rolled_back()
        if self.kv_policy.reassigns_positions:
            room = max(0, self.config.max_position - self._slots)
            reach = room if reach is None else min(reach, room)
        return reach

    def _make_room(self, incoming: int) -> None:
        if not self._compaction_held and self.kv_policy.compact_before(self._slots, incoming):
            self._compact()
        if self._kivi is not None:
            self._quantise_ahead(incoming)

    def _quantise_ahead(self, incoming: int) -> None:
        """int4, before a pass of up to ``incoming`` new positions: quantise the groups its last
        query reads quantised (all written, as residual >= the longest pass), and drop the float
        rows no later query reads, a group or more at a time. Rolling back can then reach back
        ``recent`` tokens before this pass, never into the quantised ones (they would need their
        float rows again): the lowest later query is at ``_tail_from``."""
        policy, store = self.kv_policy, self._kivi
        self._tail_from = max(self._tail_from, self._length - policy.recent)
        end = int(policy.quantised_end(torch.tensor(self._length + incoming - 1)))
        if end > store.tokens:
            span = slice(store.tokens - self._base, end - self._base)
            store.append(self._k[:, 0, :, span], self._v[:, 0, :, span])
        drop = int(policy.quantised_end(torch.tensor(self._tail_from))) - self._base
        if drop >= policy.group:  # moving the residual costs a copy of it: not every pass
            kept = slice(drop, self._slots)
            for cache in (self._k, self._v):
                cache[:, :, :, : self._slots - drop] = cache[:, :, :, kept].clone()
            self._base += drop
            self._slots -= drop

    def _written(self, slot: int, tokens: torch.Tensor) -> None:
        """Slots ``slot..`` are about to receive the entries of ``tokens`` (sequence indices)."""
        if self.kv_policy.evicts():
            self._ensure_capacity(slot + tokens.numel())
            span = slice(slot, slot + tokens.numel())
            self._held[..., span] = tokens
            self._mass[..., span] = 0.0

    @torch.inference_mode()
    def _compact(self) -> None:
        """Keep the slots the policy chooses, moved to the front in order."""
        keep = self.kv_policy.keep(self._slots, self._mass[..., : self._slots] if self.kv_policy.evicts() else None)
        n = keep.shape[-1]
        if n < self._slots:
            if keep.dim() == 1:  # the same slots in every layer and head
                for cache in (self._k, self._v):
                    cache[:, :, :, :n] = cache[:, :, :, keep]
                for table in (self._held, self._mass):
                    table[..., :n] = table[..., keep]
                if self.kv_policy.reassigns_positions:
                    self._rotate_keys(n, keep - torch.arange(n))
            else:  # per layer and head: [L, H_kv, n]
                L, B, H, _, D = self._k.shape
                index = keep[:, None, :, :, None].expand(L, B, H, n, D)
                for cache in (self._k, self._v):
                    cache[:, :, :, :n] = cache[:, :, :, : self._slots].gather(3, index)
                for table in (self._held, self._mass):
                    table[..., :n] = table[..., : self._slots].gather(2, keep)
            self._slots = n
        self._tail_from = max(self._tail_from, self._length - self.kv_policy.recent)

    def _rotate_keys(self, n: int, moved_by: torch.Tensor) -> None:
        """Rotate the keys of slots ``0..n`` back by the distance each moved (a RoPE rotation by
        position composes: this places each at its new slot's position)."""
        keys = self._k[:, :, :, :n]
        if moved_by.numel():  # the angles of distances no pass of this model has reached (an adopted cache's)
            self._rope.reach(int(moved_by.max()) + 1)
        pairs = torch.view_as_complex(keys.float().reshape(*keys.shape[:-1], -1, 2).contiguous())
        rotated = torch.view_as_real(pairs * self._freqs[moved_by].conj()).flatten(-2)
        keys.copy_(rotated.to(keys.dtype))

    def _observe(self, layer: int, q: torch.Tensor, end: int, mask: torch.Tensor | None) -> None:
        """Add the attention weights of the pass's rows ``q [k, H, D]`` over slots ``0..end`` to the
        policy's mass (summed over rows and each key/value head's group of query heads). Computed
        in torch beside the kernels' attention: only which entries to keep depends on it."""
        c = self.config
        keys = self._k[layer, 0, :, :end].float()
        rows = q.shape[0]
        grouped = q.float().reshape(rows, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)
        for r in range(0, rows, 256):  # bounded memory for a long prompt
            scores = torch.einsum("rhgd,hnd->rhgn", grouped[r : r + 256], keys) * self._attention_scale
            if mask is not None:
                scores = scores.masked_fill(~mask[r : r + 256, None, None, :end], float("-inf"))
            self._mass[layer, :, :end] += scores.softmax(-1).sum(dim=(0, 2))

    def _run_tree(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> StepOutput:
        start, position = self._next_slot()
        self._check_positions(int(positions.max()) + 1)
        self._written(start, self._length + positions - position)
        self._observed_rows = self.kv_policy.observes_every_pass
        try:
            return self._forward(tokens, positions, visible, (), frozenset(), False)
        finally:
            self._observed_rows = False

    def _move_entries(self, src: torch.Tensor, dst: int) -> None:
        span = slice(dst, dst + src.numel())
        self._k[:, :, :, span] = self._k[:, :, :, src]
        self._v[:, :, :, span] = self._v[:, :, :, src]
        if self.kv_policy.evicts():
            for table in (self._held, self._mass):
                table[..., span] = table[..., src]

    def _set_length(self, slots: int) -> None:
        self._length += slots - self._slots
        self._slots = slots

    def weight_traffic(self) -> tuple[int, int]:
        projections = self.weights.projections
        return sum(p.streamed_bytes for p in projections), sum(p.weight.numel() for p in projections)

    def _forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        hidden_layers: Sequence[int],
        skip_layers: frozenset[int],
        last_only: bool,
        causal: bool = False,
    ) -> StepOutput:
        """``causal``: ``mask`` is plain causal attention over the new tokens after the cache."""
        if self._batched(tokens, hidden_layers, skip_layers):
            self._ensure_capacity(self._slots + tokens.shape[1])
            logits, features = self.batcher.run(self, tokens[0], positions, mask, self._slots, last_only)
            return StepOutput(logits=logits[None], features=features[None])
        if self.batcher is not None and tokens.shape[0] > 1:  # a served search's sequences: a turn of their own
            return self.batcher.take_turn(self, tokens.numel(), lambda: self._forward_alone(
                tokens, positions, mask, hidden_layers, skip_layers, last_only, causal))
        return self._forward_alone(tokens, positions, mask, hidden_layers, skip_layers, last_only, causal)

    def _forward_alone(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                       hidden_layers: Sequence[int], skip_layers: frozenset[int], last_only: bool,
                       causal: bool) -> StepOutput:
        """A pass of this backend's own, on the calling thread (not through the batcher)."""
        # The kernels' thread count for this pass. The governor compares the times of one pass kind
        # under each count: plain steps over this cache are timed, not the one-token passes that
        # cost less (a kvdraft draft attending to a window, a layer-skipping draft), which would
        # make one thread look faster whenever it happened to time one of them.
        plain_step = tokens.numel() == 1 and not skip_layers and mask is None
        with GOVERNOR.governed(self._governor_key, timed=plain_step):
            start = self._slots
            self._ensure_capacity(start + tokens.shape[1])
            # Passes the matmul kernels take also get the element-wise kernels, so a token's
            # arithmetic is the same in a plain step and in any verification pass.
            ops = self._ops if tokens.shape[1] <= MAX_ROWS else None
            x = self._embed(tokens)
            if self._stack is not None and ops is not None and not hidden_layers and not self._observed_rows:
                out = self._forward_in_c(x, positions, mask, start, skip_layers, ops, last_only)
                if out is not None:
                    return out
            return self._forward_layers(x, positions, mask, start, hidden_layers, skip_layers, ops, last_only, causal)

    def _forward_in_c(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, start: int,
                      skip_layers: frozenset[int], ops, last_only: bool) -> StepOutput | None:
        """The pass through forward.c: the same kernels as :meth:`_forward_layers`, called from C in
        one go; None where it does not take the pass (several sequences under a 3-D mask)."""
        batch, k = x.shape[:2]
        if batch > 1 and mask is not None and mask.dim() != 2:
            return None
        pending = torch.empty_like(x)
        if batch == 1:
            ran = self._stack.run(
                x[0], pending[0], self._freqs_pairs, positions, mask, self._k[:, 0], self._v[:, 0], start,
                skip_layers, kivi=self._kivi_view(positions),
            )
            return self._logits(x, pending if ran else None, ops, last_only, {})
        # several sequences of this cache (a search's rows), each on its own slice of it, as the
        # pass batcher runs sequences: every row's logits are bit for bit those it gets alone (the
        # layer loop attends through torch for them all)
        parts = [SequencePart(k, start, positions, mask, self._k[:, b], self._v[:, b]) for b in range(batch)]
        ran = self._stack.run_batch(x.view(batch * k, -1), pending.view(batch * k, -1), self._freqs_pairs,
                                    parts, skip_layers)
        return self._logits(x, pending if ran else None, ops, last_only, {})

    def _forward_layers(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, start: int,
                        hidden_layers: Sequence[int], skip_layers: frozenset[int], ops, last_only: bool,
                        causal: bool) -> StepOutput:
        """The pass layer by layer from Python (long prefills, hidden states, observed rows)."""
        pending = None  # the last MLP output, added to x inside the next norm (one fused call)
        hidden: dict[int, torch.Tensor] = {}
        if 0 in hidden_layers:
            hidden[0] = x.clone()
        for i, layer in enumerate(self.weights.layers):
            if i not in skip_layers:
                pending = self._layer(i, layer, x, pending, positions, mask, start, ops, causal)
            if i + 1 in hidden_layers:
                if pending is not None:
                    x.add_(pending)  # rounds as the fused add does
                    pending = None
                hidden[i + 1] = x.clone()
        return self._logits(x, pending, ops, last_only, hidden)

    @torch.inference_mode()
    def forward_batch(self, passes: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run the waiting passes of several clones of this model (:class:`.batching.PassBatcher`)
        as one: returns each pass's logits ``[k, V]`` (``[1, V]`` where it wants the last only)
        and features ``[k, D]``."""
        with GOVERNOR.governed(self._governor_key, timed=False):
            w = self.weights
            x = self._embed(torch.cat([p.tokens for p in passes]))
            pending = torch.empty_like(x)
            parts = [SequencePart(len(p.tokens), p.start, p.positions, p.visible, p.backend._k[:, 0], p.backend._v[:, 0],
                                  p.backend._kivi_view(p.positions)) for p in passes]
            ran = self._stack.run_batch(x, pending, self._freqs_pairs, parts)
            h = self._add_norm(x, pending if ran else None, w.final_norm, self._ops)
            ends = torch.tensor([len(p.tokens) for p in passes]).cumsum(0).tolist()
            wanted = [list(range(end - 1, end)) if p.last_only else list(range(end - len(p.tokens), end))
                      for p, end in zip(passes, ends)]
            logits = self._head(h[[i for rows in wanted for i in rows]])
            return list(zip(logits.split([len(rows) for rows in wanted]), h.split([len(p.tokens) for p in passes])))

    def _kivi_view(self, positions: torch.Tensor) -> KiviView | None:
        """Under the int4 cache, what a pass at ``positions`` reads from its codes; None otherwise."""
        if self._kivi is None:
            return None
        return KiviView(self._kivi, self._base, self.kv_policy.quantised_end(positions))

    def _layer(self, i: int, layer: dict, x: torch.Tensor, pending: torch.Tensor | None, positions: torch.Tensor,
               mask: torch.Tensor | None, start: int, ops, causal: bool) -> torch.Tensor:
        """Layer ``i`` on the residual stream ``x`` (``pending``, the last layer's output, is added
        first, inside the norm): returns this layer's output, to be added in turn."""
        h = self._add_norm(x, pending, layer["attn_norm"], ops)
        attn = self._attention(i, layer["qkv"](h), positions, mask, start, ops, causal)
        h = self._add_norm(x, layer["o"](attn), layer["mlp_norm"], ops)
        gate_up = layer["gate_up"](h)
        if ops is not None:
            return layer["down"](ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return layer["down"](F.silu(gate) * up)

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._embed(tokens).float()

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weights.lm_head.weight_rows(ids).float()

    def matrix(self, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        weight = weight.detach().float().contiguous()
        rows, n_in = weight.shape
        if n_in % 32 or rows % 16 or self.dtype != torch.float32:  # not a shape the block kernels take
            return super().matrix(weight)
        blocks = BlockMatrix.quantize(weight, "q8_0")  # a drafter need not be exact: 8 bits read a quarter of 32
        numerics = self.numerics if fast_numerics_unavailable(blocks) is None else "exact"
        return Projection(blocks.dequantize(), None, blocks, numerics)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The residual stream's start: a fresh tensor, updated in place by the layers."""
        return self.weights.embedding(tokens)

    def _logits(self, x: torch.Tensor, pending: torch.Tensor | None, ops, last_only: bool, hidden: dict) -> StepOutput:
        w = self.weights
        features = self._add_norm(x, pending, w.final_norm, ops)
        h = features[:, -1:] if last_only else features
        return StepOutput(logits=self._head(h), hidden=hidden, features=features)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (float32) from the final norm's output, at most ``MAX_ROWS`` rows a call: a
        search's batch can hold more rows than the row kernels take, and each row must get the
        bits it gets alone (a longer call to float32 weights goes to a GEMM, which sums otherwise)."""
        rows = h.reshape(-1, h.shape[-1])
        if rows.shape[0] <= MAX_ROWS:
            return self._finite(self.weights.lm_head(h).float())  # every pass's: a NaN mid-answer is said too
        parts = [self.weights.lm_head(rows[i : i + MAX_ROWS]) for i in range(0, rows.shape[0], MAX_ROWS)]
        return self._finite(torch.cat(parts).view(*h.shape[:-1], -1).float())

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, ops) -> torch.Tensor:
        """``x += delta`` in place (the residual add), then the RMSNorm of x."""
        if ops is not None:
            return ops.add_rms_norm(x, delta, weight, self.config.rms_norm_eps)
        if delta is not None:
            x.add_(delta)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _attention(
        self, i: int, qkv: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, start: int, ops,
        causal: bool = False,
    ) -> torch.Tensor:
        """Layer ``i``'s attention for the fused projection ``qkv [B, k, (H + 2 H_kv) D]``: rotate
        q and k, write k and v to cache slots ``start..start+k``, attend over the cache under
        ``mask`` (plain causal where ``causal``). Returns ``[B, k, H D]`` in the model dtype."""
        c = self.config
        batch, k = qkv.shape[:2]
        end = start + k
        q_size = c.num_heads * c.head_dim
        scale = self._attention_scale
        pairs = self._rope_pairs(i)
        lo, windowed = 0, self._window(i, positions, mask, start)
        if windowed is not None:  # a sliding-window layer: keys from slot lo on, under its own mask
            (lo, mask), causal = windowed, False
        if self._kivi is not None:  # the int4 cache: float residual written as usual, read with the codes
            if ops is None or batch != 1:
                raise ValueError(f"the int4 cache takes passes of one sequence and at most {MAX_ROWS} tokens")
            q = ops.rope_store(qkv, pairs, positions, self._k[i, 0], self._v[i, 0], start, c.num_heads)
            heads = self._kivi_attention(q, self._kivi_view(positions), i, self._k[i, 0], self._v[i, 0], end, mask, scale)
            return heads.view(batch, k, q_size)
        if self._int8 is not None:  # the int8 cache: its kernels only (passes are read MAX_ROWS at a time)
            if ops is None or batch != 1:
                raise ValueError(f"the int8 cache takes passes of one sequence and at most {MAX_ROWS} tokens")
            q = self._int8.rope_store(qkv, pairs, positions, self._k[i, 0], self._v[i, 0], start, c.num_heads)
            heads = self._int8.attention(q, self._k[i, 0, :, lo:end], self._v[i, 0, :, lo:end], mask, scale)
            return heads.view(batch, k, q_size)
        if self._attend is not None and batch == 1 and k <= MAX_ROWS:
            # One sequence, few tokens: the layout-independent kernel (see kernels/attention.c).
            if ops is not None:
                q = ops.rope_store(qkv, pairs, positions, self._k[i, 0], self._v[i, 0], start, c.num_heads)
            else:
                q = self._rope_and_store(i, qkv, positions, start)[0][0]
            if self._observed_rows:
                self._observe(i, q, end, mask)
            heads = self._attend(q, self._k[i, 0, :, lo:end], self._v[i, 0, :, lo:end], mask, scale)
            return heads.to(qkv.dtype).view(batch, k, q_size)
        _, q = self._rope_and_store(i, qkv, positions, start)
        if self._observed_rows:
            self._observe(i, q[0].transpose(0, 1), end, mask)
        # A prompt's first pass: causal attention without a mask, which torch runs blockwise (flash
        # attention), instead of materialising every head's k x k score matrix.
        plain_causal = causal and start == 0
        return F.scaled_dot_product_attention(
            q, self._k[i, :, :, lo:end], self._v[i, :, :, lo:end], attn_mask=None if plain_causal else mask,
            is_causal=plain_causal, enable_gqa=c.num_heads != c.num_kv_heads, scale=scale,
        ).transpose(1, 2).reshape(batch, k, q_size)

    @property
    def _governor_key(self) -> tuple:
        """What the thread governor keeps its pass times under: this model in these numerics, dtype
        and cache (each its own speed; one model's two numerics in ``decodekit profile`` shared them)."""
        return self.info.name, self.numerics, str(self.dtype), self.kv_policy.spec

    @property
    def _attention_scale(self) -> float:
        return self.config.head_dim**-0.5

    def _rope_pairs(self, i: int) -> torch.Tensor:
        """Layer ``i``'s rotary table as (cos, sin) pairs ``[max_position, D]`` (one for all layers here)."""
        return self._freqs_pairs

    def _rope_angles(self, i: int) -> torch.Tensor:
        """Layer ``i``'s rotary table as complex numbers ``[max_position, D / 2]``."""
        return self._freqs

    def _window(self, i: int, positions: torch.Tensor, mask: torch.Tensor | None, start: int):
        """For a layer that attends to a sliding window of keys: ``(lo, mask)``, the first slot it
        can see and its mask over slots ``lo..``; None where the layer sees what ``mask`` says
        (every layer of a Llama)."""
        return None

    def _rope_and_store(self, i: int, qkv: torch.Tensor, positions: torch.Tensor, start: int):
        """The torch path of rotary embedding and cache write. Returns (q [B, k, H, D], q [B, H, k, D])."""
        c = self.config
        batch, k = qkv.shape[:2]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        freqs = self._rope_angles(i)[positions].view(1, k, 1, -1)
        # Rotate q and k heads together: one complex multiply for both.
        qk = apply_rope(qkv[..., : q_size + kv_size].view(batch, k, -1, c.head_dim), freqs)
        q, kk = qk.transpose(1, 2).split((c.num_heads, c.num_kv_heads), dim=1)
        v = qkv[..., q_size + kv_size :]
        self._k[i, :, :, start : start + k] = kk
        self._v[i, :, :, start : start + k] = v.view(batch, k, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return qk[:, :, : c.num_heads], q


def _joined(parts: list[StepOutput], last_only: bool) -> StepOutput:
    """One pass's output from the outputs of its consecutive pieces."""
    if last_only:
        logits = parts[-1].logits
    else:
        logits = torch.cat([p.logits for p in parts], dim=1)
    hidden = {layer: torch.cat([p.hidden[layer] for p in parts], dim=1) for layer in parts[-1].hidden}
    features = None if any(p.features is None for p in parts) else torch.cat([p.features for p in parts], dim=1)
    return StepOutput(logits=logits, hidden=hidden, features=features)
