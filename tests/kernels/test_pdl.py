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


def _hopper_ptx(kernel, signature: dict, constexprs: dict) -> str:
    """The PTX Triton makes of `kernel` for sm_90 on any machine (the interpreter's wrapper, on a
    CPU, unwrapped)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    src = ASTSource(JITFunction(kernel.fn), signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


@pytest.mark.parametrize("trigger", [False, True])
def test_the_kernels_before_a_gemm_let_it_start_after_their_own_wait(trigger):
    """`pdl.EARLY`: RMSNorm and SiLU-and-mul call griddepcontrol.launch_dependents after their
    griddepcontrol.wait (never before: what they read is the kernel before's), and not at all
    without it."""
    from tandem.kernels.activation import _silu_and_mul_kernel
    from tandem.kernels.rmsnorm import _rms_norm_kernel

    ptr, i32 = "*bf16", "i32"
    norm = _hopper_ptx(_rms_norm_kernel, {
        "x_ptr": ptr, "res_ptr": ptr, "w_ptr": ptr, "out_ptr": ptr, "res_out_ptr": ptr, "stride_x": i32,
        "stride_r": i32, "stride_o": i32, "stride_ro": i32, "eps": "fp32", "N": "constexpr",
        "BLOCK": "constexpr", "HAS_RESIDUAL": "constexpr", "PDL": "constexpr", "TRIGGER": "constexpr"},
        {"N": 1536, "BLOCK": 2048, "HAS_RESIDUAL": True, "PDL": True, "TRIGGER": trigger})
    act = _hopper_ptx(_silu_and_mul_kernel, {
        "gate_ptr": ptr, "up_ptr": ptr, "out_ptr": ptr, "stride_g": i32, "stride_u": i32,
        "stride_o": i32, "INTER": "constexpr", "BLOCK": "constexpr", "PDL": "constexpr",
        "TRIGGER": "constexpr"}, {"INTER": 8960, "BLOCK": 1024, "PDL": True, "TRIGGER": trigger})
    for ptx in (norm, act):
        assert ("griddepcontrol.launch_dependents" in ptx) == trigger
        if trigger:
            assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")


def _decode_layer(s: dict) -> list[torch.Tensor]:
    """A decode layer's launches as the engine's graph holds them: each Triton kernel right after
    the cuBLAS GEMM whose output it reads (the GEMMs launch normally, the kernels with PDL); with
    `s["mlp_gemm"]` the MLP's GEMMs on the cluster GEMM (launched with PDL itself, right after
    the RMSNorm and the activation whose outputs it reads)."""
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
    mm = s.get("mlp_gemm") or (lambda a, w: a @ w.t())
    act = silu_and_mul(mm(h, s["w_gu"]))
    logits = mm(act, s["w_down"]) @ s["w_head"].t()
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
    variants = [("0", None), ("1", None)]  # PDL off and on, the GEMMs cuBLAS's
    if torch.cuda.get_device_capability() == (9, 0):  # on the cluster GEMM: off, on, early trigger
        import functools

        from tandem.kernels import sm90_gemm

        sm90 = functools.partial(sm90_gemm.linear, static_weight=True)  # weights load before the wait
        variants += [("0", sm90), ("1", sm90), ("early", sm90)]
    runs = {}
    for flag, gemm in variants:
        monkeypatch.setattr(pdl, "ENABLED", flag != "0")
        monkeypatch.setattr(pdl, "EARLY", flag == "early")
        s = {k: v.clone() for k, v in base.items()}
        if gemm is not None:
            s["mlp_gemm"] = gemm
        _decode_layer(s)  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = _decode_layer(s)
        runs[flag, gemm] = (graph, s, outs)
    for i in range(20):  # new inputs each replay: a kernel that read too early would see old ones
        x = torch.randn(B, D, generator=gen).to("cuda", torch.bfloat16)
        for graph, s, _ in runs.values():
            s["x"].copy_(x)
            graph.replay()
        torch.cuda.synchronize()
        for flag, gemm in variants:
            normal = runs["0", gemm]
            for a, b in zip(normal[2], runs[flag, gemm][2]):
                assert torch.equal(a, b), f"replay {i}: launch {flag} ({gemm}) differs from a normal one"
            assert torch.equal(normal[1]["k_cache"].nan_to_num(7.0),
                               runs[flag, gemm][1]["k_cache"].nan_to_num(7.0))
