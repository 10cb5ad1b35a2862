"""Compiled kernels for what torch does slowly or inconsistently here, built on first use.

* ``gemm.c``: a float32 or bfloat16 weight matrix (or GGUF blocks of the types in :data:`EXACT_BLOCK_KINDS`, rebuilt in
  float32 on the fly) times a few rows, what a decode step (one row) or a verification pass (a
  few) spends most of its time on (``exact`` numerics; docs/BENCHMARKS.md compares it with oneDNN).
* ``attention.c``: attention over the cache for a few queries, each computed from the keys it
  sees in cache order.
* ``layer_ops.c``: a layer's element-wise work (residual add + RMSNorm, SiLU gating, rotary
  embedding + cache write) in one call each instead of a handful of torch ops.
* ``topk.c``: the k best entries of a few rows of logits in one pass (token recycling's
  per-step table refresh), and the argmax of a row (every greedy step).
* ``token_mask.c``: a grammar's token bitmask applied to a row of logits, or the row's best
  allowed token found without writing the masked row (structured decoding).
* ``race.c``: a seeded draw from a distribution by an exponential race with keyed noise, taking
  the logarithm for the few tokens that can win (every sampled step).
* ``gemm_q8.c``: GGUF blocks times inputs quantised to 8 bits, with AVX512-VNNI integer dot
  products, and its scalar reference: the ``fast`` numerics.
* ``forward.c``: every decoder layer of a few-row pass in one call, calling the kernels above
  through function pointers in the layer-by-layer order (:class:`DecoderLayers`).

``decodekit.h`` declares every exported function and the structures of ``forward.c``'s call; each C
file includes it, so the compiler checks the definitions, and the ctypes declarations here follow it.

In all, a row's result does not depend on the other rows of the pass or on the attention
layout, so a token verified in a tree gets bit for bit its one-token-step logits.

The C files are compiled with the system compiler (``cc``, OpenMP, AVX-512) into
``cache_root()/kernels`` the first time they are needed (a few seconds) and loaded with ctypes
once their digest checks out (:mod:`..cache`: a damaged library is rebuilt, never loaded).
Without a compiler, on a CPU without AVX-512, or with ``DECODEKIT_KERNELS=0``, the functions
here return None and callers keep using torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

from ..cache import cache_root, cached_file
from ..gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS

MAX_ROWS = 64  # passes of up to this many tokens use the kernels
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-lm"]
#: Instructions only some AVX-512 CPUs have, for the one library that uses them (it checks the CPU
#: before use, so the other libraries never contain them).
EXTRA_FLAGS = {"gemm_q8": ["-mavx512vnni"], "race": ["-mavx512dq"]}

MatmulKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AttentionKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", float], torch.Tensor]


def _supported() -> bool:
    """AVX-512 present (as torch sees it) and not switched off."""
    if os.environ.get("DECODEKIT_KERNELS", "1") == "0":
        return False
    try:
        return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")
    except AttributeError:
        return False


def _build(source: Path) -> Path | None:
    """The compiled ``source`` in the cache (built once per source version, and again whenever
    the cached library fails its check: a damaged one could crash ``dlopen``); None if that fails."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    flags = FLAGS + EXTRA_FLAGS.get(source.stem, [])
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()).hexdigest()[:16]

    def compile_to(path: Path) -> None:
        subprocess.run([compiler, *flags, str(source), "-o", str(path)], check=True, capture_output=True, timeout=120)

    try:
        return cached_file(cache_root() / "kernels" / f"{source.stem}-{digest}.so", compile_to)
    except (OSError, subprocess.SubprocessError):
        return None


@cache
def sources_digest() -> str:
    """A short digest of every kernel source: what a measurement of kernel speed (the speculative
    controller's cost table) is keyed by, so that new kernels are measured afresh."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.[ch]")):
        digest.update(source.name.encode() + source.read_bytes())
    return digest.hexdigest()[:10]


@cache
def _library(name: str) -> ctypes.CDLL | None:
    """The compiled ``name.c`` next to this file, or None where it cannot be built or loaded."""
    if not _supported():
        return None
    path = _build(Path(__file__).with_name(f"{name}.c"))
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        return None


def _address(fn: ctypes._CFuncPtr) -> int:
    """A compiled function's address, for kernels that call it from C (``forward.c``)."""
    return ctypes.cast(fn, ctypes.c_void_p).value


@cache
def few_rows_matmul(dtype: torch.dtype = torch.float32) -> MatmulKernel | None:
    """``matmul(weight [out, in], x [rows, in]) -> [rows, out]`` for ``dtype`` weights and inputs
    (float32, or bfloat16 on CPUs with AVX512-BF16), or None where unavailable. The product is
    summed in float32 and returned in ``dtype`` (rounded to nearest even, as torch rounds)."""
    lib = _library("gemm")
    if lib is None:
        return None
    for fn in (lib.decodekit_gemm_f32, lib.decodekit_gemm_bf16):
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
        fn.restype = None
    if dtype == torch.float32:
        fn = lib.decodekit_gemm_f32
    elif dtype == torch.bfloat16 and lib.decodekit_has_avx512bf16():
        fn = lib.decodekit_gemm_bf16
    else:
        return None

    def matmul(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        x = x.to(dtype).contiguous()
        out = torch.empty(rows, weight.shape[0], dtype=dtype)
        fn(weight.data_ptr(), x.data_ptr(), out.data_ptr(), rows, weight.shape[0], weight.shape[1], torch.get_num_threads())
        return out

    matmul.address = _address(fn)
    return matmul


EXACT_BLOCK_KINDS = tuple(BLOCK_BYTES)  # gemm.c reads every type gguf_blocks reads, each also interleaved


@cache
def block_matmul(kind: str, interleaved: bool = False) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None:
    """``matmul(blocks [out, in / block weights * block bytes] uint8, x [rows, in] float32, n_in) ->
    [rows, out]`` float32 for GGUF ``kind`` blocks (one of :data:`EXACT_BLOCK_KINDS`), bit-identical
    to :func:`few_rows_matmul` on the dequantised float32 weights; None where unavailable.
    ``interleaved``: ``blocks`` as :meth:`..gguf_blocks.BlockMatrix.interleaved` lays
    them out (faster for passes of a few rows)."""
    lib = _library("gemm")
    if lib is None or kind not in EXACT_BLOCK_KINDS:
        return None
    return _blocks_times_rows(getattr(lib, f"decodekit_gemm_{kind}{'x4' if interleaved else ''}"))


def _blocks_times_rows(fn, check: Callable[[torch.Tensor, torch.Tensor, int], None] | None = None):
    """``matmul(blocks, x, n_in) -> [rows, out]`` float32 around a C function of the block kernels'
    signature (blocks, x, out, rows, n_out, n_in, threads), with its address for ``forward.c``;
    ``check`` validates the operands first, where the C code relies on them."""
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
    fn.restype = None

    def matmul(blocks: torch.Tensor, x: torch.Tensor, n_in: int) -> torch.Tensor:
        if check is not None:
            check(blocks, x, n_in)
        rows = x.shape[0]
        x = x.to(torch.float32).contiguous()
        out = torch.empty(rows, blocks.shape[0], dtype=torch.float32)
        fn(blocks.data_ptr(), x.data_ptr(), out.data_ptr(), rows, blocks.shape[0], n_in, torch.get_num_threads())
        return out

    matmul.address = _address(fn)
    return matmul


@cache
def _integer_library() -> ctypes.CDLL | None:
    lib = _library("gemm_q8")
    if lib is None or not lib.decodekit_has_avx512vnni():  # built with VNNI allowed: only where it runs
        return None
    lib.decodekit_q8_pack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.decodekit_q8_reference.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
    lib.decodekit_q8_pack.restype = lib.decodekit_q8_reference.restype = None
    lib.decodekit_q8_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    lib.decodekit_q8_rows.restype = None
    lib.decodekit_q8_packed_bytes.argtypes = [ctypes.c_int] * 3
    lib.decodekit_q8_packed_bytes.restype = ctypes.c_int64
    lib.decodekit_q8_peak.argtypes = [ctypes.c_int64, ctypes.c_int]
    lib.decodekit_q8_peak.restype = ctypes.c_int64
    return lib


def integer_peak_loop() -> Callable[[int, int], int] | None:
    """``loop(iterations, threads)``: ``iterations`` x 12 x 64 byte multiply-adds per thread with
    VNNI, nothing else (``decodekit profile`` times it); None where unavailable."""
    lib = _integer_library()
    return None if lib is None else lib.decodekit_q8_peak


INTEGER_KINDS = {"q4_1": 0, "q8_0": 1, "q4_k": 2, "q6_k": 3, "q5_k": 4, "q5_0": 5}  # gemm_q8.c's kind numbers
INTEGER_GROUP = 16  # output rows packed side by side (gemm_q8.c's GROUP)


@cache
def integer_block_matmul(kind: str) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None:
    """The ``fast`` numerics (``gemm_q8.c``): ``matmul(packed, x [rows, in] float32, n_in) ->
    [rows, out]`` float32 for GGUF ``kind`` blocks (one of :data:`INTEGER_KINDS`) repacked by
    :func:`pack_integer_blocks`, with the inputs quantised to 8 bits per block of 32 and integer dot
    products; any number of rows, each computed on its own. None where unavailable (no compiler,
    or a CPU without AVX512-VNNI)."""
    lib = _integer_library()
    if lib is None or kind not in INTEGER_KINDS:
        return None
    return _blocks_times_rows(getattr(lib, f"decodekit_q8_{kind}"),
                              lambda packed, x, n_in: _check_integer_operands(kind, packed, x, n_in, packed=True))


def pack_integer_blocks(kind: str, blocks: torch.Tensor, n_in: int, *, into: torch.Tensor | None = None,
                        first_row: int = 0) -> torch.Tensor:
    """GGUF ``kind`` blocks ``[out, in / block weights * block bytes]`` (``out`` a multiple of 16) in
    the integer kernel's layout: ``[out, packed bytes / out]`` (see ``gemm_q8.c``).

    A matrix can be packed a slice at a time: with ``into`` (from :func:`empty_packed`) the blocks
    are its rows from ``first_row`` on (a multiple of 16: a group of rows is packed together)."""
    lib = _integer_library()
    if lib is None:
        raise RuntimeError("the integer kernel is unavailable on this machine")
    _check_integer_operands(kind, blocks, torch.zeros(1, n_in), n_in)
    packed = empty_packed(kind, blocks.shape[0], n_in) if into is None else into
    if (packed.dtype != torch.uint8 or not packed.is_contiguous() or packed.shape[1] != _packed_width(kind, n_in)
            or first_row % INTEGER_GROUP or first_row + blocks.shape[0] > packed.shape[0]):
        raise ValueError(f"integer packing: rows {first_row}..{first_row + blocks.shape[0]} do not fit "
                         f"{tuple(packed.shape)} {packed.dtype}")
    if blocks.shape[0]:
        lib.decodekit_q8_pack(INTEGER_KINDS[kind], blocks.data_ptr(), packed[first_row].data_ptr(), blocks.shape[0], n_in)
    return packed


def empty_packed(kind: str, rows: int, n_in: int) -> torch.Tensor:
    """Room for a ``[rows, n_in]`` matrix of ``kind`` blocks in the integer kernel's layout, to be
    filled by :func:`pack_integer_blocks` a slice at a time."""
    return torch.empty(rows, _packed_width(kind, n_in), dtype=torch.uint8)


def integer_block_rows(kind: str, packed: torch.Tensor, rows: torch.Tensor, n_in: int) -> torch.Tensor:
    """Rows ``rows`` of a matrix packed by :func:`pack_integer_blocks`, as float32 ``[len(rows), n_in]``:
    bit for bit the GGUF file's dequantised rows (an embedding table tied to its output head)."""
    lib = _integer_library()
    rows = rows.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(rows.numel(), n_in, dtype=torch.float32)
    lib.decodekit_q8_rows(INTEGER_KINDS[kind], packed.data_ptr(), rows.data_ptr(), rows.numel(), packed.shape[0], n_in,
                          out.data_ptr())
    return out


@cache
def _packed_width(kind: str, n_in: int) -> int:
    return _integer_library().decodekit_q8_packed_bytes(INTEGER_KINDS[kind], INTEGER_GROUP, n_in) // INTEGER_GROUP


def _check_integer_operands(kind: str, blocks: torch.Tensor, x: torch.Tensor, n_in: int, packed: bool = False) -> None:
    """What ``gemm_q8.c`` relies on: rows of ``n_in`` values, a multiple of the block's weights,
    against contiguous uint8 blocks (as the file has them, or ``packed``) of the right width, a
    multiple of 16 rows."""
    size, weights = BLOCK_BYTES[kind], BLOCK_WEIGHTS[kind]
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] != n_in or n_in % weights:
        raise ValueError(f"integer matmul: inputs [rows, {n_in}] with {n_in} a multiple of {weights}, got {tuple(x.shape)}")
    width = _packed_width(kind, n_in) if packed else n_in // weights * size
    if (blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != width or not blocks.is_contiguous()
            or blocks.shape[0] % INTEGER_GROUP):
        raise ValueError(f"integer matmul: {kind} blocks [16 n, {width}] contiguous uint8, got {tuple(blocks.shape)} {blocks.dtype}")


def integer_block_matmul_reference(kind: str, blocks: torch.Tensor, x: torch.Tensor, n_in: int) -> torch.Tensor | None:
    """The scalar C reference of :func:`integer_block_matmul`, on the blocks as the file has them
    (not packed): the same arithmetic in the same order, one value at a time (for tests); None
    where the library is unavailable."""
    lib = _integer_library()
    if lib is None:
        return None
    _check_integer_operands(kind, blocks, x, n_in)
    x = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
    lib.decodekit_q8_reference(INTEGER_KINDS[kind], blocks.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0],
                               blocks.shape[0], n_in)
    return out


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


def _run_attention(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                   scale: float, head_dim: int, row: int) -> torch.Tensor:
    """Call an ``attention.c`` kernel on ``k``/``v`` ``[H_kv, keys, row]`` (sliced to the keys in use,
    ``row`` cache elements a key) for ``q`` ``[n_q, H, head_dim]``; returns ``[n_q, H, head_dim]``."""
    n_q, n_heads = q.shape[:2]
    q = q.float().contiguous()
    out = torch.empty(n_q, n_heads, head_dim, dtype=torch.float32)
    mask = None if visible is None else visible.to(torch.bool).contiguous()
    fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), None if mask is None else mask.data_ptr(), out.data_ptr(),
       n_q, n_heads, k.shape[0], head_dim, k.stride(0) // row, k.shape[1], scale, torch.get_num_threads())
    return out


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
        rows = qkv.numel() // qkv.shape[-1]
        q = torch.empty(rows, n_heads, self.head_dim, dtype=torch.float32)
        positions = positions.to(torch.int64).contiguous()
        self._rope_store(qkv.float().contiguous().data_ptr(), freqs.data_ptr(), positions.data_ptr(), q.data_ptr(),
                         k_cache.data_ptr(), v_cache.data_ptr(), rows, n_heads, n_kv_heads, self.head_dim, cap, start)
        return q

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
        """As :func:`layout_independent_attention`'s, over int8 caches sliced to the keys in use."""
        if k.shape[2] != self.row or k.stride(1) != self.row or v.stride() != k.stride():
            raise ValueError("int8 attention needs [H_kv, keys, head_dim / 4 + 1] caches with contiguous rows")
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
        if int(view.qend.min()) < view.base or int(view.qend.max()) > store.tokens:
            raise ValueError("kivi attention: every row's quantised end must lie between the residual's base and the "
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
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = (x * inverse).round().clamp(-128, 127).to(torch.int8)
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1).view(torch.float32)


def dequantise_int8_rows(packed: torch.Tensor) -> torch.Tensor:
    """The float32 values of int8 cache rows (the inverse layout of :func:`quantise_int8_rows`)."""
    raw = packed.contiguous().view(torch.uint8)
    values, scale = raw[..., :-4].view(torch.int8).float(), raw[..., -4:].contiguous().view(torch.float32)
    return values * scale


def _c_function(library: str, symbol: str, argtypes: list) -> ctypes._CFuncPtr | None:
    """``symbol`` of the compiled ``library`` with its argument types (returning void), or None
    where the library cannot be built or loaded."""
    lib = _library(library)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = argtypes, None
    return fn


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
    lib = _library("race")
    if lib is None or not lib.decodekit_has_avx512dq():  # built with AVX512DQ allowed: only where it runs
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


class LayerOps:
    """``layer_ops.c`` for one dtype: a layer's element-wise steps on ``rows`` x ``dim`` tensors.

    Each returns a new tensor (``add_rms_norm`` also updates ``x`` in place) and computes every
    row on its own, so a token's values do not depend on the rest of the pass."""

    def __init__(self, lib: ctypes.CDLL, suffix: str):
        self._add_rms_norm = getattr(lib, f"decodekit_add_rms_norm_{suffix}")
        self._add_rms_norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2 + [ctypes.c_float]
        self._silu_mul = getattr(lib, f"decodekit_silu_mul_{suffix}")
        self._gelu_mul = getattr(lib, f"decodekit_gelu_mul_{suffix}")
        for fn in (self._silu_mul, self._gelu_mul):
            fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2
        self._rope_store = getattr(lib, f"decodekit_rope_store_{suffix}")
        self._rope_store.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6
        for fn in (self._add_rms_norm, self._silu_mul, self._gelu_mul, self._rope_store):
            fn.restype = None
        self.addresses = {name: _address(getattr(self, "_" + name))
                          for name in ("add_rms_norm", "silu_mul", "gelu_mul", "rope_store")}

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x += delta`` in place (when given), then ``rms_norm(x) * weight``. x contiguous."""
        h = torch.empty_like(x)
        if delta is not None:
            delta = delta.contiguous()
        dim = x.shape[-1]
        self._add_rms_norm(
            x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), h.data_ptr(),
            x.numel() // dim, dim, eps,
        )
        return h

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` where ``gate_up = [gate | up]`` on the last axis."""
        return self._gate_mul(self._silu_mul, gate_up)

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` where ``gate_up = [gate | up]`` on the last axis."""
        return self._gate_mul(self._gelu_mul, gate_up)

    @staticmethod
    def _gate_mul(fn, gate_up: torch.Tensor) -> torch.Tensor:
        inter = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], inter)
        fn(gate_up.contiguous().data_ptr(), out.data_ptr(), out.numel() // inter, inter)
        return out

    def rope_store(
        self, qkv: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, n_heads: int,
    ) -> torch.Tensor:
        """Rotate q and k of ``qkv [rows, (H + 2 H_kv) D]`` (adjacent-pair layout) by ``freqs``
        (float ``[max_position, D]`` of (cos, sin) pairs) at ``positions``; write k, v to cache
        slots ``start + row`` of ``k_cache``/``v_cache`` (``[H_kv, cap, D]``, one layer and
        sequence); return q as float32 ``[rows, H, D]`` (rounded to the cache dtype first, as
        the torch path does). Needs D a multiple of 16."""
        n_kv_heads, cap, head_dim = k_cache.shape
        if head_dim % 16 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("rope_store needs head_dim a multiple of 16 and contiguous caches")
        rows = qkv.numel() // qkv.shape[-1]
        q = torch.empty(rows, n_heads, head_dim, dtype=torch.float32)
        positions = positions.to(torch.int64).contiguous()
        self._rope_store(
            qkv.contiguous().data_ptr(), freqs.data_ptr(), positions.data_ptr(), q.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), rows, n_heads, n_kv_heads, head_dim, cap, start,
        )
        return q


@cache
def layer_ops(dtype: torch.dtype, hidden_size: int, intermediate_size: int) -> LayerOps | None:
    """:class:`LayerOps` for ``dtype`` (float32 or bfloat16) where both sizes are multiples of 16,
    else None."""
    if hidden_size % 16 or intermediate_size % 16:
        return None
    if dtype not in (torch.float32, torch.bfloat16):
        return None
    lib = _library("layer_ops")
    return None if lib is None else LayerOps(lib, "f32" if dtype == torch.float32 else "bf16")


# decodekit.h's structures, field for field (checked against the C sizes when forward.c loads).
class _Projection(ctypes.Structure):
    _fields_ = [("fn", ctypes.c_void_p), ("weights", ctypes.c_void_p), ("n_out", ctypes.c_int64), ("n_in", ctypes.c_int64)]


LAYER_NORMS = ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")  # a Gemma layer's, in _Layer's order


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p)] + [
        (name, _Projection) for name in ("qkv", "o", "gate_up", "down", "k", "v")
    ] + [(name, ctypes.c_void_p) for name in LAYER_NORMS + ("freqs",)] + [("local", ctypes.c_int64)]


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("add_rms_norm", "gate_mul", "rope_store", "attention")] + [
        (name, ctypes.c_int64) for name in ("hidden", "inter", "n_heads", "n_kv_heads", "head_dim", "element_size")
    ] + [("eps", ctypes.c_double), ("scale", ctypes.c_double), ("window", ctypes.c_int64)]


class _KiviCodes(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("attention", "k_codes", "v_codes", "k_params", "v_params")] + [
        (name, ctypes.c_int64)
        for name in ("codes_stride", "k_params_stride", "v_params_stride", "group", "bits", "cap_q", "base")
    ] + [("qend", ctypes.c_void_p)]


class _Sequence(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "start", "cap", "layer_stride")] + [
        (name, ctypes.c_void_p) for name in ("positions", "visible", "k_cache", "v_cache", "kivi")
    ]


MIRRORED_STRUCTS = (_Projection, _Layer, _Model, _KiviCodes, _Sequence)  # decodekit_struct_sizes' order


def _check_struct_sizes(lib: ctypes.CDLL) -> None:
    """Refuse a forward.c whose structures the ctypes mirrors above no longer match (a field added
    on one side only would have C read the wrong memory)."""
    sizes = (ctypes.c_int64 * len(MIRRORED_STRUCTS))()
    lib.decodekit_struct_sizes(sizes)
    for struct, size in zip(MIRRORED_STRUCTS, sizes):
        if ctypes.sizeof(struct) != size:
            raise RuntimeError(f"decodekit bug: {struct.__name__[1:]} is {size} bytes in decodekit.h, "
                               f"{ctypes.sizeof(struct)} in its ctypes mirror")


@dataclass
class SequencePart:
    """One sequence's rows in a batched pass (:meth:`DecoderLayers.run_batch`): ``rows`` new tokens
    at ``positions`` (int64), written to cache slots ``start..`` of its own ``k_cache``/``v_cache``
    (``[layers, H_kv, cap, D]``, contiguous per layer), seeing ``visible`` (``[rows, start + rows]``
    bool, or None for every cached key). ``kivi``: under the int4 and int2 caches, their codes
    (:class:`..kivi.KiviView`); the cache is then their float residual."""

    rows: int
    start: int
    positions: torch.Tensor
    visible: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kivi: object = None


def _kivi_codes(view, head_dim: int, keep: list) -> _KiviCodes:
    """forward.c's view of a sequence's int4 codes (``view``: a :class:`..kivi.KiviView`)."""
    store, qend = view.store, view.qend.to(torch.int32).contiguous()
    attention = kivi_attention(head_dim)
    if attention is None:
        raise ValueError("decoder layers kernel: the int4 cache's attention kernel is unavailable")
    keep += [store.k_codes, store.v_codes, store.k_params, store.v_params, qend]
    return _KiviCodes(attention.address, store.k_codes.data_ptr(), store.v_codes.data_ptr(), store.k_params.data_ptr(),
                      store.v_params.data_ptr(), store.k_codes.stride(0), store.k_params.stride(0),
                      store.v_params.stride(0), store.group, store.bits, store.capacity, view.base, qend.data_ptr())


# A projection as the kernels see it: (the few-row matmul's C function address, the weights it
# reads, out features, in features).
KernelProjection = tuple[int, torch.Tensor, int, int]


class DecoderLayers:
    """``forward.c``: every decoder layer of a few-row pass in one call, with the same kernels in
    the same order as the layer-by-layer path (bit-identical results, a few microseconds of
    Python dispatch per kernel saved). Holds references to every tensor it points at."""

    def __init__(self, fn, model: _Model, layers: list[_Layer], keep: list[torch.Tensor]):
        self._fn, self._model, self._keep = fn, model, keep
        self._layers = (_Layer * len(layers))(*layers)
        self.num_layers = len(layers)

    def run(
        self, x: torch.Tensor, pending: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor,
        visible: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
        skip: frozenset[int] = frozenset(), kivi=None,
    ) -> bool:
        """Run the layers not in ``skip`` on ``x [rows, hidden]`` (the residual stream, updated in
        place; all tensors contiguous, in the model dtype); ``pending [rows, hidden]`` receives
        the last layer's MLP output (still to be added to x). ``k_cache``/``v_cache``: ``[layers,
        H_kv, cap, D]`` of one sequence (contiguous per layer); the new keys go to slots
        ``start..``. ``visible``: ``[rows, start + rows]`` bool, or None for all keys. Runs as
        many layers as the cache has (a truncated copy of a model shares its layers). Returns
        whether any layer ran (if none, ``pending`` holds nothing). ``kivi``: the int4 cache's
        codes (the caches are then their residual)."""
        part = SequencePart(x.shape[0], start, positions, visible, k_cache, v_cache, kivi)
        return self.run_batch(x, pending, freqs, [part], skip)

    def run_batch(self, x: torch.Tensor, pending: torch.Tensor, freqs: torch.Tensor, parts: list[SequencePart],
                  skip: frozenset[int] = frozenset()) -> bool:
        """:meth:`run` for the rows of several sequences stacked in ``x`` (``parts`` in row order),
        each with its own cache: a sequence's results are bit for bit those it gets alone. The
        caches must all have the same number of layers (at most this model's)."""
        if sum(p.rows for p in parts) != x.shape[0]:
            raise ValueError("decoder layers kernel: the parts' rows do not add up to the batch's")
        num_layers = parts[0].k_cache.shape[0]
        keep, structs = [], []
        for p in parts:
            if p.k_cache.shape[0] != num_layers or num_layers > self.num_layers:
                raise ValueError(f"decoder layers kernel: a cache of {p.k_cache.shape[0]} layers for {self.num_layers} layers")
            positions = p.positions.to(torch.int64).contiguous()
            mask = None if p.visible is None else p.visible.to(torch.bool).contiguous()
            keep += [positions, mask]
            kivi = None
            if p.kivi is not None:
                if p.k_cache.dtype != torch.float32:
                    raise ValueError("decoder layers kernel: the int4 cache's residual is float32")
                kivi = _kivi_codes(p.kivi, p.k_cache.shape[3], keep)
                keep.append(kivi)
            structs.append(_Sequence(p.rows, p.start, p.k_cache.shape[2], p.k_cache.stride(0), positions.data_ptr(),
                                     None if mask is None else mask.data_ptr(), p.k_cache.data_ptr(), p.v_cache.data_ptr(),
                                     None if kivi is None else ctypes.addressof(kivi)))
        flags = None
        if skip:
            flags = torch.zeros(num_layers, dtype=torch.uint8)
            flags[[i for i in skip if i < num_layers]] = 1
        ran = self._fn(
            ctypes.byref(self._model), self._layers, num_layers, None if flags is None else flags.data_ptr(),
            x.data_ptr(), pending.data_ptr(),
            freqs.data_ptr(), (_Sequence * len(structs))(*structs), len(structs), torch.get_num_threads(),
        )
        if ran < 0:
            raise MemoryError("decoder layers kernel: could not allocate its scratch buffers")
        return ran > 0


def decoder_layers(
    dtype: torch.dtype, ops: LayerOps, attention: AttentionKernel, *, hidden: int, inter: int, n_heads: int,
    n_kv_heads: int, head_dim: int, eps: float, layers: list[dict], int8_cache: Int8CacheKernels | None = None,
    scale: float | None = None, gelu: bool = False, window: int = 0,
) -> DecoderLayers | None:
    """:class:`DecoderLayers` over ``layers`` (each a dict of ``attn_norm``, ``mlp_norm`` tensors
    and ``qkv``, ``o``, ``gate_up``, ``down`` :data:`KernelProjection` s), or None where the
    kernel is unavailable. ``int8_cache``: the cache is int8 (its rope_store and attention run).

    A Gemma 3 layer's dict may also hold ``k``, ``v`` (projections of their own; ``qkv`` is then q
    alone), the tensors of :data:`LAYER_NORMS`, ``freqs`` (its rotary table) and ``local`` (a
    sliding-window layer: it sees the last ``window`` positions). ``scale``: the attention scale
    (default ``head_dim ** -0.5``); ``gelu``: GeLU gating instead of SiLU."""
    lib = _library("forward")
    if lib is None:
        return None
    if window and int8_cache is not None:  # forward.c's window offset counts rows of head_dim model-dtype values
        raise ValueError("decoder layers kernel: sliding windows over the int8 cache are not supported")
    _check_struct_sizes(lib)
    fn = lib.decodekit_decoder_layers_batch
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 2
    fn.restype = ctypes.c_int
    model = _Model(
        ops.addresses["add_rms_norm"], ops.addresses["gelu_mul" if gelu else "silu_mul"],
        int8_cache.rope_store_address if int8_cache else ops.addresses["rope_store"],
        int8_cache.attention_address if int8_cache else attention.address,
        hidden, inter, n_heads, n_kv_heads, head_dim, torch.tensor([], dtype=dtype).element_size(), eps,
        head_dim**-0.5 if scale is None else scale, window,
    )
    keep, structs = [], []
    for layer in layers:
        projections = {}
        for name in ("qkv", "o", "gate_up", "down", "k", "v"):
            if name not in layer:
                continue
            address, weights, n_out, n_in = layer[name]
            keep.append(weights)
            projections[name] = _Projection(address, weights.data_ptr(), n_out, n_in)
        tensors = {name: layer[name] for name in LAYER_NORMS + ("freqs",) if layer.get(name) is not None}
        keep += [layer["attn_norm"], layer["mlp_norm"], *tensors.values()]
        structs.append(_Layer(layer["attn_norm"].data_ptr(), layer["mlp_norm"].data_ptr(), **projections,
                              **{name: t.data_ptr() for name, t in tensors.items()}, local=int(layer.get("local", 0))))
    return DecoderLayers(fn, model, structs, keep)
