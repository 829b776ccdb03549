"""Triton SiLU-and-multiply against the torch reference and the layer."""

import functools
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


# -- the trainer's SwiGLU: separate gate/up, forward and backward, against HF's autograd -------------
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(7, 80), (2, 3, 1500)])  # 1500 > one block of 1024
def test_silu_mul_forward_and_backward_match_hf(dtype, tol, shape, device):
    from transformers.activations import ACT2FN

    from tandem.kernels.activation import silu_mul, silu_mul_backward

    gen = torch.Generator().manual_seed(0)
    gate, up, dy = ((3 * torch.randn(shape, generator=gen)).to(device, dtype) for _ in range(3))
    g, u = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    ref = ACT2FN["silu"](g) * u
    ref.backward(dy)
    out = silu_mul(gate, up)
    dg, du = silu_mul_backward(dy, gate, up)
    assert out.dtype == dg.dtype == du.dtype == dtype
    for got, want in ((out, ref.detach()), (dg, g.grad), (du, u.grad)):
        scale = max(1.0, want.float().abs().max().item())
        assert (got.float() - want.float()).abs().max().item() <= tol * scale


def test_silu_mul_backward_hand_values(device):
    """gate 0: silu'(0) = 1/2, silu(0) = 0; gate 2: silu = 2 s, silu' = s (1 + 2 (1 - s)), s = sigmoid(2)."""
    from tandem.kernels.activation import silu_mul_backward

    s = 1 / (1 + math.exp(-2.0))
    t = functools.partial(torch.tensor, device=device)
    dg, du = silu_mul_backward(torch.ones(1, 2, device=device), t([[0.0, 2.0]]), t([[3.0, 1.0]]))
    torch.testing.assert_close(dg.cpu(), torch.tensor([[1.5, s * (1 + 2 * (1 - s))]]))
    torch.testing.assert_close(du.cpu(), torch.tensor([[0.0, 2 * s]]))


@pytest.mark.gpu
def test_silu_mul_backward_gpu_shapes():
    """bf16 [12288, 8960] (grpo-1.5b's MLP), rounded as torch rounds on the GPU: within one ulp."""
    from tandem.kernels.activation import silu_mul, silu_mul_backward

    gate, up, dy = (torch.randn(12288, 8960, device="cuda").to(torch.bfloat16) for _ in range(3))
    g, u = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    ref = torch.nn.functional.silu(g) * u
    ref.backward(dy)
    dg, du = silu_mul_backward(dy, gate, up)
    for got, want in ((silu_mul(gate, up), ref.detach()), (dg, g.grad), (du, u.grad)):
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
