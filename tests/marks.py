"""Marks that need decodekit's kernels to decide (kept out of conftest.py, which xdist's controller
imports without running a test)."""

import pytest

from decodekit.models import kernels

#: Whether this machine runs the `fast` numerics (its integer kernels: AVX512-VNNI or AVX2).
HAS_FAST_NUMERICS = kernels.integer_block_matmul("q4_1") is not None
#: The mark of a test of the `fast` numerics' integer kernels.
needs_fast_numerics = pytest.mark.skipif(not HAS_FAST_NUMERICS,
                                reason="integer kernels unavailable on this machine")
