"""Batch-invariant kernels: equal to plain torch, and a row's result does not depend on its batch."""

import pytest
import torch

from tandem.kernels.batch_invariant import linear, linear_ref, token_logprobs, token_logprobs_ref


def _data(M, K, N, dtype, device, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(device, dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(device, dtype)
    b = torch.randn(N, generator=gen).to(device, dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,K,N,bias", [(1, 64, 128, False), (70, 96, 200, True), (130, 200, 72, True)])
def test_linear_matches_torch(M, K, N, bias, dtype, device, close):
    x, w, b = _data(M, K, N, dtype, device, bias)
    close(linear(x, w, b), linear_ref(x, w, b))
    out32 = linear(x, w, b, out_dtype=torch.float32)
    assert out32.dtype == torch.float32
    tol = 2e-5 if dtype == torch.float32 else 1e-3  # fp32 out: only the sum's order differs
    torch.testing.assert_close(out32, (x.float() @ w.float().t()) + (b.float() if b is not None else 0),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_row_does_not_depend_on_the_batch(dtype, device):
    x, w, b = _data(150, 136, 130, dtype, device)
    full = linear(x, w, b)
    for rows in (slice(0, 1), slice(3, 4), slice(0, 7), slice(64, 150), slice(149, 150)):
        assert torch.equal(linear(x[rows], w, b), full[rows]), rows
    # ...nor on the rows beside it: other values in the other rows, the same result here
    y = x.clone()
    y[1:] = torch.randn_like(y[1:])
    assert torch.equal(linear(y, w, b)[0], full[0])
    # a row's place in its tile does not matter either (a vocabulary-sized N, an lm_head's K)
    x, w, _ = _data(63, 64, 320, dtype, device, bias=False, seed=3)
    assert torch.equal(linear(x, w)[28:35], linear(x[28:35], w))
    x, w, b = _data(150, 136, 130, dtype, device)
    # a leading batch dim is flattened, never a different kernel
    assert torch.equal(linear(x.view(10, 15, 136), w, b).view(150, 130), full)


@pytest.mark.parametrize("V", [7, 1024, 3000])
def test_token_logprobs_match_torch(V, device):
    gen = torch.Generator().manual_seed(1)
    logits = (4 * torch.randn(9, V, generator=gen)).to(device)
    tokens = torch.randint(0, V, (9,), generator=gen).to(device)
    temperature = torch.linspace(0.5, 1.5, 9).to(device)
    out = token_logprobs(logits, tokens, temperature)
    torch.testing.assert_close(out, token_logprobs_ref(logits, tokens, temperature), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(token_logprobs(logits, tokens), token_logprobs_ref(logits, tokens, torch.ones(9)
                                                                                    .to(device)), atol=2e-5, rtol=1e-5)


def test_token_logprobs_row_does_not_depend_on_the_batch(device):
    gen = torch.Generator().manual_seed(2)
    logits = (4 * torch.randn(12, 2500, generator=gen)).to(device)
    logits[3, 100:] = float("-inf")  # a masked tail (top-k style) is handled, not NaN
    tokens = torch.randint(0, 100, (12,), generator=gen).to(device)
    t = torch.full((12,), 0.7, device=device)
    full = token_logprobs(logits, tokens, t)
    assert torch.isfinite(full).all()
    for rows in (slice(0, 1), slice(3, 4), slice(5, 12)):
        assert torch.equal(token_logprobs(logits[rows], tokens[rows], t[rows]), full[rows])
