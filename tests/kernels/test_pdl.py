"""Programmatic dependent launch (`tandem.kernels.pdl`): a kernel launched early, while the GEMM
before it still runs, reads exactly what a normal launch reads."""

import pytest
import torch

from tandem.kernels import pdl


def test_off_on_the_cpu_and_by_the_switch(monkeypatch):
    assert not pdl.enabled(torch.empty(1))  # CPU tensors (and the interpreter) launch normally
    if torch.cuda.is_available():
        monkeypatch.setattr(pdl, "ENABLED", False)  # what TANDEM_PDL=0 sets at import
        assert not pdl.enabled(torch.empty(1, device="cuda"))


def _decode_layer(s: dict) -> list[torch.Tensor]:
    """A decode layer's launches as the engine's graph holds them: each Triton kernel right after
    the cuBLAS GEMM whose output it reads (the GEMMs launch normally, the kernels with PDL)."""
    from tandem.kernels.activation import silu_and_mul
    from tandem.kernels.decode_attention import rotary_store_decode_attention
    from tandem.kernels.rmsnorm import fused_add_rms_norm
    from tandem.kernels.sampling import sample

    B, H = s["x"].shape[0], 128
    qkv = s["x"] @ s["w_qkv"].t()
    q, k, v = (t.view(B, -1, H) for t in qkv.split([12 * H, 2 * H, 2 * H], dim=-1))
    attn = rotary_store_decode_attention(s["positions"], q, k, v, s["cos"], s["sin"], s["k_cache"],
                                         s["v_cache"], s["slots"], s["seq_lens"], s["block_tables"],
                                         H**-0.5)
    o = attn.reshape(B, -1) @ s["w_o"].t()
    h, res = fused_add_rms_norm(o, s["x"], s["g"], 1e-6)
    act = silu_and_mul(h @ s["w_gu"].t())
    logits = (act @ s["w_down"].t()) @ s["w_head"].t()
    tokens, logprobs, _ = sample(logits.float(), s["temperature"], s["greedy"], s["seeds"])
    return [attn, h, res, act, tokens, logprobs]


@pytest.mark.gpu
def test_pdl_launches_read_their_producers_output_in_a_cuda_graph(monkeypatch, paged_kv):
    if not pdl.enabled(torch.empty(1, device="cuda")):
        pytest.skip("this GPU or Triton has no programmatic dependent launch")
    from transformers import Qwen2Config

    from tandem.layers.rotary import RotaryEmbedding

    B, D, I, V = 256, 1536, 8960, 32000
    gen = torch.Generator().manual_seed(0)

    def w(n, k):
        return (torch.randn(n, k, generator=gen) / k**0.5).to("cuda", torch.bfloat16)

    seq_lens = [(17 * b) % 700 + 1 for b in range(B)]
    k_cache, v_cache, block_tables = paged_kv(seq_lens, 2, 128, 16, torch.bfloat16, "cuda")
    tables = block_tables.tolist()
    rope = RotaryEmbedding(Qwen2Config(hidden_size=D, num_attention_heads=12, rope_theta=1e6), 128,
                           4096).to("cuda")
    base = {
        "x": torch.randn(B, D, generator=gen).to("cuda", torch.bfloat16),
        "w_qkv": w(16 * 128, D), "w_o": w(D, D), "w_gu": w(2 * I, D), "w_down": w(D, I),
        "w_head": w(V, D), "g": (1 + 0.1 * torch.randn(D, generator=gen)).to("cuda", torch.bfloat16),
        "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        "positions": torch.tensor([n - 1 for n in seq_lens], device="cuda"),
        "slots": torch.tensor([tables[b][(n - 1) // 16] * 16 + (n - 1) % 16
                               for b, n in enumerate(seq_lens)], device="cuda"),
        "cos": rope.cos_cache, "sin": rope.sin_cache,
        "temperature": torch.ones(B, device="cuda"),
        "greedy": torch.arange(B, device="cuda") % 4 == 0,
        "seeds": torch.arange(B, device="cuda", dtype=torch.int64),
    }
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setattr(pdl, "ENABLED", flag == "1")
        s = {k: v.clone() for k, v in base.items()}
        _decode_layer(s)  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = _decode_layer(s)
        runs[flag] = (graph, s, outs)
    for i in range(20):  # new inputs each replay: a kernel that read too early would see old ones
        x = torch.randn(B, D, generator=gen).to("cuda", torch.bfloat16)
        for graph, s, _ in runs.values():
            s["x"].copy_(x)
            graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(runs["0"][2], runs["1"][2]):
            assert torch.equal(a, b), f"replay {i}: PDL launch differs from a normal one"
        assert torch.equal(runs["0"][1]["k_cache"].nan_to_num(7.0), runs["1"][1]["k_cache"].nan_to_num(7.0))
