"""Compiled kernels for what torch does slowly here, built on first use and cached.

One kernel so far: the product of a float32 or bfloat16 weight matrix with a few rows
(``gemm.c``), what a
decode step (one row) or a small verification pass (a few) spends most of its time on. Measured
on this project's AMD EPYC machine with cold weights, against oneDNN (itself well ahead of MKL
here): the 3072x576 gate/up projection 364 vs 566 us for 2 rows, 678 vs 821 us for 16; the
49152x576 lm head 6.1 vs 8.3 ms for 2 rows, 10.7 vs 12.4 ms for 16. A row's result does not
depend on how many rows are computed with it.

The C file is compiled with the system compiler (``cc``, OpenMP, AVX-512) into
``cache_root()/kernels`` the first time it is needed (a few seconds) and loaded with ctypes.
Without a compiler, on a CPU without AVX-512, or with ``DECODEKIT_KERNELS=0``, :func:`few_rows_matmul`
returns None and callers keep using torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("gemm.c")
MAX_ROWS = 16  # above this, oneDNN's blocked GEMM wins
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp", "-shared", "-fPIC"]

MatmulKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _supported() -> bool:
    if os.environ.get("DECODEKIT_KERNELS", "1") == "0":
        return False
    try:
        return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")
    except AttributeError:
        return False


def _build(source: Path) -> Path | None:
    """Compile ``source`` into the cache (once per source version); None if that fails."""
    from ..loading import cache_root

    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    digest = hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *FLAGS, str(source), "-o", str(built)], check=True, capture_output=True, timeout=120)
            os.replace(built, target)  # atomic: concurrent builders all end with a whole file
    except (OSError, subprocess.SubprocessError):
        return None
    return target


@cache
def _library() -> ctypes.CDLL | None:
    if not _supported():
        return None
    path = _build(SOURCE)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    for fn in (lib.decodekit_gemm_f32, lib.decodekit_gemm_bf16):
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
        fn.restype = None
    return lib


def few_rows_matmul(dtype: torch.dtype = torch.float32) -> MatmulKernel | None:
    """``matmul(weight [out, in], x [rows, in]) -> [rows, out]`` for ``dtype`` weights and inputs
    (float32, or bfloat16 on CPUs with AVX512-BF16), or None where unavailable. The product is
    summed in float32 and returned in ``dtype``."""
    lib = _library()
    if lib is None:
        return None
    if dtype == torch.float32:
        fn = lib.decodekit_gemm_f32
    elif dtype == torch.bfloat16 and lib.decodekit_has_avx512bf16():
        fn = lib.decodekit_gemm_bf16
    else:
        return None

    def matmul(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        x = x.to(dtype).contiguous()
        out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
        fn(weight.data_ptr(), x.data_ptr(), out.data_ptr(), rows, weight.shape[0], weight.shape[1], torch.get_num_threads())
        return out if dtype == torch.float32 else out.to(dtype)

    return matmul
