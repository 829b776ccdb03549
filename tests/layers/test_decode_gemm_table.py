"""Choosing the Triton decode GEMM per layer shape and M from a measured table."""

import json

import pytest
import torch
from model_fixtures import make_tiny_model

from tandem import LLM, SamplingParams, config
from tandem.kernels import decode_gemm as kernel
from tandem.kernels.cublaslt import LtAlgo
from tandem.kernels.decode_gemm import GemmConfig
from tandem.layers.decode_gemm import GemmChoice, apply_decode_gemm, parse_table, pick
from tandem.layers.linear import Linear, LMHead

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs Triton interpreted
SMALL = {"block_m": 16, "block_n": 32, "block_k": 32, "split_k": 2, "num_warps": 4,
         "num_stages": 2}


def table(shapes, max_triton_m=4) -> dict:
    """Triton for up to `max_triton_m` rows of every (N, K) given, cuBLAS up to 64, nothing after."""
    return {"device": "test", "dtype": "float32", "shapes": {
        f"{n},{k}": [{"max_m": 64, "backend": "cublas", "config": None},
                     {"max_m": max_triton_m, "backend": "triton", "config": SMALL}]
        for n, k in shapes}}


def test_pick_takes_the_first_bucket_holding_m():
    choices = parse_table(table([(8, 4)]))[(8, 4)]
    assert [c.max_m for c in choices] == [4, 64]  # sorted
    assert pick(choices, 1) == pick(choices, 4) == GemmConfig(**SMALL)
    assert pick(choices, 5) is None and pick(choices, 64) is None  # cuBLAS's bucket
    assert pick(choices, 65) is None  # past the table: cuBLAS
    assert pick((GemmChoice(8, None),), 3) is None


def test_layers_get_their_shapes_choices_and_run_triton_only_there(monkeypatch):
    calls = []
    linear = kernel.linear
    monkeypatch.setattr(kernel, "linear", lambda *a, **k: calls.append(a[1].shape) or linear(*a, **k))
    layer, other, head = Linear(32, 48), Linear(32, 40), LMHead(32, 48, bias=False)
    model = torch.nn.ModuleList([layer, other, head]).to(DEVICE)
    assert apply_decode_gemm(model, parse_table(table([(48, 32)]))) == 1
    assert layer.decode_gemm is not None and other.decode_gemm is None and head.decode_gemm is None
    with torch.no_grad():
        x = torch.randn(3, 32, device=DEVICE)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                   atol=1e-5, rtol=1e-5)
        assert calls == [(48, 32)]
        layer(torch.randn(9, 32, device=DEVICE))  # cuBLAS's bucket
        assert calls == [(48, 32)]
    x = torch.randn(3, 32, device=DEVICE, requires_grad=True)  # autograd: never the kernel
    layer(x).sum().backward()
    assert calls == [(48, 32)]


def test_the_down_projection_takes_the_activation_into_its_triton_bucket(monkeypatch):
    """`apply_down_proj` with `TANDEM_FUSED_SILU_DOWN`: one launch (the activation in the GEMM)
    in the rows its table gives Triton, the activation then the layer everywhere else, with the
    switch off, and under autograd."""
    from tandem.layers import linear as linear_layers
    from tandem.layers.activation import SiluAndMul

    fused = []
    silu_and_mul_linear = kernel.silu_and_mul_linear
    monkeypatch.setattr(kernel, "silu_and_mul_linear",
                        lambda *a, **k: fused.append(a[0].shape[0]) or silu_and_mul_linear(*a, **k))
    down, act = Linear(32, 48).to(DEVICE), SiluAndMul()
    apply_decode_gemm(torch.nn.ModuleList([down]), parse_table(table([(48, 32)])))
    gate_up = torch.randn(9, 64, device=DEVICE)
    monkeypatch.setattr(linear_layers, "FUSED_SILU_DOWN", True)
    with torch.no_grad():
        for m in (1, 4, 9):
            out = linear_layers.apply_down_proj(down, act, gate_up[:m])
            torch.testing.assert_close(out, down(act(gate_up[:m])), atol=1e-5, rtol=1e-5)
    assert fused == [1, 4]  # 9 rows: cuBLAS's bucket
    linear_layers.apply_down_proj(down, act, gate_up[:2].requires_grad_()).sum().backward()
    monkeypatch.setattr(linear_layers, "FUSED_SILU_DOWN", False)
    with torch.no_grad():
        linear_layers.apply_down_proj(down, act, gate_up[:2])
    assert fused == [1, 4]


LT = {"algo_id": 66, "tile": 28, "split_k": 4, "reduction": 2, "swizzle": 0, "custom": 0, "stages": 35,
      "inner_shape": 0, "cluster": 3}


def test_cublaslt_entries_go_to_bias_free_layers_on_a_gpu_only():
    """A cuBLASLt algorithm has no bias path: a biased layer of that shape keeps cuBLAS there
    (and its Triton buckets); on a CPU there is no cuBLASLt, so no layer gets one."""
    from tandem.kernels import cublaslt

    raw = {"device": "test", "dtype": "bfloat16", "shapes": {"48,32": [
        {"max_m": 4, "backend": "triton", "config": SMALL},
        {"max_m": 256, "backend": "cublaslt", "config": LT}]}}
    parsed = parse_table(raw)
    assert pick(parsed[(48, 32)], 200) == cublaslt.LtAlgo(**LT)
    assert parse_table({**raw, "cublaslt_version": 130100})[(48, 32)][1].measured_with == 130100
    assert parsed[(48, 32)][0].measured_with is None  # (Triton's entry: no cuBLASLt version)
    plain, biased = Linear(32, 48, bias=False), Linear(32, 48, bias=True)
    assert apply_decode_gemm(torch.nn.ModuleList([plain, biased]), parsed) == 2  # Triton at <= 4 rows
    assert pick(biased.decode_gemm, 200) is None and pick(biased.decode_gemm, 2) == GemmConfig(**SMALL)
    assert pick(plain.decode_gemm, 200) is None  # the CPU: no cuBLASLt
    only_lt = parse_table({"shapes": {"48,32": [{"max_m": 256, "backend": "cublaslt", "config": LT}]}})
    layer = Linear(32, 48, bias=False)
    assert apply_decode_gemm(torch.nn.ModuleList([layer]), only_lt) == 0 and layer.decode_gemm is None
    with pytest.raises(ValueError, match="backend 'cutlass' is none of"):
        parse_table({"shapes": {"48,32": [{"max_m": 4, "backend": "cutlass", "config": {}}]}})


def test_a_table_timed_under_another_cublaslt_warns_once(monkeypatch):
    """Where layers take cuBLASLt entries (the GPU's branch, entered here by stubbing what it
    asks of the device), a table measured under another cuBLASLt version warns once; under this
    version, or for layers that take none, it stays silent."""
    import warnings

    from tandem.kernels import cublaslt
    from tandem.layers import decode_gemm

    monkeypatch.setattr(decode_gemm, "_can_run_cublaslt", lambda layer: True)
    monkeypatch.setattr(cublaslt, "prepare", lambda device: None)
    monkeypatch.setattr(cublaslt, "version", lambda: 130100)
    raw = {"shapes": {"48,32": [{"max_m": 256, "backend": "cublaslt", "config": LT}]}}
    for version, warns in ((120900, 1), (130100, 0)):
        layers = torch.nn.ModuleList([Linear(32, 48, bias=False), Linear(32, 48, bias=False)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert apply_decode_gemm(layers, parse_table({**raw, "cublaslt_version": version})) == 2
        assert len([w for w in caught if "cuBLASLt [120900]" in str(w.message)]) == warns
        assert pick(layers[0].decode_gemm, 100) == cublaslt.LtAlgo(**LT)


def test_a_cublaslt_choice_off_the_gpu_is_f_linear():
    """`cublaslt.linear` runs `F.linear` where it cannot run the algorithm (here: a CPU tensor),
    so a layer holding a cuBLASLt choice is never wrong, only unaccelerated."""
    from tandem.kernels import cublaslt
    from tandem.layers.linear import linear

    x, w = torch.randn(5, 32), torch.randn(48, 32)
    algo = cublaslt.LtAlgo(**LT)
    assert not cublaslt.supports(x, w)
    assert torch.equal(cublaslt.linear(x, w, algo), torch.nn.functional.linear(x, w))
    with torch.no_grad():
        assert torch.equal(linear(x, w, None, (GemmChoice(256, algo),)), torch.nn.functional.linear(x, w))


@pytest.mark.gpu
def test_a_bias_free_layer_runs_its_cublaslt_bucket_on_the_gpu(monkeypatch):
    from tandem.kernels import cublaslt

    calls = []
    lt_linear = cublaslt.linear
    monkeypatch.setattr(cublaslt, "linear", lambda *a: calls.append(a[0].shape[0]) or lt_linear(*a))
    N, K = 1536, 8960
    algo = cublaslt.heuristic_algos(256, N, K, torch.bfloat16, torch.device("cuda"))[0]
    raw = {"shapes": {f"{N},{K}": [{"max_m": 64, "backend": "cublas", "config": None},
                                   {"max_m": 256, "backend": "cublaslt", "config": vars(algo)}]}}
    layer = Linear(K, N, bias=False).to("cuda", torch.bfloat16)
    assert apply_decode_gemm(torch.nn.ModuleList([layer]), parse_table(raw)) == 1
    with torch.no_grad():
        for m in (32, 200, 256, 300):
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight),
                                       atol=2e-2, rtol=2e-2)
    assert calls == [200, 256]  # its bucket only: cuBLAS at 32 rows and past the table


def test_config_refuses_an_unknown_choice(tmp_path):
    with pytest.raises(ValueError,
                       match="decode_gemm must be 'auto', 'cublas', 'triton' or an existing"):
        config.EngineConfig(decode_gemm="cutlass")
    with pytest.raises(ValueError, match="decode_gemm"):
        config.EngineConfig(decode_gemm=str(tmp_path / "missing.json"))


def test_engine_greedy_tokens_unchanged_with_the_triton_gemm(tmp_path, monkeypatch):
    """Every GEMM of a tiny Qwen2 (q/k/v with bias, o, gate/up, down) through the Triton kernel
    (interpreted) for steps of up to 4 rows: the greedy tokens cuBLAS's path gives."""
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table([(128, 64), (64, 64), (256, 64), (64, 128)])))
    calls = []
    linear = kernel.linear
    monkeypatch.setattr(kernel, "linear", lambda *a, **k: calls.append(1) or linear(*a, **k))
    model = make_tiny_model("qwen2")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 11], [7, 3, 4, 4, 8, 1, 2], [20, 21]]

    def tokens(gemm):
        llm = LLM(model, attention_backend="triton", device=DEVICE, block_size=8, max_num_seqs=4,
                  decode_gemm=gemm, dtype="float32")
        assert llm.llm_engine.worker.decode_gemm_layers == (0 if gemm == "cublas" else 8)
        return [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

    want = tokens("cublas")
    assert not calls
    assert tokens(str(path)) == want
    assert calls  # decode steps (3 rows) ran the kernel
    # the down projection with the activation in its GEMM (`TANDEM_FUSED_SILU_DOWN`)
    from tandem.layers import linear as linear_layers

    fused = []
    silu_and_mul_linear = kernel.silu_and_mul_linear
    monkeypatch.setattr(kernel, "silu_and_mul_linear",
                        lambda *a, **k: fused.append(1) or silu_and_mul_linear(*a, **k))
    monkeypatch.setattr(linear_layers, "FUSED_SILU_DOWN", True)
    assert tokens(str(path)) == want
    assert fused


def test_auto_is_the_default_and_means_cublas_where_no_table_was_measured(tmp_path, monkeypatch):
    """"auto" loads this device's table when tandem ships one and is cuBLAS alone otherwise, where
    "triton" refuses; the CPU engine never runs the kernel under "auto"."""
    from tandem.layers import decode_gemm as layer

    assert config.EngineConfig().decode_gemm == "auto"
    cpu = torch.device("cpu")
    monkeypatch.setattr(layer, "CONFIG_DIR", str(tmp_path))
    assert layer.table_path("auto", cpu) is None and layer.load_table("auto", cpu) == {}
    with pytest.raises(ValueError, match="decode_gemm='triton': no table for this device"):
        layer.load_table("triton", cpu)
    (tmp_path / "decode_gemm_cpu.json").write_text(json.dumps(table([(48, 32)])))
    want = parse_table(table([(48, 32)]))
    assert layer.load_table("auto", cpu) == layer.load_table("triton", cpu) == want
    if DEVICE == "cpu":
        llm = LLM(make_tiny_model("qwen2"), device="cpu", max_num_seqs=2, dtype="float32")
        assert llm.llm_engine.worker.decode_gemm_layers == 0


def test_the_shipped_tables_cover_the_presets_decode_shapes():
    """The H200 table: every decode GEMM of the presets it was measured on, buckets from 1 row up
    to 256 (past the last, cuBLAS), each Triton or cuBLASLt entry faster than cuBLAS there by the
    margin (and cuBLASLt's for bias-free shapes only)."""
    import os

    from tandem.bench.gemm import decode_shapes
    from tandem.layers.decode_gemm import CONFIG_DIR

    with open(os.path.join(CONFIG_DIR, "decode_gemm_NVIDIA_H200.json")) as f:
        raw = json.load(f)
    assert raw["device"] == "NVIDIA H200" and raw["dtype"] == "bfloat16"
    parsed = parse_table(raw)
    for model in ("qwen2.5-1.5b", "qwen2.5-7b", "smollm2-135m"):
        for shape in decode_shapes(model):
            choices = parsed[(shape["N"], shape["K"])]
            assert [c.max_m for c in choices] == [1, 4, 16, 32, 64, 128, 256], (model, shape["op"])
            if shape["bias"]:  # cuBLASLt's path has none
                assert not any(isinstance(c.config, LtAlgo) for c in choices)
    for entries in raw["shapes"].values():
        for e in entries:
            if e["backend"] == "triton":
                assert e["cublas_us"] >= 1.03 * e["triton_us"], e
            elif e["backend"] == "cublaslt":  # across its bucket: both ends, summed, and each
                probes = e["cublaslt_probes"].values()
                assert str(e["max_m"]) in e["cublaslt_probes"], e
                assert all(p["us"] <= p["cublas_us"] for p in probes), e
                assert sum(p["cublas_us"] for p in probes) >= 1.03 * sum(p["us"] for p in probes), e


SM90 = {"block_m": 128, "block_n": 96, "stages": 4, "cluster_m": 2, "split_k": 4}


def test_sm90_entries_run_only_on_hopper_and_reach_the_kernel(monkeypatch):
    """A table's cluster GEMM entry: parsed into its config; a layer off a Hopper GPU (here: the
    CPU) keeps cuBLAS in that bucket; where it may run, the layer calls the kernel with it."""
    from tandem.kernels import sm90_gemm
    from tandem.kernels.sm90_gemm import Sm90GemmConfig
    from tandem.layers import decode_gemm

    raw = {"shapes": {"48,32": [{"max_m": 256, "backend": "sm90", "config": SM90}]}}
    parsed = parse_table(raw)
    assert pick(parsed[(48, 32)], 200) == Sm90GemmConfig(**SM90)
    layer = Linear(32, 48, bias=True)
    assert apply_decode_gemm(torch.nn.ModuleList([layer]), parsed) == 0 and layer.decode_gemm is None

    monkeypatch.setattr(decode_gemm, "_can_run_sm90", lambda layer, glu=False: True)
    calls = []
    # a layer's weight is a parameter: its first tiles may load before the PDL wait
    monkeypatch.setattr(sm90_gemm, "linear", lambda x, w, b, cfg, static_weight: calls.append(
        (cfg, static_weight)) or torch.nn.functional.linear(x, w, b))
    assert apply_decode_gemm(torch.nn.ModuleList([layer]), parsed) == 1
    with torch.no_grad():
        layer(torch.randn(200, 32))
        layer(torch.randn(300, 32))  # past the table: cuBLAS
    assert calls == [(Sm90GemmConfig(**SM90), True)]


def test_sm90_needs_a_hopper_gpu_and_a_shape_it_takes():
    from tandem.layers.decode_gemm import _can_run_sm90

    assert not _can_run_sm90(Linear(32, 48))  # the CPU
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability() == (9, 0)
        assert _can_run_sm90(Linear(32, 48).cuda().to(torch.bfloat16)) == hopper
        assert not _can_run_sm90(Linear(32, 44).cuda().to(torch.bfloat16))  # N % 8


def test_an_mlp_whose_gate_up_entry_fuses_the_activation_runs_one_launch_for_both(monkeypatch):
    """`apply_mlp`: where the gate/up layer's entry for the rows is `sm90-glu`, the fused kernel
    (here a stand-in computing the same thing) then the down projection; other rows, autograd
    and the batch-invariant mode take the unfused path; called alone, the layer runs the plain
    cluster GEMM with that config (the same product, no activation)."""
    from tandem.kernels import sm90_gemm
    from tandem.kernels.sm90_gemm import Sm90GluConfig
    from tandem.layers import decode_gemm
    from tandem.layers import linear as linear_layers
    from tandem.layers.activation import SiluAndMul
    from tandem.layers.linear import MergedLinear

    glu = {"block_m": 128, "block_n": 144, "stages": 4, "cluster_m": 2, "split_k": 1}
    raw = {"shapes": {"48,32": [{"max_m": 8, "backend": "sm90-glu", "config": glu}]}}
    parsed = parse_table(raw)
    assert pick(parsed[(48, 32)], 8) == Sm90GluConfig(**glu)
    gate_up, down, act = MergedLinear(32, [24, 24], [0, 1], False), Linear(24, 32), SiluAndMul()
    assert apply_decode_gemm(torch.nn.ModuleList([gate_up]), parsed) == 0  # the CPU: unfused

    monkeypatch.setattr(decode_gemm, "_can_run_sm90", lambda layer, glu=False: glu)
    calls = []

    def fused(x, w, b, cfg, static_weight):
        assert static_weight  # a parameter
        calls.append((x.shape[0], cfg))
        return act(torch.nn.functional.linear(x, w, b))

    monkeypatch.setattr(sm90_gemm, "gate_up_silu", fused)
    monkeypatch.setattr(sm90_gemm, "linear", lambda x, w, b, cfg, **k: calls.append(("plain", cfg)) or
                        torch.nn.functional.linear(x, w, b))
    assert apply_decode_gemm(torch.nn.ModuleList([gate_up]), parsed) == 1
    with torch.no_grad():
        x = torch.randn(5, 32)
        want = down(act(torch.nn.functional.linear(x, gate_up.weight)))
        torch.testing.assert_close(linear_layers.apply_mlp(gate_up, act, down, x), want)
        assert calls == [(5, Sm90GluConfig(**glu))]
        linear_layers.apply_mlp(gate_up, act, down, torch.randn(9, 32))  # past the bucket
        assert len(calls) == 1
        gate_up(x)  # the layer alone: the plain kernel
        assert calls[-1] == ("plain", Sm90GluConfig(**glu))
    linear_layers.apply_mlp(gate_up, act, down, torch.randn(5, 32, requires_grad=True)).sum().backward()
    assert len(calls) == 2
    with pytest.raises(ValueError, match="block_n=136"):
        parse_table({"shapes": {"48,32": [{"max_m": 8, "backend": "sm90-glu",
                                            "config": {**glu, "block_n": 136, "cluster_m": 1}}]}})
