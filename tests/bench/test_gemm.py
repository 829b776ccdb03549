"""The decode GEMM study's bookkeeping (shapes, table, savings); the timing itself needs a GPU."""

import json

import pytest

from tandem.bench.gemm import decode_shapes, make_table, split_candidates, step_savings


def test_decode_shapes_of_qwen25_15b():
    shapes = {s["op"]: (s["N"], s["K"], s["bias"]) for s in decode_shapes("qwen2.5-1.5b")}
    assert shapes == {"qkv": (2048, 1536, True), "o": (1536, 1536, False),
                      "gate_up": (17920, 1536, False), "down": (1536, 8960, False)}
    assert {s["op"]: s["N"] for s in decode_shapes("qwen2.5-7b")}["qkv"] == 3584 + 2 * 512


def test_decode_shapes_of_a_model_directory_follow_the_decoder(tmp_path):
    """A directory's config.json, as the engine builds it: Qwen3's head_dim is not hidden / heads
    (q is 16 x 128 = 2048 wide against a hidden size of 1024), and a Llama with attention_bias has
    biases on q/k/v and o, with mlp_bias on gate/up and down."""
    qwen3 = tmp_path / "qwen3"
    qwen3.mkdir()
    (qwen3 / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}))
    shapes = {s["op"]: (s["N"], s["K"], s["bias"], s["layers"]) for s in decode_shapes(str(qwen3))}
    assert shapes == {"qkv": (2048 + 2 * 1024, 1024, False, 28), "o": (1024, 2048, False, 28),
                      "gate_up": (6144, 1024, False, 28), "down": (1024, 3072, False, 28)}
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True, "vocab_size": 1000}))
    assert all(s["bias"] for s in decode_shapes(str(llama)))
    with pytest.raises(ValueError, match="not a local directory"):
        decode_shapes("no-such-model")


def test_split_candidates_keep_the_grid_near_the_sms():
    # 24 tiles of 128x128 at M=256, N=1536: up to 12 splits (288 programs <= 2.2 x 132)
    assert split_candidates(256, 1536, 8960, (128, 128, 64, 4), 132) == [1, 2, 3, 4, 5, 6, 8, 10, 12]
    assert split_candidates(64, 17920, 1536, (64, 128, 64, 4), 132) == [1, 2]


def best(model, M, N, K, us, speedup):
    return {"model": model, "op": "down", "layers": 28, "M": M, "N": N, "K": K,
            "impl": "triton-best", "us": us, "speedup_vs_cublas": speedup, "cublas_us": us * speedup,
            "config": {"block_m": 64, "block_n": 128, "block_k": 64, "split_k": 4,
                       "num_warps": 4, "num_stages": 4}}


def test_table_keeps_triton_only_where_it_wins():
    results = [best("m", 64, 1536, 8960, 10.0, 1.5), best("m", 256, 1536, 8960, 10.0, 1.01),
               {"impl": "cublas", "M": 64, "N": 1536, "K": 8960, "us": 15.0}]
    table = make_table(results, "NVIDIA H200", "bfloat16", margin=0.03)
    entries = table["shapes"]["1536,8960"]
    assert [e["max_m"] for e in entries] == [64, 256]
    assert entries[0]["backend"] == "triton" and entries[0]["config"]["split_k"] == 4
    assert entries[1]["backend"] == "cublas" and entries[1]["config"] is None
    s = step_savings(results)["m@64"]
    assert abs(s["cublas_ms"] - 28 * 15e-3) < 1e-9 and abs(s["saved_ms"] - 28 * 5e-3) < 1e-9


def lt_best(M, us, speedup):
    return {"model": "m", "op": "down", "layers": 28, "M": M, "N": 1536, "K": 8960, "impl": "cublaslt-best",
            "us": us, "speedup_vs_cublas": speedup, "deterministic": True, "cublas_us": us * speedup,
            "config": {"algo_id": 66, "tile": 28, "split_k": 4, "reduction": 2, "swizzle": 0, "custom": 0,
                       "stages": 35, "inner_shape": 0, "cluster": 3}}


def test_table_takes_the_fastest_winner_and_merges_an_earlier_table():
    """Per (N, K, M): the faster of Triton's and cuBLASLt's bests where it beats cuBLAS by the
    margin; a merged earlier table keeps its entries for buckets this run did not measure, and
    loses those it did."""
    results = [best("m", 64, 1536, 8960, 10.0, 1.5), lt_best(64, 12.0, 1.25),  # Triton faster
               best("m", 128, 1536, 8960, 14.0, 1.0), lt_best(128, 12.5, 1.12),  # cuBLASLt
               lt_best(256, 15.0, 1.01),  # neither: cuBLAS
               {**lt_best(32, 5.0, 2.0), "deterministic": False},  # not repeatable: cuBLAS
               {"impl": "cublas", "M": 512, "N": 1536, "K": 8960, "us": 30.0},  # measured, no rival
               {"impl": "cublas", "M": 1024, "N": 1536, "K": 8960, "us": None}]  # failed: no entry
    earlier = {"device": "NVIDIA H200", "dtype": "bfloat16", "shapes": {
        "1536,8960": [{"max_m": 1, "backend": "triton", "config": {"block_m": 16}, "triton_us": 3.0,
                       "cublas_us": 4.0},
                      {"max_m": 64, "backend": "cublas", "config": None, "cublas_us": 9.0}],
        "2048,1536": [{"max_m": 1, "backend": "cublas", "config": None}]}}
    table = make_table(results, "NVIDIA H200", "bfloat16", margin=0.03, base=earlier)
    entries = {e["max_m"]: e for e in table["shapes"]["1536,8960"]}
    assert sorted(entries) == [1, 32, 64, 128, 256, 512]
    assert entries[512] == {"max_m": 512, "backend": "cublas", "config": None, "cublas_us": 30.0}
    assert entries[1]["triton_us"] == 3.0  # kept
    assert entries[64]["backend"] == "triton" and entries[64]["cublaslt_us"] == 12.0
    assert entries[128]["backend"] == "cublaslt" and entries[128]["config"]["split_k"] == 4
    assert entries[128]["cublas_us"] == 14.0 and entries[128]["triton_us"] == 14.0
    assert entries[256]["backend"] == "cublas" and entries[256]["config"] is None
    assert entries[32]["backend"] == "cublas"
    assert table["shapes"]["2048,1536"] == earlier["shapes"]["2048,1536"]
    assert "cublaslt_version" in table
    s = step_savings(results)["m@128"]
    assert abs(s["cublas_ms"] - 28 * 14e-3) < 1e-9 and abs(s["saved_ms"] - 28 * 1.5e-3) < 1e-9


def test_a_bucket_starts_past_the_largest_row_below_it():
    from tandem.bench.gemm import bucket_floor

    earlier = {"shapes": {"8,4": [{"max_m": 1}, {"max_m": 64}], "4,4": [{"max_m": 32}]}}
    assert bucket_floor(256, [128, 256], None) == 129
    assert bucket_floor(128, [128, 256], None) == 1
    assert bucket_floor(128, [128, 256], earlier) == 65  # the merged table's 64-row bucket
    assert bucket_floor(1, [1, 4], earlier) == 1


def test_sm90_candidates_stay_in_one_cluster_and_one_wave_when_split():
    from tandem.bench.gemm import sm90_candidates
    from tandem.kernels.sm90_gemm import default_config

    for M, N, K in [(256, 1536, 8960), (256, 2048, 1536), (16, 960, 576), (128, 17920, 1536)]:
        configs = sm90_candidates(M, N, K, 132, quick=False)
        assert configs[0] == default_config(M, N, K, 132) and len(set(configs)) == len(configs)
        for c in configs:
            tiles = (-(-(-(-M // c.block_m)) // c.cluster_m) * c.cluster_m
                     * -(-(-(-N // c.block_n)) // c.cluster_n) * c.cluster_n)
            assert c.cluster_size <= 8 and -(-K // 64) >= 2 * c.split_k
            assert c.split_k == 1 or tiles * c.split_k <= 1.1 * 132
            assert c.cluster_m == 1 or c.cluster_n == 1  # one operand shared at a time
        # 64-row tiles up to 64 rows; 128 up to 128; then also every row in one tile
        assert {c.block_m for c in configs} == ({64} if M <= 64 else {128} if M <= 128 else {128, 256})
    quick = sm90_candidates(256, 1536, 8960, 132, quick=True)
    assert {c.cluster_m for c in quick} == {1, 2} and {c.stages for c in quick} == {4}
    assert {c.cluster_n for c in quick} == {1, 2, 4}
    assert any(c.split_k == 4 and c.block_n == 96 for c in quick)
    # 256 rows in one tile of 136 columns: Qwen2.5-1.5B's gate/up in 132 CTAs, one wave
    assert any(c.block_m == 256 and c.block_n == 136 and c.split_k == 1
               for c in sm90_candidates(256, 17920, 1536, 132, quick=True))
    assert {c.block_m for c in sm90_candidates(160, 1536, 1536, 132, quick=True)} == {128, 192, 256}
    # from 128 rows, consumer warpgroups of 64 or 128 rows (one or two wgmmas a k step)
    assert {(c.block_m, c.warpgroup_m) for c in quick} == {(128, 64), (128, 128), (256, 64), (256, 128)}


def test_glu_candidates_count_output_columns_as_half_the_tile():
    """With the activation fused a tile of block_n weight rows makes block_n / 2 output columns:
    gate/up at 256 rows (I = 8960) in 144-row tiles is 125 x 2 M tiles = 250 CTAs, under 2 waves."""
    from tandem.bench.gemm import sm90_candidates

    configs = sm90_candidates(256, 8960, 1536, 132, quick=True, glu=True)
    assert configs and all(c.block_n in (96, 128, 144, 192, 256) for c in configs)
    for c in configs:
        tiles = 2 * -(-8960 // (c.block_n // 2))
        assert c.split_k == 1 or tiles * c.split_k <= 1.1 * 132
    assert any(c.block_n == 144 and c.cluster_m == 2 for c in configs)


def test_the_fused_gate_up_competes_with_the_chosen_gemm_plus_the_activation():
    """An `sm90-glu-best` row (its "cublas_us": cuBLAS's GEMM then the activation kernel) takes
    the bucket only if it beats the GEMM the table chose plus the activation: here cuBLAS 20 us,
    the activation 4 us (pair 24), the plain cluster GEMM 18 us: the fused one must beat 22."""
    from tandem.bench.gemm import make_table

    def rows(glu_us):
        return [{"impl": "cublas", "M": 256, "N": 17920, "K": 1536, "us": 20.0},
                {"impl": "sm90-glu-best", "M": 256, "N": 17920, "K": 1536, "us": glu_us,
                 "cublas_us": 24.0, "speedup_vs_cublas": 24.0 / glu_us, "deterministic": True,
                 "config": {"block_m": 128, "block_n": 144, "stages": 4, "cluster_m": 2, "split_k": 1}},
                {"impl": "sm90-best", "M": 256, "N": 17920, "K": 1536, "us": 18.0, "cublas_us": 20.0,
                 "speedup_vs_cublas": 20.0 / 18.0, "deterministic": True,
                 "config": {"block_m": 128, "block_n": 96, "stages": 4, "cluster_m": 2, "split_k": 1}}]

    won = make_table(rows(21.0), "NVIDIA H200", "bfloat16", margin=0.03)["shapes"]["17920,1536"][0]
    assert won["backend"] == "sm90-glu" and won["activation_us"] == 4.0 and won["config"]["block_n"] == 144
    lost = make_table(rows(22.5), "NVIDIA H200", "bfloat16", margin=0.03)["shapes"]["17920,1536"][0]
    assert lost["backend"] == "sm90" and lost["config"]["block_n"] == 96


def test_sm90_sweeps_add_the_fused_activation_for_gate_up_only():
    """One list of candidates a shape, which both the sweeps and the parallel precompile use."""
    from tandem.bench.gemm import sm90_candidates, sm90_sweeps
    from tandem.kernels.sm90_gemm import Sm90GluConfig

    gate_up = {"op": "gate_up", "N": 17920, "K": 1536}
    sweeps = sm90_sweeps(gate_up, 64, 132, quick=True)
    assert sweeps[False] == sm90_candidates(64, 17920, 1536, 132, True)
    assert sweeps[True] == sm90_candidates(64, 8960, 1536, 132, True, glu=True)
    assert all(isinstance(c, Sm90GluConfig) for c in sweeps[True])
    assert list(sm90_sweeps({"op": "down", "N": 1536, "K": 8960}, 64, 132, quick=True)) == [False]


def test_wave_widths_fill_the_last_wave_of_a_multi_wave_shape():
    """Qwen2.5-7B's gate/up at 256 rows (N = 37888): 144-row tiles make 264 = 2 x 132 CTAs,
    where 128 or 136 leave a third wave 11% or 6% full; a shape of one wave or less gets none."""
    from tandem.bench.gemm import sm90_candidates, wave_widths

    widths = wave_widths(1, 37888, 132)
    assert widths[0] == 144 and len(widths) == 2
    for w in widths:
        tiles = -(-37888 // w)
        assert tiles > 132 and tiles / (-(-tiles // 132) * 132) > 0.9
    assert wave_widths(1, 18944, 132, glu=True)[0] == 144  # 72 output columns a tile: 264 CTAs
    assert wave_widths(1, 2048, 132) == () and wave_widths(1, 4608, 132) == ()
    assert any(c.block_m == 256 and c.block_n == 144 and c.split_k == 1
               for c in sm90_candidates(256, 37888, 3584, 132, quick=True))
