"""Building and loading the C kernels: each ``*.c`` file here is compiled with the system compiler
(``cc``, OpenMP, AVX-512) into ``cache_root()/kernels`` the first time it is needed (a few
seconds) and loaded with ctypes once its digest checks out (:mod:`..cache`: a damaged library is
rebuilt, never loaded). Without a compiler, on a CPU without AVX-512, or with
``DECODEKIT_KERNELS=0``, :func:`_library` returns None and callers keep using torch."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch

from ..cache import cache_root, cached_file

MAX_ROWS = 64  # passes of up to this many tokens use the kernels
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-lm"]
#: Instructions only some AVX-512 CPUs have, for the one library that uses them (it checks the CPU
#: before use, so the other libraries never contain them).
EXTRA_FLAGS = {"gemm_q8": ["-mavx512vnni"], "race": ["-mavx512dq"]}


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


def _c_function(library: str, symbol: str, argtypes: list) -> ctypes._CFuncPtr | None:
    """``symbol`` of the compiled ``library`` with its argument types (returning void), or None
    where the library cannot be built or loaded."""
    lib = _library(library)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = argtypes, None
    return fn
