"""The fused head's one-pass kernels against their torch references and against softmax written
out: odd vocabularies, one row, targets at both ends, temperature, filtered (-inf) tokens."""

import pytest
import torch

from tandem.kernels.head_logprobs import (
    BLOCK,
    logprob_grad_,
    logprob_grad_ref,
    lse_logprobs,
    lse_logprobs_ref,
)

SHAPES = [(1, 1000), (5, 1000), (3, 50257), (2, BLOCK), (4, BLOCK + 1)]


def inputs(C, V, temperature, device, filtered=False, seed=0):
    """fp32 logits / T as the head hands them over, targets at column 0, V - 1 and in between."""
    gen = torch.Generator().manual_seed(seed)
    x_CV = 4 * torch.randn(C, V, generator=gen) / temperature
    target_C = torch.randint(0, V, (C,), generator=gen)
    target_C[0] = 0
    target_C[-1] = V - 1
    if filtered:  # dropped tokens, the target kept: most of a row, and a whole first block
        drop = torch.rand(C, V, generator=gen) < 0.9
        drop[0, : min(V - 1, BLOCK + 7)] = True
        drop[torch.arange(C), target_C] = False
        x_CV = x_CV.masked_fill(drop, float("-inf"))
    return x_CV.to(device), target_C.to(device), torch.randn(C, generator=gen).to(device)


@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shape", SHAPES)
def test_lse_logprobs(shape, temperature, filtered, device):
    x_CV, target_C, _ = inputs(*shape, temperature, device, filtered)
    lse_C, logp_C = lse_logprobs(x_CV, target_C)
    ref_lse, ref_logp = lse_logprobs_ref(x_CV, target_C)
    torch.testing.assert_close(lse_C, ref_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logp_C, ref_logp, rtol=1e-6, atol=1e-6)
    m_C = x_CV.max(-1).values  # by hand: max + log(sum(exp(x - max)))
    plain_lse = m_C + torch.log(torch.exp(x_CV - m_C[:, None]).sum(-1))
    torch.testing.assert_close(lse_C, plain_lse, rtol=1e-6, atol=1e-6)
    plain_logp = torch.log_softmax(x_CV, -1).gather(1, target_C[:, None]).squeeze(1)
    torch.testing.assert_close(logp_C, plain_logp, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shape", SHAPES)
def test_logprob_grad_fp32(shape, temperature, filtered, device):
    x_CV, target_C, grad_C = inputs(*shape, temperature, device, filtered)
    lse_C = torch.logsumexp(x_CV, -1)
    ref = logprob_grad_ref(x_CV, lse_C, grad_C, target_C, temperature, torch.float32)
    onehot_CV = torch.zeros_like(x_CV).scatter_(1, target_C[:, None], 1.0)
    plain = (onehot_CV - torch.softmax(x_CV, -1)) * grad_C[:, None] / temperature
    g_CV = logprob_grad_(x_CV.clone(), lse_C, grad_C, target_C, temperature, torch.float32)
    assert g_CV.dtype == torch.float32 and g_CV.shape == x_CV.shape
    torch.testing.assert_close(g_CV, ref, rtol=1e-6, atol=1e-6)
    # exp(x - lse) carries lse's rounding (an ulp of ~10 is 1e-6): relative 1e-5 against softmax
    torch.testing.assert_close(g_CV, plain, rtol=1e-5, atol=1e-6)
    if filtered:
        assert (g_CV[x_CV == float("-inf")] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1000), (3, 50257), (4, BLOCK + 1)])
def test_logprob_grad_narrow_dtype_over_the_logits_storage(shape, dtype, device):
    """The gradient in the GEMM's dtype, written over the fp32 logits: every row's values, none
    clobbered by another row's or by a later block's. The interpreter rounds to bf16 by truncation,
    so bf16 is compared within one bf16 step; fp16 rounds exactly there too."""
    x_CV, target_C, grad_C = inputs(*shape, 0.7, device)
    lse_C = torch.logsumexp(x_CV, -1)
    ref = logprob_grad_ref(x_CV, lse_C, grad_C, target_C, 0.7, torch.float32)
    x_copy = x_CV.clone()
    g_CV = logprob_grad_(x_copy, lse_C, grad_C, target_C, 0.7, dtype)
    assert g_CV.dtype == dtype and g_CV.shape == x_CV.shape
    assert g_CV.untyped_storage().data_ptr() == x_copy.untyped_storage().data_ptr()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-3
    torch.testing.assert_close(g_CV.float(), ref, rtol=tol, atol=1e-6)


@pytest.mark.gpu
def test_real_shape_on_the_gpu():
    """A full chunk of Qwen2.5-1.5B's head: 1700 tokens x 151,936, the gradient in bf16 (rounded
    to nearest on a GPU: the reference's bf16 or one step beside it where fp32 rounding differs)."""
    x_CV, target_C, grad_C = inputs(1700, 151936, 0.7, "cuda")
    lse_C, logp_C = lse_logprobs(x_CV, target_C)
    ref_lse, ref_logp = lse_logprobs_ref(x_CV, target_C)
    torch.testing.assert_close(lse_C, ref_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logp_C, ref_logp, rtol=1e-6, atol=1e-6)
    ref = logprob_grad_ref(x_CV, ref_lse, grad_C, target_C, 0.7, torch.bfloat16)
    g_CV = logprob_grad_(x_CV, ref_lse, grad_C, target_C, 0.7, torch.bfloat16)
    torch.testing.assert_close(g_CV.float(), ref.float(), rtol=8e-3, atol=0)
