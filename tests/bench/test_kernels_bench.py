"""`python -m tandem.bench.kernels --baseline FILE`: another decode_attention.py loads beside the
current one (the GPU timing itself runs on the H200 only)."""

import argparse
import inspect
import sys

from tandem.bench.kernels import load_module, merge_variants, order_lengths, sweep, sweep_configs
from tandem.kernels import decode_attention


def test_a_baseline_decode_attention_file_loads_with_its_dataclasses(tmp_path):
    path = tmp_path / "old_decode_attention.py"
    path.write_text(inspect.getsource(decode_attention))
    module = load_module(str(path))
    try:
        assert module is not decode_attention
        cfg = module.decode_config(2, 128, __import__("torch").bfloat16)
        assert isinstance(cfg, module.DecodeConfig) and cfg.heads_kv == 2
        assert callable(module.rotary_store_decode_attention)
    finally:
        sys.modules.pop("decode_attention_baseline", None)


def test_sweep_times_every_config_at_every_split_count():
    """`--sweep`: each config of the grid at each `--splits` count; the table shows the ten
    fastest and every launch that failed, the JSON every row."""
    args = argparse.Namespace(kv_heads=2, head_dim=128, splits=[1, 4])
    calls = []

    class FakeBench:
        def run(self, fn, label, num_splits, config):
            calls.append((config, num_splits))
            if config.num_stages == 5 and config.block_n == 64:
                return {"kernel": label, "error": "OutOfResources"}
            return {"kernel": label, "us": 100.0 - len(calls)}

    shown, swept = sweep(FakeBench(), None, "sweep fused", args)
    configs = sweep_configs(args)
    assert calls == [(c, s) for c in configs for s in (1, 4)] and len(swept) == len(calls)
    timed = [r for r in shown if "us" in r]
    assert [r["us"] for r in timed] == sorted(r["us"] for r in swept if "us" in r)[:10]
    assert sum("error" in r for r in shown) == sum("error" in r for r in swept) > 0


def test_merge_variants_time_the_default_config_merged_the_other_way():
    """Where the keys are split (the default count and every `--splits` count above one), the
    default config again with `fused_merge` flipped; one split has nothing to merge."""
    calls = []

    class FakeBench:
        def run(self, fn, label, num_splits, config):
            calls.append((label, num_splits, config))
            return {"kernel": label, "us": 1.0}

    cfg = decode_attention.DecodeConfig(2, 32, 4, 5)
    args = argparse.Namespace(splits=[1, 2, 8])
    merge_variants(FakeBench(), None, "fused, ", cfg, 4, args)
    assert [(label, n) for label, n, _ in calls] == [("fused, merge in kernel", n) for n in (2, 4, 8)]
    assert all(c == decode_attention.DecodeConfig(2, 32, 4, 5, fused_merge=True) for *_, c in calls)
    calls.clear()
    merge_variants(FakeBench(), None, "", decode_attention.DecodeConfig(2, 32, 4, 5, True), 1, args)
    assert [(label, n, c.fused_merge) for label, n, c in calls] == [("merge kernel", 2, False),
                                                                    ("merge kernel", 8, False)]


def test_order_lengths_keeps_the_lengths_and_balances_the_rounds():
    """The same lengths in every order; "snake" gives programs dealt to the SMs in turn (one
    sequence per SM a round here) about the same keys on every SM: per-SM sums within 150 keys of
    each other (88 here), where "longest" leaves them 1,278 apart and "drawn" 3,250."""
    import random

    rng = random.Random(0)
    lens = [rng.randint(100, 1400) for _ in range(256)]
    sms, per_seq = 64, 1
    for order in ("drawn", "longest", "snake"):
        assert sorted(order_lengths(lens, order, per_seq, sms)) == sorted(lens)
    assert order_lengths(lens, "drawn", per_seq, sms) == lens
    assert order_lengths(lens, "longest", per_seq, sms) == sorted(lens, reverse=True)

    def spread(order):  # sequence i's program on SM i % sms
        per_sm = [0] * sms
        for i, n in enumerate(order_lengths(lens, order, per_seq, sms)):
            per_sm[i % sms] += n
        return max(per_sm) - min(per_sm)

    assert spread("snake") < 150 < spread("longest") < spread("drawn")
    # two programs a sequence (kv-head blocks or splits): rounds of sms // 2 sequences
    two = order_lengths(lens, "snake", 2, sms)
    assert two[:32] == sorted(lens, reverse=True)[:32] and two[32:64] == sorted(lens, reverse=True)[32:64][::-1]
