"""Building and loading the C kernels: each ``*.c`` file here is compiled with the system compiler
(``cc``, OpenMP) into ``cache_root()/kernels`` the first time it is needed (a few seconds) and
loaded with ctypes once its digest checks out (:mod:`..cache`: a damaged library is rebuilt, never
loaded).

The instruction set is chosen at run time, for the CPU the process runs on (:func:`level`):
AVX-512 where the CPU has it; AVX2 + FMA + F16C otherwise, where the same sources are compiled
against ``avx512_on_avx2.h`` (each AVX-512 intrinsic computed lane for lane on two 8-lane halves:
the same bits, at AVX2's width). The integer kernel (``gemm_q8.c``) and the sampler race
(``race.c``) have AVX2 loops of their own (AVX2 has no VNNI, and half the lanes for 64-bit
integers). Without a
compiler, on an older CPU, or with ``DECODEKIT_KERNELS=0``, :func:`_library` returns None and
callers keep using torch; ``DECODEKIT_KERNELS=avx2`` builds the AVX2 level on an AVX-512 CPU too
(to compare the two)."""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from ..cache import cache_root, cached_file

MAX_ROWS = 64  # passes of up to this many tokens use the kernels
FLAGS = ["-O3", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-lm"]
#: The AVX2 level's flags: the same sources, their AVX-512 intrinsics from avx512_on_avx2.h.
AVX2_FLAGS = ["-O3", "-ffp-contract=off", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-lm"]
#: Instructions only some AVX-512 CPUs have, for the one library that uses them (it checks the CPU
#: before use, so the other libraries never contain them).
EXTRA_FLAGS = {"gemm_q8": ["-mavx512vnni"], "race": ["-mavx512dq"]}


def level() -> str | None:
    """The instruction set the kernels are built for here: ``"avx512"`` on a CPU torch reports as
    AVX512 or AMX, ``"avx2"`` on one it reports as AVX2 (which implies FMA; every such CPU has
    F16C), None where they are switched off (``DECODEKIT_KERNELS=0``) or the CPU is older.
    ``DECODEKIT_KERNELS=avx2`` asks for the AVX2 level on an AVX-512 CPU."""
    asked = os.environ.get("DECODEKIT_KERNELS", "1")
    if asked == "0":
        return None
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        return None
    if capability in ("AVX512", "AMX"):
        return "avx2" if asked == "avx2" else "avx512"
    return "avx2" if capability == "AVX2" else None


def _supported() -> bool:
    """Kernels at some level on this CPU, and not switched off."""
    return level() is not None


def compiler_flags(name: str, at: str) -> list[str]:
    """The flags kernel `name` is compiled with at level `at` (``"avx512"`` or ``"avx2"``)."""
    return FLAGS + EXTRA_FLAGS.get(name, []) if at == "avx512" else AVX2_FLAGS


def _build(source: Path, at: str | None = None) -> Path | None:
    """The compiled ``source`` for level ``at`` (by default this CPU's) in the cache (built once
    per source version and level, and again whenever the cached library fails its check: a
    damaged one could crash ``dlopen``); None if that fails."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    flags = compiler_flags(source.stem, at or level() or "avx512")
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()).hexdigest()[:16]

    def compile_to(path: Path) -> None:
        subprocess.run([compiler, *flags, str(source), "-o", str(path)], check=True, capture_output=True, timeout=120)

    cached = cache_root() / "kernels" / f"{source.stem}-{digest}.so"
    try:
        return cached_file(cached, compile_to)
    except subprocess.SubprocessError:
        return None
    except OSError as err:  # a cache this process cannot write (read-only, its lock in the way)
        return _built_aside(cached, compile_to, err)


def _built_aside(cached: Path, compile_to: Callable[[Path], None], err: OSError) -> Path | None:
    """``cached``, which the cache cannot take (missing or damaged there), compiled for this process
    alone in a folder of its own, removed at exit: said in one line, not run on the slow path unsaid."""
    folder = Path(_private_folder())
    try:
        compile_to(folder / cached.name)
    except (OSError, subprocess.SubprocessError):
        return None
    print(f"decodekit: the cache cannot hold {cached} ({err.strerror or err}); compiled for this run in {folder}",
          file=sys.stderr)
    return folder / cached.name


@cache
def _private_folder() -> str:
    folder = tempfile.mkdtemp(prefix="decodekit-kernels-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # (a loaded library outlives its file's name)
    return folder


def sources_digest() -> str:
    """A short digest of every kernel source and of the level they are built for: what a
    measurement of kernel speed (the speculative controller's cost table) is keyed by, so that new
    kernels, or the same at another level, are measured afresh."""
    return _sources_digest(level() or "torch")


@cache
def _sources_digest(at: str) -> str:
    digest = hashlib.sha256(at.encode())
    for source in sorted(Path(__file__).parent.glob("*.[ch]")):
        digest.update(source.name.encode() + source.read_bytes())
    return digest.hexdigest()[:10]


def _library(name: str) -> ctypes.CDLL | None:
    """The compiled ``name.c`` next to this file at this CPU's level, or None where it cannot be
    built or loaded."""
    return _library_at(name, level())


@cache
def _library_at(name: str, at: str | None) -> ctypes.CDLL | None:
    if at is None:
        return None
    path = _build(Path(__file__).with_name(f"{name}.c"), at)
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        return None


def _library_that_runs(name: str, runs_here: str) -> ctypes.CDLL | None:
    """``name``'s build at this CPU's level if its function ``runs_here`` says the CPU has what it
    was built with; on an AVX-512 CPU that lacks an extension the AVX-512 build uses (VNNI,
    AVX512DQ), or where that build failed, its AVX2 build; None where neither runs."""
    lib = _library(name)
    if level() == "avx512" and (lib is None or not getattr(lib, runs_here)()):
        lib = _library_at(name, "avx2")
    return lib if lib is not None and getattr(lib, runs_here)() else None


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
