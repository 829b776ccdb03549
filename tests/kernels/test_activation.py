"""Triton SiLU-and-multiply against the torch reference and the layer."""

import math

import pytest
import torch

from tandem.kernels.activation import silu_and_mul, silu_and_mul_ref
from tandem.layers.activation import SiluAndMul


def test_reference_matches_layer():
    x = torch.randn(3, 2 * 40)
    assert torch.equal(SiluAndMul()(x), silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(4, 2 * 64), (2, 3, 2 * 96), (3, 2 * 1500)])
def test_silu_and_mul_matches_reference(dtype, shape, device):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=gen)).to(device, dtype)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_half_precision_gpu(dtype):
    x = (3 * torch.randn(300, 2 * 8960, device="cuda")).to(dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), atol=tol, rtol=tol)


def test_reference_is_silu_of_gate_times_up():
    """Against hand-computed values and HF's activation, not against itself: the first half is
    the gate (through SiLU), the second the up projection."""
    from transformers.activations import ACT2FN

    x = torch.tensor([[1.0, -2.0, 2.0, 3.0]])  # gate [1, -2], up [2, 3]
    expected = torch.tensor([[2.0 * (1.0 / (1 + math.exp(-1.0))), 3.0 * (-2.0 / (1 + math.exp(2.0)))]])
    torch.testing.assert_close(silu_and_mul_ref(x), expected)
    y = torch.randn(5, 2 * 24)
    gate, up = y[:, :24], y[:, 24:]
    torch.testing.assert_close(silu_and_mul_ref(y), ACT2FN["silu"](gate) * up)
