"""``topk.c``, ``race.c`` and ``token_mask.c``: choosing tokens from logits. The k best entries of
a few rows, the argmax of a row, a seeded draw by an exponential race with keyed noise, a
grammar's token bitmask applied to a row (or the row's best allowed token)."""

from __future__ import annotations

import ctypes
import math
from functools import cache

import numpy as np
import torch

from .build import _c_function, _library_that_runs

@cache
def _topk_function() -> ctypes._CFuncPtr | None:
    return _c_function("topk", "decodekit_topk_f32", [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3)


TOPK_MAX = 64  # as in topk.c


def top_k_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of each row of ``x [rows, n]`` as int32 ``[rows, k]``,
    highest first, ties by lower index. ``topk.c`` where available (an order of magnitude faster
    than torch.topk on a row of SmolLM2's 49152 logits), else ``torch.topk``; the kernel leaves -1
    where a row has fewer than k entries above -inf."""
    fn = _topk_function() if 0 < k <= TOPK_MAX else None
    if fn is None:
        return torch.topk(x.float(), k, dim=-1).indices.to(torch.int32)
    x = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], k, dtype=torch.int32)
    fn(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], k)
    return out


@cache
def _argmax_function() -> ctypes._CFuncPtr | None:
    fn = _c_function("topk", "decodekit_argmax_f32", [ctypes.c_void_p, ctypes.c_int64])
    if fn is not None:
        fn.restype = ctypes.c_int64
    return fn


def argmax(x: torch.Tensor) -> int:
    """``int(x.argmax())`` for a 1-D tensor: the first index of the largest entry (NaN counted as
    largest, as torch counts it). ``topk.c`` for a contiguous float32 row on the CPU, where
    torch.argmax spends most of a vocabulary-sized row on tracking indices; torch otherwise."""
    fn = _argmax_function()
    if fn is not None and _kernel_row(x):
        at = fn(x.data_ptr(), x.numel())
        if at >= 0:
            return at
    return int(x.argmax())  # (and a row with a NaN, which the kernel leaves to torch)


def argmax_rows(x: torch.Tensor) -> list[int]:
    """``x.argmax(dim=-1).tolist()`` for a matrix ``[rows, n]``, row by row as :func:`argmax`."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        return x.argmax(dim=-1).tolist()
    return [argmax(row) for row in x.contiguous()]


def _kernel_row(x: torch.Tensor) -> bool:
    """Whether ``x`` is a row the argmax kernels take: contiguous float32 on the CPU, with at least
    one and fewer than 2^31 entries (their lanes count in int32); torch answers for the rest."""
    return (x.dtype == torch.float32 and x.dim() == 1 and x.is_contiguous() and x.device.type == "cpu"
            and 0 < x.numel() < 2**31)


@cache
def _race_function() -> ctypes._CFuncPtr | None:
    lib = _library_that_runs("race", "decodekit_race_runs")  # (the AVX-512 build needs AVX512DQ)
    if lib is None:
        return None
    fn = lib.decodekit_race_f32
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64], ctypes.c_int64
    return fn


_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_RACE_MARGIN = 1.0 + 1e-6  # as race.c's MARGIN


def race_uniforms(key: int, n: int) -> np.ndarray:
    """U(v) for v < n, float64 in (0, 1): race.c's keyed uniforms (h, the SplitMix64 finaliser of
    ``key + (v + 1) * golden``, gives ``(2 (h >> 12) + 1) 2^-53``)."""
    with np.errstate(over="ignore"):  # 64-bit arithmetic wraps, as in C
        z = np.uint64(key) + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
        z ^= z >> np.uint64(31)
    return (((z >> np.uint64(12)) << np.uint64(1)) | np.uint64(1)).astype(np.float64) * 2.0**-53


def _race_ratio(p: float, u: float) -> float:
    return p / -math.log(u)


def _race_without_kernel(p: np.ndarray, key: int) -> int:
    """race.c's answer with numpy and math.log (libm's log, as the kernel's): the same token. The
    filter differs (a lower bound on the winner's ratio first, which numpy computes for the whole
    row at once), and lets through every token that can win, as the kernel's does."""
    if not (np.isfinite(p).all() and (p >= 0).all() and p.max() > 0):
        return -1
    u, p = race_uniforms(key, p.size), p.astype(np.float64)
    floor = np.max(p * u / (1.0 - u))
    scale = _RACE_MARGIN / (floor / _RACE_MARGIN)
    best, best_at = -1.0, -1
    for v in np.flatnonzero((p > 0) & (u >= 1.0 - p * scale)).tolist():  # in index order
        r = _race_ratio(float(p[v]), float(u[v]))
        if r > best:
            best, best_at = r, v
    return best_at


def exponential_race(probs: torch.Tensor, key: int) -> int:
    """argmax_v p(v) / E(v) with E(v) = -log U(v) (:func:`race_uniforms`; Exp(1), i.i.d. over v for
    a key): a draw from ``probs`` ``[V]`` (non-negative, possibly unnormalised) that depends only on
    ``key`` and the distribution. ``race.c`` where available (it takes the logarithm for the few
    tokens that can win), else the same algorithm in numpy; ValueError unless the entries are
    finite and non-negative with a positive sum."""
    if not 0 <= key < 2**64:
        raise ValueError(f"a race's key is a 64-bit unsigned integer, got {key}")
    p = probs.reshape(-1).to("cpu", torch.float32).contiguous()
    fn = _race_function()
    at = fn(p.data_ptr(), p.numel(), key) if fn is not None else _race_without_kernel(p.numpy(), key)
    if at < 0:
        raise ValueError("sampling needs finite, non-negative probabilities with a positive sum")
    return at


@cache
def _mask_function() -> ctypes._CFuncPtr | None:
    return _c_function("token_mask", "decodekit_mask_logits_f32", [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2)


def mask_logits(out: torch.Tensor, bits: np.ndarray, source: torch.Tensor | None = None) -> None:
    """Write into the float32 row ``out [V]`` the row ``source`` (default: ``out`` itself) with -inf
    for every token whose bit in ``bits`` is 0 (llguidance's token bitmask: bit t % 8 of byte
    t // 8 is token t) and every token past its last bit. ``token_mask.c`` where available, else
    numpy's unpacking and a torch select."""
    source = out if source is None else source
    fn = _mask_function()
    known = min(8 * bits.size, out.numel())
    if (fn is None or bits.size % 2 or bits.dtype != np.uint8 or source.shape != out.shape or out.dim() != 1
            or not all(t.is_contiguous() and t.dtype == torch.float32 and t.device.type == "cpu" for t in (out, source))):
        allowed = torch.zeros(out.numel(), dtype=torch.bool)
        allowed[:known] = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:known].view(np.bool_))
        out.copy_(torch.where(allowed, source, float("-inf")))
        return
    bits = np.ascontiguousarray(bits)
    fn(out.data_ptr(), source.data_ptr(), bits.ctypes.data, out.numel(), known)


@cache
def _masked_argmax_function() -> ctypes._CFuncPtr | None:
    fn = _c_function("token_mask", "decodekit_masked_argmax_f32", [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2)
    if fn is not None:
        fn.restype = ctypes.c_int64
    return fn


def masked_argmax(x: torch.Tensor, bits: np.ndarray) -> int:
    """:func:`argmax` of the row :func:`mask_logits` makes from ``x [V]`` and ``bits``, without
    making it: greedy decoding under a grammar reads the logits once and writes nothing."""
    fn = _masked_argmax_function()
    if fn is not None and bits.size % 2 == 0 and bits.dtype == np.uint8 and _kernel_row(x):
        bits = np.ascontiguousarray(bits)
        at = fn(x.data_ptr(), bits.ctypes.data, x.numel(), min(8 * bits.size, x.numel()))
        if at >= 0:
            return at
    masked = torch.empty(x.shape, dtype=torch.float32)
    mask_logits(masked, bits, source=x.to(torch.float32).contiguous())
    return argmax(masked)
