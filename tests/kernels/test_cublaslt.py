"""cuBLASLt with a chosen algorithm (`tandem.kernels.cublaslt`) against an fp32 product."""

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import cublaslt

SHAPES = [(256, 1536, 8960), (200, 1536, 1536), (1, 2048, 1536), (96, 576, 1536)]  # M, N, K


def operands(M, N, K, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to("cuda", dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to("cuda", dtype)
    return x, w


def close_to_fp32(y, x, w):
    """Within a few bf16/fp16 ulps of the fp32 product of the same inputs (cuBLAS's own error)."""
    want = x.float() @ w.float().t()
    ulp = 2.0 ** -7 if y.dtype == torch.bfloat16 else 2.0 ** -10
    err = (y.float() - want).abs().max().item()
    assert err <= 2 * ulp * want.abs().max().item(), err
    assert (F.linear(x, w).float() - want).abs().max().item() <= 2 * ulp * want.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_every_heuristic_algorithm_computes_the_product(M, N, K, dtype):
    """Each algorithm the heuristic proposes, rebuilt from its config attributes (as a table
    stores it), runs (no fallback) and gives the product; the same bits call after call."""
    x, w = operands(M, N, K, dtype)
    algos = cublaslt.heuristic_algos(M, N, K, dtype, x.device, count=8)
    assert algos, "the heuristic proposed nothing"
    for algo in algos:
        assert cublaslt._built(0 if x.device.index is None else x.device.index, M, N, K, dtype, algo) \
            is not None, algo
        y = cublaslt.linear(x, w, algo)
        assert y.shape == (M, N) and y.dtype == dtype
        close_to_fp32(y, x, w)
        assert torch.equal(cublaslt.linear(x, w, algo), y), algo


@pytest.mark.gpu
def test_an_algorithm_this_cublaslt_rejects_falls_back_to_f_linear():
    x, w = operands(64, 1536, 1536)
    bad = cublaslt.LtAlgo(algo_id=66, tile=9999, split_k=1, reduction=0, swizzle=0, custom=0,
                          stages=0, inner_shape=0, cluster=0)
    assert torch.equal(cublaslt.linear(x, w, bad), F.linear(x, w))
    # a 3-d input and a non-contiguous one: shapes kept, the product right
    algo = cublaslt.heuristic_algos(64, 1536, 1536, x.dtype, x.device)[0]
    y3 = cublaslt.linear(x.view(4, 16, 1536), w, algo)
    assert y3.shape == (4, 16, 1536) and torch.equal(y3.view(64, 1536), cublaslt.linear(x, w, algo))
    xt = x.t().contiguous().t()
    assert not xt.is_contiguous() and torch.equal(cublaslt.linear(xt, w, algo), F.linear(xt, w))


@pytest.mark.gpu
def test_captured_in_a_cuda_graph_and_replayed_on_new_inputs():
    """The engine captures the call: a replay reads the input buffer's new contents."""
    M, N, K = 256, 1536, 8960
    x, w = operands(M, N, K)
    algos = cublaslt.heuristic_algos(M, N, K, x.dtype, x.device)
    split = [a for a in algos if a.split_k > 1] or algos  # one with a workspace reduction if offered
    algo = split[0]
    cublaslt.prepare(x.device)
    static_x = x.clone()
    cublaslt.linear(static_x, w, algo)  # plans built outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = cublaslt.linear(static_x, w, algo)
    for seed in (1, 2):
        new_x, _ = operands(M, N, K, seed=seed)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, cublaslt.linear(new_x, w, algo))
        close_to_fp32(static_y, new_x, w)
