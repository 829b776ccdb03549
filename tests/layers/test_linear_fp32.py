"""The fp32-accumulating GEMMs the lm_head and the trainer's log-prob head share."""

import pytest
import torch

from tandem.layers.linear import addmm_fp32_, linear_fp32_out

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_addmm_accumulates_the_exact_fp32_products(device):
    """acc += a @ b with bf16 inputs equals the fp32 GEMM of the upcast inputs (bf16 products
    are exact in fp32), in place, whichever path the backend takes (addmm with out_dtype on
    CUDA, an upcast elsewhere)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(96, 40, generator=gen).bfloat16().to(device)
    b = torch.randn(40, 72, generator=gen).bfloat16().to(device)
    acc = torch.randn(96, 72, generator=gen).to(device)
    want = acc + a.double() @ b.double()
    ptr = acc.data_ptr()
    out = addmm_fp32_(acc, a, b)
    assert out.data_ptr() == ptr and acc.dtype == torch.float32
    torch.testing.assert_close(acc.double(), want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(linear_fp32_out(a, b.t()).double(), a.double() @ b.double(), rtol=1e-6, atol=1e-5)
