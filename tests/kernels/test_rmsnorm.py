"""Triton RMSNorm (plain and fused with the residual add) against the torch references."""

import pytest
import torch

from tandem.kernels.rmsnorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from tandem.layers.norm import RMSNorm


def inputs(shape, dtype, device, weight_dtype=None):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=gen)).to(device, dtype)
    residual = torch.randn(shape, generator=gen).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device, weight_dtype or dtype)
    return x, residual, weight


def test_references_match_layer():
    x, residual, weight = inputs((4, 64), torch.bfloat16, "cpu")
    layer = RMSNorm(64, eps=1e-5).to(torch.bfloat16)
    layer.weight.data.copy_(weight)
    with torch.no_grad():
        assert torch.equal(layer(x), rms_norm_ref(x, weight, 1e-5))
        out, new_res = layer(x, residual)
    ref_out, ref_res = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(out, ref_out) and torch.equal(new_res, ref_res)


# The interpreter rounds fp32 -> bf16 by truncation, so bf16 is only compared on a GPU; fp16
# follows the same code path and rounds exactly in the interpreter too.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 96), (3, 1000)])
def test_rms_norm_matches_reference(dtype, shape, device):
    x, residual, weight = inputs(shape, dtype, device)
    out = rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), atol=1e-5, rtol=1e-5)
    out, new_res = fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)


def test_fp32_weight_promotes_output(device):
    x, _, weight = inputs((3, 64), torch.float16, device, weight_dtype=torch.float32)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), atol=1e-5, rtol=1e-5)


def test_inputs_left_unchanged(device):
    x, residual, weight = inputs((4, 64), torch.float32, device)
    x0, r0 = x.clone(), residual.clone()
    fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(x, x0) and torch.equal(residual, r0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [1536, 4096, 896])
def test_rms_norm_half_precision_gpu(dtype, hidden):
    x, residual, weight = inputs((257, hidden), dtype, "cuda")
    out, new_res = fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(new_res, ref_res)  # the add rounds exactly as torch does
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3  # one ulp of the rounded norm
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6),
                               atol=tol, rtol=tol)


def test_reference_against_hand_values_and_hf():
    """Not against itself: x = [3, 4] has mean square 12.5, so it normalises to x / sqrt(12.5)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.tensor([[3.0, 4.0]])
    weight = torch.tensor([1.0, 2.0])
    expected = torch.tensor([[3.0, 8.0]]) / 12.5**0.5
    torch.testing.assert_close(rms_norm_ref(x, weight, 0.0), expected)
    out, res = fused_add_rms_norm_ref(x, torch.tensor([[1.0, -1.0]]), weight, 0.0)
    torch.testing.assert_close(res, torch.tensor([[4.0, 3.0]]))
    torch.testing.assert_close(out, torch.tensor([[4.0, 6.0]]) / 12.5**0.5)
    hf = LlamaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    x, _, weight = inputs((4, 64), torch.bfloat16, "cpu")
    hf.weight.data.copy_(weight)
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(x, weight, 1e-6), hf(x))


# -- the trainer's backward (`rms_norm_backward`), against HF's module run by autograd -------------
def _hf_norm_grads(x, weight, dy, eps):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(x.shape[-1], eps=eps).to(weight.device, weight.dtype)
    hf.weight.data.copy_(weight)
    x = x.detach().requires_grad_(True)
    out = hf(x)
    out.backward(dy.to(out.dtype))
    return out.detach(), x.grad, hf.weight.grad


def _close(out, ref, tol):
    """|out - ref| within tol of ref's scale (bf16 in the interpreter rounds by truncation)."""
    scale = max(1.0, ref.float().abs().max().item())
    assert (out.float() - ref.float()).abs().max().item() <= tol * scale, (out, ref)


@pytest.mark.parametrize("x_dtype,w_dtype,tol", [(torch.float32, torch.float32, 1e-5),
                                                 (torch.bfloat16, torch.float32, 2e-2),
                                                 (torch.bfloat16, torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(37, 100), (2, 3, 96)])  # hidden not a power of 2; odd rows
def test_rms_norm_backward_matches_hf(x_dtype, w_dtype, tol, shape, device):
    from tandem.kernels.rmsnorm import rms_norm_backward

    x, _, weight = inputs(shape, x_dtype, device, weight_dtype=w_dtype)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device)
    ref_out, ref_dx, ref_dw = _hf_norm_grads(x, weight, dy, 1e-6)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == ref_out.dtype
    _close(out, ref_out, tol)
    dx, dw = rms_norm_backward(dy.to(out.dtype), x, weight, 1e-6)
    assert dx.dtype == x_dtype and dw.dtype == w_dtype and dx.shape == x.shape
    _close(dx, ref_dx, tol)
    _close(dw, ref_dw, tol)


def test_rms_norm_emits_autocast_dtype_and_takes_its_gradient(device):
    """fp32 x and weight, output in bf16 (what autocast's cast of HF's output holds), gradient
    handed back in bf16: dx and dweight are HF's for that bf16 gradient."""
    from tandem.kernels.rmsnorm import rms_norm_backward

    x, _, weight = inputs((9, 80), torch.float32, device)
    dy = torch.randn(9, 80, generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)
    ref_out, ref_dx, ref_dw = _hf_norm_grads(x, weight, dy, 1e-6)
    out = rms_norm(x, weight, 1e-6, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    _close(out, ref_out.to(torch.bfloat16), 1e-2)
    dx, dw = rms_norm_backward(dy, x, weight, 1e-6)
    _close(dx, ref_dx, 1e-5)
    _close(dw, ref_dw, 1e-5)
    dx2, none = rms_norm_backward(dy, x, weight, 1e-6, weight_grad=False)  # a frozen weight (LoRA)
    assert none is None and torch.equal(dx2, dx)


def test_rms_norm_backward_hand_values(device):
    """x = [3, 4], weight 1, eps 0: n = x / r with r = sqrt(12.5); d(sum n)/dx = (1 - n * mean(n)) / r."""
    from tandem.kernels.rmsnorm import rms_norm_backward

    x, w = torch.tensor([[3.0, 4.0]]), torch.ones(2)
    r = 12.5**0.5
    n = x / r
    expected = (1 - n * n.mean()) / r
    dx, dw = rms_norm_backward(torch.ones(1, 2, device=device), x.to(device), w.to(device), 0.0)
    torch.testing.assert_close(dx.cpu(), expected)
    torch.testing.assert_close(dw.cpu(), n[0])


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.float32, None), (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, None)])
def test_rms_norm_backward_gpu_shapes(x_dtype, out_dtype):
    """The grpo-1.5b shapes compiled: 12288 rows of 1536 (many rows per program)."""
    from tandem.kernels.rmsnorm import rms_norm_backward

    x, _, weight = inputs((12288, 1536), x_dtype, "cuda", weight_dtype=torch.float32)
    dy = torch.randn(12288, 1536, device="cuda").to(out_dtype or torch.float32)
    ref_out, ref_dx, ref_dw = _hf_norm_grads(x, weight, dy, 1e-6)
    out = rms_norm(x, weight, 1e-6, out_dtype)
    tol = 1e-5 if x_dtype == torch.float32 else 1e-2
    _close(out, ref_out.to(out.dtype), 1e-2 if out_dtype else tol)
    dx, dw = rms_norm_backward(dy, x, weight, 1e-6)
    _close(dx, ref_dx, tol)
    _close(dw, ref_dw, 1e-4 if x_dtype == torch.float32 else 1e-2)  # a sum over 12288 rows
