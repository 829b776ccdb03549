"""The trainer's rotary (`rotary_train`) against HF's `apply_rotary_pos_emb` run by autograd, with
per-token cos/sin from HF's rotary embedding (position ids restarting, as packed rows have)."""

import pytest
import torch

from tandem.kernels.rotary_ref import apply_rotary_pos_emb_ref
from tandem.kernels.rotary_train import rotary_qk, rotary_qk_backward

B, L, N, K, H = 2, 7, 3, 1, 12  # head_dim / 2 = 6: not a power of two


def _cos_sin(position_ids, device):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = LlamaRotaryEmbedding(LlamaConfig(hidden_size=N * H, num_attention_heads=N, head_dim=H))
    return rope(torch.zeros(1, dtype=torch.float32), position_ids)  # fp32, as over fp32 weights


def _hf(q_BLNH, k_BLKH, cos, sin, dq, dk):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q = q_BLNH.detach().transpose(1, 2).requires_grad_(True)
    k = k_BLKH.detach().transpose(1, 2).requires_grad_(True)
    qe, ke = apply_rotary_pos_emb(q, k, cos, sin)
    torch.autograd.backward((qe, ke), (dq.to(qe.dtype), dk.to(ke.dtype)))
    return qe.detach(), ke.detach(), q.grad.transpose(1, 2), k.grad.transpose(1, 2)


def _close(out, ref, tol):
    scale = max(1.0, ref.float().abs().max().item())
    assert (out.float() - ref.float()).abs().max().item() <= tol * scale


def test_reference_is_hf():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = torch.randn(B, N, L, H), torch.randn(B, K, L, H)
    cos, sin = _cos_sin(torch.arange(L).expand(B, L), "cpu")
    for a, b in zip(apply_rotary_pos_emb_ref(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,out_dtype,tol", [
    (torch.float32, None, 1e-6),
    (torch.bfloat16, None, 2e-2),  # autocast's q over fp32 cos/sin: fp32 out, as HF
    (torch.bfloat16, torch.bfloat16, 2e-2),  # emitted as the attention's autocast cast would
])
def test_rotary_forward_and_backward_match_hf(dtype, out_dtype, tol, device):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, L, N, H, generator=gen).to(device, dtype)
    k = torch.randn(B, L, K, H, generator=gen).to(device, dtype)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]])  # row 0: two packed
    cos, sin = (t.to(device) for t in _cos_sin(positions, device))
    dq = torch.randn(B, N, L, H, generator=gen).to(device, out_dtype or torch.float32)
    dk = torch.randn(B, K, L, H, generator=gen).to(device, out_dtype or torch.float32)
    ref_q, ref_k, ref_dq, ref_dk = _hf(q, k, cos, sin, dq, dk)
    q_out, k_out = rotary_qk(q, k, cos, sin, out_dtype)
    assert q_out.shape == (B, N, L, H) and k_out.shape == (B, K, L, H) and q_out.is_contiguous()
    assert q_out.dtype == (out_dtype or ref_q.dtype)
    _close(q_out, ref_q, tol)
    _close(k_out, ref_k, tol)
    got_dq, got_dk = rotary_qk_backward(dq, dk, cos, sin, dtype)
    assert got_dq.dtype == dtype and got_dq.shape == q.shape
    _close(got_dq, ref_dq, tol)
    _close(got_dk, ref_dk, tol)


def test_broadcast_cos_and_strided_gradient(device):
    """cos/sin of one row for every row, and a transposed (non-contiguous) output gradient."""
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(B, L, N, H, generator=gen).to(device), torch.randn(B, L, K, H, generator=gen).to(device)
    cos, sin = (t.to(device) for t in _cos_sin(torch.arange(L)[None], device))  # [1, L, H]
    dq = torch.randn(B, L, N, H, generator=gen).to(device).transpose(1, 2)  # [B, N, L, H] view
    dk = torch.randn(B, K, L, H, generator=gen).to(device)
    ref_q, ref_k, ref_dq, ref_dk = _hf(q, k, cos, sin, dq, dk)
    q_out, k_out = rotary_qk(q, k, cos, sin)
    got_dq, got_dk = rotary_qk_backward(dq, dk, cos, sin, torch.float32)
    for got, want in ((q_out, ref_q), (k_out, ref_k), (got_dq, ref_dq), (got_dk, ref_dk)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_rotary_gpu_shapes(out_dtype):
    """grpo-1.5b: 32 rows x 384 tokens, 12 query / 2 key heads of 128, bf16 q/k, fp32 cos/sin."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    b, l, n, k_heads, h = 32, 384, 12, 2, 128
    rope = Qwen2RotaryEmbedding(Qwen2Config(hidden_size=n * h, num_attention_heads=n, head_dim=h,
                                            rope_theta=1e6)).cuda()
    cos, sin = rope(torch.zeros(1, device="cuda"), torch.arange(l, device="cuda").expand(b, l))
    q = torch.randn(b, l, n, h, device="cuda").to(torch.bfloat16)
    k = torch.randn(b, l, k_heads, h, device="cuda").to(torch.bfloat16)
    dq = torch.randn(b, n, l, h, device="cuda").to(out_dtype or torch.float32)
    dk = torch.randn(b, k_heads, l, h, device="cuda").to(out_dtype or torch.float32)
    ref_q, ref_k, ref_dq, ref_dk = _hf(q, k, cos, sin, dq, dk)
    q_out, k_out = rotary_qk(q, k, cos, sin, out_dtype)
    got_dq, got_dk = rotary_qk_backward(dq, dk, cos, sin, torch.bfloat16)
    # fp32 math rounded once, as HF's: equal but for rare ties
    for got, want in ((q_out, ref_q), (k_out, ref_k), (got_dq, ref_dq), (got_dk, ref_dk)):
        torch.testing.assert_close(got.float(), want.to(got.dtype).float(), atol=1e-2, rtol=1e-2)
