"""The float32 block kernel (``gemm.c``, the ``exact`` numerics) alone on every projection of the
embedded model and its head, as a pass calls them (rows interleaved in fours, one call a matrix,
straight through ctypes, with no tensor made a call): the fastest of many passes of each size.
The integer kernel's counterpart is ``scripts/integer_pass.sh``; alternate two checkouts with
``PYTHONPATH=<checkout>/src`` to compare them.

    .venv/bin/python scripts/block_pass.py --rows 1,2 --passes 150 [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time

import torch

from decodekit.models import load_model
from decodekit.models.gguf_blocks import BlockMatrix, cached_block_matrices
from decodekit.models.kernels import block_matmul
from decodekit.models.loading import model_gguf, resolve_model_folder

PROJECTIONS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
               ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def matrices() -> tuple[list[BlockMatrix], BlockMatrix]:
    """Each layer's projections as the backend stacks them, and the head (the tied embedding)."""
    layers = load_model().backend.info.num_layers
    blocks = cached_block_matrices(model_gguf(None), resolve_model_folder(None), layers)
    stacked = []
    for layer in range(layers):
        for names in PROJECTIONS:
            parts = [blocks[f"model.layers.{layer}.{name}.weight"] for name in names]
            stacked.append(BlockMatrix.stack(parts) if len(parts) > 1 else parts[0])
    return stacked, blocks["model.embed_tokens.weight"]


KERNEL = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 3, *[ctypes.c_int] * 4)  # blocks, x, out, rows, n_out, n_in, threads


def bound_call(matrix: BlockMatrix, rows: int, threads: int, keep: list):
    """A call of the interleaved kernel on ``matrix`` with inputs and outputs made once."""
    matmul = block_matmul(matrix.kind, interleaved=True)
    if matmul is None:
        sys.exit(f"block_pass: no block kernel for {matrix.kind} on this machine")
    fn = KERNEL(matmul.address)
    data, x = matrix.interleaved(), torch.randn(rows, matrix.n_in)
    out = torch.empty(rows, data.shape[0])
    keep.extend((data, x, out))
    args = (data.data_ptr(), x.data_ptr(), out.data_ptr(), rows, data.shape[0], matrix.n_in, threads)
    return lambda: fn(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2", help="comma-separated inputs a pass")
    parser.add_argument("--passes", type=int, default=150, help="timed passes of each size")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    layers, head = matrices()
    for rows in (int(r) for r in args.rows.split(",")):
        keep: list = []
        layer_calls = [bound_call(m, rows, args.threads, keep) for m in layers]
        head_call = bound_call(head, rows, args.threads, keep)
        best_layers = best_head = float("inf")
        for p in range(args.passes + 1):
            start = time.perf_counter()
            for call in layer_calls:
                call()
            middle = time.perf_counter()
            head_call()
            end = time.perf_counter()
            if p > 0:  # the first pass warms up, untimed
                best_layers, best_head = min(best_layers, middle - start), min(best_head, end - middle)
        print(f"rows {rows}: layers {best_layers * 1e3:.3f} ms, head {best_head * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
