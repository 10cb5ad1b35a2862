"""``attention.c``: attention over the cache for a few queries, each computed from the keys it
sees in cache order (float32, bfloat16, the int8 cache, the KIVI codes)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

import torch

from .build import _address, _library

AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", float], torch.Tensor]


@cache
def layout_independent_attention(dtype: torch.dtype, head_dim: int) -> AttentionKernel | None:
    """``attention(q [n_q, H, D], k [H_kv, cap, D], v [H_kv, cap, D], visible [n_q, n_keys] | None,
    scale) -> [n_q, H, D]`` (``attention.c``) for a ``dtype`` cache (float32 or bfloat16) and
    ``head_dim`` D (a multiple of 16, at most 256), or None where unavailable. ``visible`` None means every query sees the first ``n_keys`` = cap keys;
    pass ``k``/``v`` sliced to the keys in use. A query's result depends only on the keys it
    sees, in cache order, so a token verified in a tree gets the same result as in a plain step."""
    lib = _library("attention")
    if lib is None or dtype not in (torch.float32, torch.bfloat16) or head_dim % 16 or head_dim > 256:
        return None
    fn = lib.decodekit_attention_f32 if dtype == torch.float32 else lib.decodekit_attention_bf16
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    fn.restype = None

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float) -> torch.Tensor:
        if q.shape[2] != head_dim or k.stride(2) != 1 or k.stride(1) != head_dim or v.stride() != k.stride():
            raise ValueError(f"attention kernel: needs head_dim {head_dim} and contiguous k, v rows")
        return _run_attention(fn, q, k, v, visible, scale, head_dim, head_dim)

    attention.address = _address(fn)
    return attention


def attention_plan(n_q: int, n_heads: int, n_kv_heads: int, head_dim: int, n_keys: int,
                   visible: torch.Tensor | None, threads: int) -> dict[str, int] | None:
    """How the float32 kernel would cut a pass between ``threads`` (``decodekit_attention_plan``):
    its jobs, the pieces each group's keys are cut into, the blocks of rows, the shares of a group's
    heads, and the busiest thread's work in rows x queries x keys; None where the kernels are unavailable."""
    lib = _library("attention")
    if lib is None:
        return None
    fn = lib.decodekit_attention_plan
    fn.argtypes = [ctypes.c_int] * 5 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    fn.restype = None
    _check_heads_and_mask(torch.empty(n_q, n_heads, 0), n_kv_heads, visible, n_keys)
    mask = None if visible is None else visible.to(torch.bool).contiguous()
    out = (ctypes.c_int64 * 5)()
    fn(n_q, n_heads, n_kv_heads, head_dim, n_keys, None if mask is None else mask.data_ptr(), threads, out)
    return dict(zip(("jobs", "pieces", "blocks", "shares", "heaviest"), out))


def _run_attention(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                   scale: float, head_dim: int, row: int) -> torch.Tensor:
    """Call an ``attention.c`` kernel on ``k``/``v`` ``[H_kv, keys, row]`` (sliced to the keys in use,
    ``row`` cache elements a key) for ``q`` ``[n_q, H, head_dim]``; returns ``[n_q, H, head_dim]``."""
    n_q, n_heads = q.shape[:2]
    _check_heads_and_mask(q, k.shape[0], visible, k.shape[1])
    q = q.float().contiguous()
    out = torch.empty(n_q, n_heads, head_dim, dtype=torch.float32)
    mask = None if visible is None else visible.to(torch.bool).contiguous()
    fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), None if mask is None else mask.data_ptr(), out.data_ptr(),
       n_q, n_heads, k.shape[0], head_dim, k.stride(0) // row, k.shape[1], scale, torch.get_num_threads())
    return out


def _check_heads_and_mask(q: torch.Tensor, n_kv_heads: int, visible: torch.Tensor | None, n_keys: int) -> None:
    """What the attention kernels rely on: H query heads in groups of H / H_kv per key/value head
    (the heads past the last whole group were never written: their output was whatever memory
    held), and a mask of one byte per row and key (a narrower one was read past its end)."""
    n_q, n_heads = q.shape[:2]
    if q.dim() != 3 or n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"attention kernel: queries [n_q, H, D] with H a multiple of the cache's {n_kv_heads} "
                         f"key/value heads, got {tuple(q.shape)}")
    if visible is not None and tuple(visible.shape) != (n_q, n_keys):
        raise ValueError(f"attention kernel: a mask [{n_q}, {n_keys}] (rows, keys), got {tuple(visible.shape)}")


def check_rope_store(qkv: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, start: int, n_heads: int,
                     n_kv_heads: int, head_dim: int, cap: int) -> int:
    """What ``rope_store`` writes and reads must lie inside its tensors (the C code trusts it: a
    slot past the cache's end overwrote the heap): qkv's rows ``(H + 2 H_kv) D`` wide, a position
    a row, slots ``start .. start + rows`` within the ``cap`` slots, (cos, sin) rows D wide.
    Returns the number of rows."""
    if qkv.shape[-1] != (n_heads + 2 * n_kv_heads) * head_dim or freqs.dim() != 2 or freqs.shape[1] != head_dim:
        raise ValueError(f"rope_store: qkv rows of {(n_heads + 2 * n_kv_heads) * head_dim} and angles of {head_dim} "
                         f"values, got {qkv.shape[-1]} and {tuple(freqs.shape)}")
    rows = qkv.numel() // qkv.shape[-1]
    check_slots("rope_store", rows, positions, start, cap, freqs)
    return rows


def check_slots(what: str, rows: int, positions: torch.Tensor, start: int, cap: int, freqs: torch.Tensor) -> None:
    """``rows`` new tokens written to cache slots ``start .. start + rows`` of ``cap``, each at its
    position, whose row of (cos, sin) in ``freqs`` the C code reads unchecked: a slot past the
    cache's end overwrote the heap, a position past the table read memory past it (or crashed)."""
    if positions.numel() != rows or not 0 <= start <= cap - rows:
        raise ValueError(f"{what}: {rows} rows need as many positions (got {positions.numel()}) and slots "
                         f"{start} .. {start + rows} within the cache's {cap}")
    if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < freqs.shape[0]:
        raise ValueError(f"{what}: positions {int(positions.min())} .. {int(positions.max())} outside the "
                         f"rotary table's {freqs.shape[0]}")


class Int8CacheKernels:
    """The int8 cache's two kernels (kv cache ``int8``, float32 models): each (head, slot) row is
    ``head_dim`` int8 values then their float32 scale, held in float32 tensors of
    ``head_dim // 4 + 1`` elements a row (so the cache's shapes and strides stay float32 ones).
    ``rope_store`` is layer_ops' with the key and value quantised on the way in; ``attention``
    reads the rows directly. Both compute every row on its own, as their float32 versions do."""

    def __init__(self, attention_lib: ctypes.CDLL, ops_lib: ctypes.CDLL, head_dim: int):
        self.head_dim, self.row = head_dim, head_dim // 4 + 1
        self._attention = attention_lib.decodekit_attention_q8
        self._attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
        self._rope_store = ops_lib.decodekit_rope_store_q8
        self._rope_store.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6
        self._attention.restype = self._rope_store.restype = None
        self.attention_address, self.rope_store_address = _address(self._attention), _address(self._rope_store)

    def rope_store(self, qkv: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, start: int, n_heads: int) -> torch.Tensor:
        """As :meth:`LayerOps.rope_store`, into int8 caches ``[H_kv, cap, row]``."""
        n_kv_heads, cap = k_cache.shape[0], k_cache.shape[1]
        if k_cache.shape[2] != self.row or not k_cache.is_contiguous() or not v_cache.is_contiguous():
            raise ValueError("int8 rope_store needs contiguous [H_kv, cap, head_dim / 4 + 1] caches")
        rows = check_rope_store(qkv, freqs, positions, start, n_heads, n_kv_heads, self.head_dim, cap)
        q = torch.empty(rows, n_heads, self.head_dim, dtype=torch.float32)
        positions = positions.to(torch.int64).contiguous()
        qkv = qkv.float().contiguous()
        self._rope_store(qkv.data_ptr(), freqs.data_ptr(), positions.data_ptr(), q.data_ptr(),
                         k_cache.data_ptr(), v_cache.data_ptr(), rows, n_heads, n_kv_heads, self.head_dim, cap, start)
        return q

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
        """As :func:`layout_independent_attention`'s, over int8 caches sliced to the keys in use."""
        if (q.shape[-1] != self.head_dim or k.shape[2] != self.row or k.stride(1) != self.row
                or v.stride() != k.stride()):
            raise ValueError(f"int8 attention needs queries of head_dim {self.head_dim} and [H_kv, keys, "
                             "head_dim / 4 + 1] caches with contiguous rows")
        return _run_attention(self._attention, q, k, v, visible, scale, self.head_dim, self.row)


@cache
def int8_cache_kernels(head_dim: int) -> Int8CacheKernels | None:
    """The int8 cache's kernels for ``head_dim`` (a multiple of 16, at most 256), or None where unavailable."""
    attention, ops = _library("attention"), _library("layer_ops")
    if attention is None or ops is None or head_dim % 16 or head_dim > 256:
        return None
    return Int8CacheKernels(attention, ops, head_dim)


KiviAttention = Callable[..., torch.Tensor]


@cache
def kivi_attention(head_dim: int) -> "KiviAttention | None":
    """``attention(q [n_q, H, D], view, layer, k_residual [H_kv, cap, D], v_residual, n_residual,
    visible [n_q, n_residual] | None, scale) -> [n_q, H, D]`` over layer ``layer`` of an int4 or
    int2 (KIVI) cache (``attention.c``'s ``decodekit_attention_kivi``): positions below a row's
    ``view.qend`` are read from ``view.store``'s codes, the rest from the float32 residual, whose
    slot 0 holds position ``view.base`` (a :class:`..kivi.KiviView`). None where unavailable
    (head_dim a multiple of 16, at most 256)."""
    lib = _library("attention")
    if lib is None or head_dim % 16 or head_dim > 256:
        return None
    fn = lib.decodekit_attention_kivi
    fn.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_int] * 10 + [ctypes.c_float, ctypes.c_int]
    fn.restype = None

    def attention(q: torch.Tensor, view, layer: int, k_residual: torch.Tensor, v_residual: torch.Tensor,
                  n_residual: int, visible: torch.Tensor | None, scale: float) -> torch.Tensor:
        n_q, n_heads = q.shape[:2]
        store = view.store
        if (q.shape[2] != head_dim or not k_residual.is_contiguous() or not v_residual.is_contiguous()
                or k_residual.shape != v_residual.shape or k_residual.shape[2] != head_dim
                or n_residual > k_residual.shape[1]):
            raise ValueError(f"kivi attention: needs head_dim {head_dim} and contiguous [H_kv, cap, D] residuals")
        _check_heads_and_mask(q, k_residual.shape[0], visible, n_residual)
        if view.qend.numel() != n_q or int(view.qend.min()) < view.base or int(view.qend.max()) > store.tokens:
            raise ValueError("kivi attention: every row needs a quantised end, between the residual's base and the "
                             "quantised tokens")
        q = q.float().contiguous()
        qend = view.qend.to(torch.int32).contiguous()
        mask = None if visible is None else visible.to(torch.bool).contiguous()
        out = torch.empty(n_q, n_heads, head_dim, dtype=torch.float32)
        fn(q.data_ptr(), store.k_codes[layer].data_ptr(), store.k_params[layer].data_ptr(),
           store.v_codes[layer].data_ptr(), store.v_params[layer].data_ptr(), k_residual.data_ptr(),
           v_residual.data_ptr(), qend.data_ptr(), None if mask is None else mask.data_ptr(), out.data_ptr(), n_q,
           n_heads, k_residual.shape[0], head_dim, store.group, store.bits, store.capacity, k_residual.shape[1], view.base,
           n_residual, scale, torch.get_num_threads())
        return out

    attention.address = _address(fn)
    return attention


def quantise_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """float32 rows ``[..., D]`` in the int8 cache's layout (``[..., D / 4 + 1]`` float32 holding D
    int8 values and the scale), exactly as ``rope_store_q8`` writes them."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = 1.0 / scale  # infinite for a zero row or one below ~3.7e-37: stored as zeros
    inverse = torch.where(inverse.isinf(), torch.zeros_like(inverse), inverse)
    q = (x * inverse).round().clamp(-128, 127).to(torch.int8)
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1).view(torch.float32)


def dequantise_int8_rows(packed: torch.Tensor) -> torch.Tensor:
    """The float32 values of int8 cache rows (the inverse layout of :func:`quantise_int8_rows`)."""
    raw = packed.contiguous().view(torch.uint8)
    values, scale = raw[..., :-4].view(torch.int8).float(), raw[..., -4:].contiguous().view(torch.float32)
    return values * scale
