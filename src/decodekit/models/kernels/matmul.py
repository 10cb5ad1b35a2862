"""``gemm.c`` and ``gemm_q8.c``: a weight matrix times a few rows. float32 or bfloat16 weights, or
GGUF blocks rebuilt in float32 in registers (the ``exact`` numerics); or GGUF blocks repacked once
and multiplied by inputs quantised to 8 bits with integer dot products (the ``fast`` numerics:
AVX512-VNNI, or AVX2's byte multiply-adds, the same bits), with its scalar reference."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

import torch

from ..gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS
from .build import _address, _library, _library_that_runs

MatmulKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@cache
def few_rows_matmul(dtype: torch.dtype = torch.float32) -> MatmulKernel | None:
    """``matmul(weight [out, in], x [rows, in]) -> [rows, out]`` for ``dtype`` weights and inputs
    (float32, or bfloat16 on CPUs with AVX512-BF16), or None where unavailable. The product is
    summed in float32 and returned in ``dtype`` (rounded to nearest even, as torch rounds)."""
    lib = _library("gemm")
    if lib is None:
        return None
    if dtype == torch.float32:
        fn = lib.decodekit_gemm_f32
    elif dtype == torch.bfloat16 and lib.decodekit_has_avx512bf16():  # (an AVX2 build has no bfloat16 kernel)
        fn = lib.decodekit_gemm_bf16
    else:
        return None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
    fn.restype = None

    def matmul(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # what the C code relies on (it reads weight.shape[1] values a row of x, past its end otherwise)
        if (x.dim() != 2 or x.shape[1] != weight.shape[1] or weight.dim() != 2 or weight.dtype != dtype
                or not weight.is_contiguous()):
            raise ValueError(f"matmul: inputs [rows, {weight.shape[-1]}] against contiguous {dtype} weights [out, in], "
                             f"got {tuple(x.shape)} against {tuple(weight.shape)} {weight.dtype}")
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
    return _blocks_times_rows(getattr(lib, f"decodekit_gemm_{kind}{'x4' if interleaved else ''}"),
                              lambda blocks, x, n_in: _check_block_operands(kind, blocks, x, n_in))


def _check_block_operands(kind: str, blocks: torch.Tensor, x: torch.Tensor, n_in: int, width: int | None = None) -> None:
    """What the block kernels rely on: rows of ``n_in`` values, a multiple of the block's weights,
    against contiguous uint8 rows of blocks ``width`` bytes wide (the file's width by default)."""
    size, weights = BLOCK_BYTES[kind], BLOCK_WEIGHTS[kind]
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] != n_in or n_in % weights:
        raise ValueError(f"{kind} matmul: inputs [rows, {n_in}] with {n_in} a multiple of {weights}, got {tuple(x.shape)}")
    width = n_in // weights * size if width is None else width
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != width or not blocks.is_contiguous():
        raise ValueError(f"{kind} matmul: blocks [out, {width}] contiguous uint8, got {tuple(blocks.shape)} {blocks.dtype}")


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
    lib = _library_that_runs("gemm_q8", "decodekit_q8_runs_here")  # (an AVX-512 CPU without VNNI: AVX2's)
    if lib is None:
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
    the kernel's integer instructions (VNNI, or AVX2's), nothing else (``decodekit profile`` times
    it); None where unavailable."""
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
    or a CPU without AVX2)."""
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
    _check_block_operands(kind, blocks, x, n_in, _packed_width(kind, n_in) if packed else None)
    if blocks.shape[0] % INTEGER_GROUP:
        raise ValueError(f"integer matmul: {kind} blocks in groups of {INTEGER_GROUP} rows, got {blocks.shape[0]}")


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
