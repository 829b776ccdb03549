"""The decode GEMM (Triton, deterministic split-K) against `linear_ref` and torch's matmul."""

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.counters import counters
from tandem.kernels.decode_gemm import GemmConfig, default_config, linear, linear_ref


def operands(M, N, K, dtype, device, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(device, dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(device, dtype)
    b = torch.randn(N, generator=gen).to(device, dtype) if bias else None
    return x, w, b


def test_reference_is_fp32_linear():
    """The spec, checked against a hand-computed product: [1 2] . [3 4] + 0.5 = 11.5."""
    x = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    w = torch.tensor([[3.0, 4.0], [1.0, -1.0]], dtype=torch.bfloat16)
    b = torch.tensor([0.5, 0.25], dtype=torch.bfloat16)
    out = linear_ref(x, w, b)
    assert out.dtype == torch.bfloat16 and out.tolist() == [[11.5, -0.75]]
    x, w, b = operands(7, 33, 65, torch.float32, "cpu")
    torch.testing.assert_close(linear_ref(x, w, b), F.linear(x, w, b))


CONFIGS = [
    GemmConfig(16, 32, 32, split_k=1),
    GemmConfig(32, 64, 64, split_k=3),
    GemmConfig(16, 32, 32, split_k=4, num_warps=2, num_stages=2),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("M,N,K", [(1, 96, 128), (5, 200, 320), (40, 64, 256), (17, 70, 100)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_reference(config, M, N, K, bias, device):
    """Rows and columns not a multiple of the tile, K not a multiple of BLOCK_K (100), and
    more splits than K blocks (K 128 in blocks of 64 over 3 or 4 splits)."""
    x, w, b = operands(M, N, K, torch.float32, device, bias)
    out = linear(x, w, b, config)
    assert out.shape == (M, N) and out.dtype == x.dtype
    torch.testing.assert_close(out, linear_ref(x, w, b), atol=1e-4, rtol=1e-4)


def test_half_precision_and_leading_dims(device):
    x, w, b = operands(24, 96, 192, torch.float16, device)
    out = linear(x.view(2, 12, 192), w, b, GemmConfig(16, 32, 64, split_k=2))
    assert out.shape == (2, 12, 96)
    torch.testing.assert_close(out.view(24, 96).float(), linear_ref(x, w, b).float(),
                               atol=2e-3, rtol=2e-3)


def test_split_k_is_deterministic_and_leaves_counters_zero(device):
    """Same bits on every call (the partials are summed in split order, whichever program
    finishes last), and every tile counter back at zero for the next launch or graph replay."""
    x, w, b = operands(33, 128, 512, torch.float32, device)
    cfg = GemmConfig(16, 32, 64, split_k=4)
    first = linear(x, w, b, cfg)
    for _ in range(2):
        assert torch.equal(linear(x, w, b, cfg), first)
    assert int(counters(x.device, "decode_gemm").abs().sum()) == 0
    # the same partial sums, added in split order by hand
    parts = [x[:, s * 128:(s + 1) * 128] @ w[:, s * 128:(s + 1) * 128].t() for s in range(4)]
    by_hand = ((parts[0] + parts[1]) + parts[2]) + parts[3] + b
    torch.testing.assert_close(first, by_hand, atol=1e-5, rtol=1e-5)


def test_default_config_fills_the_sms():
    cpu = torch.device("cpu")
    cfg = default_config(256, 1536, 8960, cpu)  # Qwen2.5-1.5B down projection: 24 tiles
    assert (cfg.block_m, cfg.block_n) == (128, 128) and cfg.split_k == 5
    assert default_config(64, 17920, 1536, cpu).split_k == 1  # 140 tiles: no split
    assert default_config(8, 2048, 1536, cpu).split_k == 3  # at least 512 of K per split


def test_empty_rows(device):
    x, w, b = operands(0, 32, 64, torch.float32, device)
    assert linear(x, w, b).shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [8, 64, 256])
def test_bf16_decode_shapes_in_a_cuda_graph(M):
    """Qwen2.5-1.5B's down projection and q/k/v (bias) in bf16, replayed from a graph."""
    for N, K, bias in [(1536, 8960, False), (2048, 1536, True)]:
        x, w, b = operands(M, N, K, torch.bfloat16, "cuda", bias)
        want = linear(x, w, b)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = linear(x, w, b)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)
        torch.testing.assert_close(out.float(), linear_ref(x, w, b).float(), atol=2e-2, rtol=2e-2)


def test_every_shipped_table_config_matches_the_reference(device):
    """Each distinct Triton config of the tables under tandem/kernels/configs (the engine's
    `decode_gemm="auto"`), on operands a few tiles wide with a ragged K and a bias: the tables
    are measured on a GPU, so a config no test ever ran cannot reach an engine. In the tables'
    dtype on a GPU (bf16: fp32 operands would need twice the shared memory the stages were sized
    for), fp16 in the interpreter (its bf16 dot is not bf16's; the same two bytes an element)."""
    import glob
    import json
    import os

    from tandem.layers.decode_gemm import CONFIG_DIR

    tables = sorted(glob.glob(os.path.join(CONFIG_DIR, "decode_gemm_*.json")))
    assert tables, f"no decode GEMM table under {CONFIG_DIR}"
    configs = set()
    for path in tables:
        with open(path) as f:
            table = json.load(f)
        assert table["dtype"] == "bfloat16", f"{path}: a {table['dtype']} table is not tested here"
        configs |= {GemmConfig(**e["config"]) for entries in table["shapes"].values()
                    for e in entries if e["backend"] == "triton"}
    assert configs
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    for cfg in sorted(configs, key=str):
        K = 2 * cfg.block_k * cfg.split_k + 24  # the last split's last block ragged
        for M in (1, cfg.block_m + 3):
            x, w, b = operands(M, 2 * cfg.block_n + 5, K, dtype, device)
            out, want = linear(x, w, b, cfg), linear_ref(x, w, b)
            assert out.dtype == dtype
            # both sum in fp32 and round once: apart only by the order of the sum (an ulp or so)
            torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=1e-2,
                                       msg=lambda m: f"{cfg} at M={M}: {m}")


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("M,N,K", [(1, 96, 128), (5, 200, 320), (17, 70, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_in_the_gemm_equals_the_two_kernels(config, M, N, K, dtype, device):
    """An MLP's down projection with the activation in its loads: gate_up [M, 2K] gives the
    bits of the activation kernel then the GEMM (same config), and the torch reference of both
    within tolerance; K not a multiple of BLOCK_K (100: the masked loads) included."""
    from tandem.kernels.activation import silu_and_mul
    from tandem.kernels.activation_ref import silu_and_mul_ref
    from tandem.kernels.decode_gemm import silu_and_mul_linear

    gen = torch.Generator().manual_seed(1)
    gate_up = (2 * torch.randn(M, 2 * K, generator=gen)).to(device, dtype)
    _, w, b = operands(M, N, K, dtype, device)
    out = silu_and_mul_linear(gate_up, w, b, config)
    assert out.shape == (M, N) and out.dtype == dtype
    assert torch.equal(out, linear(silu_and_mul(gate_up), w, b, config))
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), linear_ref(silu_and_mul_ref(gate_up), w, b).float(),
                               atol=tol, rtol=tol)


def test_silu_and_mul_linear_checks_its_input_width(device):
    from tandem.kernels.decode_gemm import silu_and_mul_linear

    _, w, _ = operands(2, 8, 16, torch.float32, device, bias=False)
    with pytest.raises(AssertionError, match=r"width 16 \(gate and up side by side\)"):
        silu_and_mul_linear(torch.zeros(2, 16, device=device), w)
    assert silu_and_mul_linear(torch.zeros(0, 32, device=device), w).shape == (0, 8)
