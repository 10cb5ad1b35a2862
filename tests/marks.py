"""Marks that need decodekit's kernels to decide (kept out of conftest.py, which xdist's controller
imports without running a test)."""

import pytest

from decodekit.models import kernels

#: Whether this machine runs the `fast` numerics (its integer kernels need AVX512-VNNI).
HAS_FAST_NUMERICS = kernels.integer_block_matmul("q4_1") is not None
#: The mark of a test of the `fast` numerics' integer kernels.
needs_vnni = pytest.mark.skipif(not HAS_FAST_NUMERICS,
                                reason="AVX512-VNNI kernels unavailable on this machine (no VNNI or no compiler)")
