"""The compiled weight-streaming kernel: same results as torch, row by row identical."""

import pytest
import torch
import torch.nn.functional as F

from decodekit.models import kernels
from decodekit.models.native import Projection

matmul = kernels.few_rows_matmul(torch.float32)
needs_kernel = pytest.mark.skipif(matmul is None, reason="no C compiler or no AVX-512 on this machine")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("shape", [(96, 64), (101, 37), (3, 20), (8, 576)])
def test_kernel_matches_torch(rows, shape):
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(*shape, generator=gen), torch.randn(rows, shape[1], generator=gen)
    torch.testing.assert_close(matmul(weight, x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_other_rows():
    """What makes a k-token verification pass agree bit for bit with one-token steps."""
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(130, 77, generator=gen), torch.randn(7, 77, generator=gen)
    together = matmul(weight, x)
    for i in range(7):
        assert torch.equal(together[i], matmul(weight, x[i : i + 1].contiguous())[0])


@needs_kernel
def test_projection_uses_the_kernel_for_few_rows_and_keeps_shapes_and_bias():
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    proj = Projection(weight, bias)
    assert proj.few_rows is not None
    for shape in [(1, 1, 24), (2, 3, 24), (1, 17, 24)]:  # 17 rows: past MAX_ROWS, torch's path
        x = torch.randn(*shape, generator=gen)
        torch.testing.assert_close(proj(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert Projection(weight.double()).few_rows is None  # float32 and bfloat16 only


@needs_kernel
def test_bfloat16_weights_multiply_exactly_and_sum_in_float32():
    gen = torch.Generator().manual_seed(2)
    weight, x = torch.randn(64, 48, generator=gen).bfloat16(), torch.randn(3, 48, generator=gen).bfloat16()
    out = kernels.few_rows_matmul(torch.bfloat16)(weight, x)
    assert out.dtype == torch.bfloat16
    exact = (x.double() @ weight.double().t()).bfloat16()  # products of bf16 values are exact
    assert (out.float() - exact.float()).abs().max() <= 2 ** -6 * exact.float().abs().max()
    assert torch.equal(out[1], kernels.few_rows_matmul(torch.bfloat16)(weight, x[1:2])[0])


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("DECODEKIT_KERNELS", "0")
    assert not kernels._supported()


def test_a_failed_build_falls_back_to_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.setenv("DECODEKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels.shutil, "which", lambda name: "/bin/false" if name == "false" else None)
    assert kernels._build(kernels.SOURCE) is None
