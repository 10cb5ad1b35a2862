"""Compiled kernels for what torch does slowly or inconsistently here, built on first use.

* ``gemm.c``: a float32 or bfloat16 weight matrix (or GGUF blocks of the types in :data:`EXACT_BLOCK_KINDS`, rebuilt in
  float32 on the fly) times a few rows, what a decode step (one row) or a verification pass (a
  few) spends most of its time on (``exact`` numerics; docs/BENCHMARKS.md compares it with oneDNN).
* ``gemm_q8.c``: GGUF blocks times inputs quantised to 8 bits, with integer dot products
  (AVX512-VNNI, or AVX2's byte multiply-adds: the same sums), and its scalar reference: the
  ``fast`` numerics.
* ``attention.c``: attention over the cache for a few queries, each computed from the keys it
  sees in cache order.
* ``layer_ops.c``: a layer's element-wise work (residual add + RMSNorm, SiLU gating, rotary
  embedding + cache write) in one call each instead of a handful of torch ops.
* ``forward.c``: every decoder layer of a few-row pass in one call, calling the kernels above
  through function pointers in the layer-by-layer order (:class:`DecoderLayers`).
* ``topk.c``: the k best entries of a few rows of logits in one pass (token recycling's
  per-step table refresh), and the argmax of a row (every greedy step).
* ``token_mask.c``: a grammar's token bitmask applied to a row of logits, or the row's best
  allowed token found without writing the masked row (structured decoding).
* ``race.c``: a seeded draw from a distribution by an exponential race with keyed noise, taking
  the logarithm for the few tokens that can win (every sampled step).

``decodekit.h`` declares every exported function and the structures of ``forward.c``'s call; each C
file includes it, so the compiler checks the definitions, and the ctypes declarations follow it.
The Python side, one module per group of C files: :mod:`.build` (compiling and loading),
:mod:`.matmul` (gemm.c, gemm_q8.c), :mod:`.attention`, :mod:`.layers` (layer_ops.c, forward.c)
and :mod:`.sampling` (topk.c, race.c, token_mask.c); their public names are imported here.

In all, a row's result does not depend on the other rows of the pass or on the attention
layout, so a token verified in a tree gets bit for bit its one-token-step logits. Where a kernel
cannot be built (no compiler, no AVX2, ``DECODEKIT_KERNELS=0``), its function here returns None and callers keep using torch. :mod:`.build` picks the
instruction set for the CPU at run time: AVX-512, or AVX2 through ``avx512_on_avx2.h``.
"""

from __future__ import annotations

from .build import EXTRA_FLAGS, FLAGS, MAX_ROWS, sources_digest
from .matmul import (
    EXACT_BLOCK_KINDS, INTEGER_GROUP, INTEGER_KINDS, MatmulKernel, block_matmul, empty_packed, few_rows_matmul,
    integer_block_matmul, integer_block_matmul_reference, integer_block_rows, integer_peak_loop,
    pack_integer_blocks,
)
from .attention import (
    AttentionKernel, Int8CacheKernels, KiviAttention, dequantise_int8_rows, int8_cache_kernels, kivi_attention,
    layout_independent_attention, quantise_int8_rows,
)
from .layers import (
    DecoderLayers, KernelProjection, LAYER_NORMS, LayerOps, MIRRORED_STRUCTS, SequencePart, decoder_layers,
    layer_ops,
)
from .sampling import (
    TOPK_MAX, argmax, argmax_rows, exponential_race, mask_logits, masked_argmax, race_uniforms, top_k_indices,
)

__all__ = [
    "AttentionKernel", "DecoderLayers", "EXACT_BLOCK_KINDS", "EXTRA_FLAGS", "FLAGS", "INTEGER_GROUP",
    "INTEGER_KINDS", "Int8CacheKernels", "KernelProjection", "KiviAttention", "LAYER_NORMS", "LayerOps", "MAX_ROWS",
    "MIRRORED_STRUCTS", "MatmulKernel", "SequencePart", "TOPK_MAX", "argmax", "argmax_rows", "block_matmul",
    "decoder_layers", "dequantise_int8_rows", "empty_packed", "exponential_race", "few_rows_matmul",
    "int8_cache_kernels", "integer_block_matmul", "integer_block_matmul_reference", "integer_block_rows",
    "integer_peak_loop", "kivi_attention", "layer_ops", "layout_independent_attention", "mask_logits",
    "masked_argmax", "pack_integer_blocks", "quantise_int8_rows", "race_uniforms", "sources_digest",
    "top_k_indices",
]
