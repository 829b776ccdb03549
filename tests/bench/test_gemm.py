"""The decode GEMM study's bookkeeping (shapes, table, savings); the timing itself needs a GPU."""

from tandem.bench.gemm import decode_shapes, make_table, split_candidates, step_savings


def test_decode_shapes_of_qwen25_15b():
    shapes = {s["op"]: (s["N"], s["K"], s["bias"]) for s in decode_shapes("qwen2.5-1.5b")}
    assert shapes == {"qkv": (2048, 1536, True), "o": (1536, 1536, False),
                      "gate_up": (17920, 1536, False), "down": (1536, 8960, False)}
    assert {s["op"]: s["N"] for s in decode_shapes("qwen2.5-7b")}["qkv"] == 3584 + 2 * 512


def test_split_candidates_keep_the_grid_near_the_sms():
    # 24 tiles of 128x128 at M=256, N=1536: up to 12 splits (288 programs <= 2.2 x 132)
    assert split_candidates(256, 1536, 8960, (128, 128, 64, 4), 132) == [1, 2, 3, 4, 5, 6, 8, 10, 12]
    assert split_candidates(64, 17920, 1536, (64, 128, 64, 4), 132) == [1, 2]


def best(model, M, N, K, us, speedup):
    return {"model": model, "op": "down", "layers": 28, "M": M, "N": N, "K": K,
            "impl": "triton-best", "us": us, "speedup_vs_cublas": speedup,
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
