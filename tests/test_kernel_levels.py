"""The kernels' two instruction-set levels compute the same bits: the AVX2 build (the same sources,
their AVX-512 intrinsics from ``avx512_on_avx2.h``, lane for lane) against the AVX-512 build. Only a
CPU with AVX-512 runs both; elsewhere these tests skip, and the rest of the suite checks the AVX2
build against torch and against itself (rows independent, verification as one-token steps)."""

import ctypes
import json
import os
import subprocess
import sys

import pytest
import torch

from decodekit.models import kernels
from decodekit.models.gguf_blocks import BlockMatrix

both_levels = pytest.mark.skipif(kernels.build.level() != "avx512", reason="needs an AVX-512 CPU, which runs both levels")


def product(level: str, kind: str, weights: torch.Tensor, x: torch.Tensor, n_out: int, n_in: int,
            library: str = "gemm") -> torch.Tensor:
    """weights (float32 rows, GGUF blocks of ``kind``, or for ``library="gemm_q8"`` those blocks
    packed) times the rows of x, by ``library``'s build at ``level``."""
    prefix = "decodekit_q8_" if library == "gemm_q8" else "decodekit_gemm_"
    fn = getattr(kernels.build._library_at(library, level), prefix + kind)
    fn.argtypes, fn.restype = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4, None
    out = torch.empty(x.shape[0], n_out)
    fn(weights.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0], n_out, n_in, 2)
    return out


@both_levels
@pytest.mark.parametrize("kind", ["f32", "q4_1", "q8_0", "q5_0", "q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["rows", "x4"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_every_float32_weight_format_gives_the_same_bits_at_both_levels(kind, interleaved, rows):
    """Float32 weights and every GGUF block type, rows as stored and interleaved in fours (where the
    levels' block shapes differ most), at pass sizes on both sides of their cut-offs."""
    if kind == "f32" and interleaved:
        pytest.skip("float32 rows are never interleaved")
    gen = torch.Generator().manual_seed(rows)
    n_out, n_in = (36 if interleaved else 37), 512  # (37: a ragged last block of four rows)
    if kind == "f32":
        weights = torch.randn(n_out, n_in, generator=gen)
    elif kind in ("q4_1", "q8_0"):
        blocks = BlockMatrix.quantize(torch.randn(n_out, n_in, generator=gen), kind)
    else:
        blocks = BlockMatrix.random(n_out, n_in, kind, gen)
    if kind != "f32":
        weights = blocks.interleaved() if interleaved else blocks.data
    name = kind + ("x4" if interleaved else "")
    x = torch.randn(rows, n_in, generator=gen)
    wide, narrow = (product(level, name, weights, x, n_out, n_in) for level in ("avx512", "avx2"))
    assert torch.equal(wide.view(torch.int32), narrow.view(torch.int32))  # bit for bit


def vnni_here() -> bool:
    lib = kernels.build._library_at("gemm_q8", "avx512") if kernels.build.level() == "avx512" else None
    return lib is not None and bool(lib.decodekit_q8_runs_here())


both_integer_levels = pytest.mark.skipif(not vnni_here(), reason="needs an AVX512-VNNI CPU, which runs both levels")


@both_integer_levels
@pytest.mark.parametrize("kind", list(kernels.INTEGER_KINDS))
@pytest.mark.parametrize("rows", [1, 5, 9, 40])
def test_the_integer_kernel_gives_the_same_bits_at_both_levels(kind, rows):
    """The `fast` numerics: VNNI's vpdpbusd on 16 rows a vector against AVX2's vpmaddubsw on 8, at
    pass sizes on both sides of each level's tiles (and the AVX-512 level's pairs of groups)."""
    gen = torch.Generator().manual_seed(rows)
    n_out, n_in = 48, 512
    if kind in ("q4_1", "q8_0"):
        blocks = BlockMatrix.quantize(torch.randn(n_out, n_in, generator=gen), kind)
    else:
        blocks = BlockMatrix.random(n_out, n_in, kind, gen)
    packed = kernels.pack_integer_blocks(kind, blocks.data, n_in)
    x = torch.randn(rows, n_in, generator=gen) * 3
    wide, narrow = (product(level, kind, packed, x, n_out, n_in, library="gemm_q8") for level in ("avx512", "avx2"))
    assert torch.equal(wide.view(torch.int32), narrow.view(torch.int32))


LOGITS = """
import json, sys, torch
from decodekit.models import load_model
model = load_model(numerics=sys.argv[1])
backend = model.backend
ids = model.tokenizer.encode("The kernels of both levels read this prompt, a chunk at a time, then decode.")
rows = [backend.prefill(ids)[-1]]
for token in (42, 7, 1234, 99):
    rows.append(backend.step(torch.tensor([token]))[-1])
bits = torch.stack(rows).float().contiguous().view(torch.int32)
print(json.dumps(bits.flatten().tolist()[::97] + [int(bits.sum())]))
"""


@both_levels
@pytest.mark.parametrize("numerics", ["exact", pytest.param("fast", marks=both_integer_levels)])
def test_the_embedded_model_gives_the_same_logits_at_both_levels(numerics):
    """A prompt's read (multi-row passes: projections, attention, the layer ops, forward.c's layer
    loop) and one-token steps, in a process of each level, in each numerics."""
    results = []
    for level in ("1", "avx2"):
        ran = subprocess.run([sys.executable, "-c", LOGITS, numerics], env={**os.environ, "DECODEKIT_KERNELS": level},
                             capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, ran.stderr[-2000:]
        results.append(json.loads(ran.stdout.strip().splitlines()[-1]))
    assert results[0] == results[1]
