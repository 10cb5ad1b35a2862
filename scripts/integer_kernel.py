"""The integer kernel (``gemm_q8.c``) against the float32 block kernel, on the embedded model's
own matrices: milliseconds per call (mean of 20 after one untimed) for 1, 8 and 32 input rows,
and the relative error against float32.

    .venv/bin/python scripts/integer_kernel.py
"""

from __future__ import annotations

import time

import torch

from decodekit.models import load_model
from decodekit.models.gguf_blocks import BlockMatrix, cached_block_matrices
from decodekit.models.kernels import block_matmul, integer_block_matmul, pack_integer_blocks
from decodekit.models.loading import model_gguf, resolve_model_folder


def ms_per_call(fn, calls: int = 20) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> None:
    model = load_model()
    layers = model.backend.info.num_layers
    blocks = cached_block_matrices(model_gguf(None), resolve_model_folder(None), layers)  # the file's own blocks
    gate_up = BlockMatrix.stack([blocks["model.layers.0.mlp.gate_proj.weight"], blocks["model.layers.0.mlp.up_proj.weight"]])
    named = {"lm head": blocks["model.embed_tokens.weight"], "gate/up (layer 0)": gate_up}
    print("| matrix | rows | float32 blocks ms | integer ms | relative error |")
    print("|---|---:|---:|---:|---:|")
    for name, blocks in named.items():
        exact, fast = block_matmul(blocks.kind), integer_block_matmul(blocks.kind)
        packed = pack_integer_blocks(blocks.kind, blocks.data, blocks.n_in)
        for rows in (1, 8, 32, 64):
            x = torch.randn(rows, blocks.n_in, generator=torch.Generator().manual_seed(rows))
            reference = exact(blocks.data, x, blocks.n_in)
            error = ((fast(packed, x, blocks.n_in) - reference).norm() / reference.norm()).item()
            print(f"| {name} {tuple(blocks.shape)} {blocks.kind} | {rows} "
                  f"| {ms_per_call(lambda: exact(blocks.data, x, blocks.n_in)):.3f} "
                  f"| {ms_per_call(lambda: fast(packed, x, blocks.n_in)):.3f} | {error:.4f} |")


if __name__ == "__main__":
    main()
