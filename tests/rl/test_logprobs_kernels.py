"""The fused head with its Triton kernels (`tandem.kernels.head_logprobs`) against its torch path:
logprobs and the gradients of hidden and weight, fp32 and bf16, with temperature and the sampling
filter's -inf tokens; batch-invariant mode keeps the torch path. CPU: the interpreter."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tandem import batch_invariant
from tandem.rl.logprobs import SamplingFilter, head_logprobs

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
interpreted = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs CUDA or TRITON_INTERPRET=1")


def inputs(N, D, V, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=gen).to(device).requires_grad_(True)
    w = (torch.randn(V, D, generator=gen) / D**0.5).to(device).requires_grad_(True)
    t = torch.randint(0, V, (N,), generator=gen)
    t[0], t[-1] = 0, V - 1
    return h, w, t.to(device), torch.randn(N, generator=gen).to(device)


def logps_and_grads(h, w, t, g, **kw):
    h.grad = w.grad = None
    lp = head_logprobs(h, w, t, **kw)
    (lp * g).sum().backward()
    return lp.detach(), h.grad.clone(), w.grad.clone()


@interpreted
@pytest.mark.parametrize("sampling", [None, SamplingFilter(top_k=50, top_p=0.9)])
@pytest.mark.parametrize("chunk_size", [3, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kernels_equal_the_torch_path_fp32(temperature, chunk_size, sampling):
    h, w, t, g = inputs(10, 16, 1001)
    kw = {"temperature": temperature, "chunk_size": chunk_size, "sampling": sampling}
    got = logps_and_grads(h, w, t, g, kernels=True, **kw)
    want = logps_and_grads(h, w, t, g, kernels=False, **kw)
    for a, b, name in zip(got, want, ("logp", "grad hidden", "grad weight")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@interpreted
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kernels_equal_the_torch_path_bf16(temperature):
    """bf16 GEMMs over fp32 master weights, as under bf16 training: the logprobs come from the same
    fp32 logits; the gradients from bf16 logit gradients (truncated in the interpreter, rounded to
    nearest on a GPU), so they agree within bf16's resolution."""
    h, w, t, g = inputs(12, 32, 2000)
    kw = {"temperature": temperature, "dtype": torch.bfloat16, "chunk_size": 5}
    got = logps_and_grads(h, w, t, g, kernels=True, **kw)
    want = logps_and_grads(h, w, t, g, kernels=False, **kw)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-2 * b.abs().max().item())


@interpreted
def test_batch_invariant_mode_keeps_the_torch_path_bit_for_bit(monkeypatch):
    """That mode's arithmetic is fixed: asking for the kernels there changes no bit."""
    from tandem.kernels import head_logprobs as kernels

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton head ran under batch_invariant")

    monkeypatch.setattr(kernels, "lse_logprobs", refuse)
    monkeypatch.setattr(kernels, "logprob_grad_", refuse)
    h, w, t, g = inputs(6, 8, 37)
    with batch_invariant.enabled():
        asked = logps_and_grads(h, w, t, g, temperature=0.7, kernels=True)
        plain = logps_and_grads(h, w, t, g, temperature=0.7, kernels=False)
    for a, b in zip(asked, plain):
        assert torch.equal(a, b)


def test_kernels_on_a_cpu_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    h, w, t, _ = inputs(2, 4, 9, device="cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        head_logprobs(h, w, t, kernels=True)
    head_logprobs(h, w, t)  # None: the torch path on a CPU


@pytest.mark.gpu
def test_kernels_at_the_real_shape_on_the_gpu():
    """Qwen2.5-1.5B's head: V = 151,936, D = 1536, a full 1700-token chunk and a partial one,
    bf16 GEMMs, temperature 0.7."""
    h, w, t, g = inputs(2000, 1536, 151936)
    kw = {"temperature": 0.7, "dtype": torch.bfloat16, "chunk_size": 1700}
    got = logps_and_grads(h, w, t, g, kernels=True, **kw)
    want = logps_and_grads(h, w, t, g, kernels=False, **kw)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=2e-5)
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * b.abs().max().item())
