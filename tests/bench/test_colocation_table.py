"""bench colocation's table (the measurement itself needs a GPU)."""

from tandem.bench.colocation import print_table


def test_table_shows_both_wakes_and_the_mapping_breakdown(capsys):
    r = {"backend": "cumem", "sleep2_freed_share_median": 1.001, "wake_plus_update_s_median": 0.053,
         "wake_plus_update_back_to_back_s_median": 0.207, "sleep1_plus_wake_after_turn_s_median": 0.121,
         "sleep1_plus_wake_s_median": 0.308, "greedy_identical_after_wake": True,
         "wake_weights_s_median": 0.019, "wake_kv_cache_s_median": 0.006, "wake_kv_cache_map_s_median": 0.006,
         "wake_kv_cache_cu_mem_create_s_median": 0.004, "wake_kv_cache_cu_mem_map_s_median": 0.0,
         "wake_kv_cache_cu_mem_set_access_s_median": 0.002, "update_s_median": 0.016}
    print_table({"cumem": r}, 1.0)
    out = capsys.readouterr().out
    assert "after 1 s" in out and "back to back" in out
    row = next(line for line in out.splitlines() if line.startswith("cumem"))
    assert row.split() == ["cumem", "100.1%", "0.053", "0.207", "0.121", "0.308", "True"]
    assert "cuMemCreate 0.004s" in out
