"""`tandem bench rl` (tandem vs TRL) on a CPU: varied completion lengths hit exactly, by both
trainers' mechanisms; padding-free and token-budget micro-batches reach tandem's GRPOConfig; the
report counts real tokens; `--profile-train` writes the train phase's profiler table."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from model_fixtures import make_tiny_model, make_tokenizer

from tandem.bench.report import check_report
from tandem.bench.rl import RLBenchConfig, add_parser, run
from tandem.bench.rl_lengths import TRLLengths, completion_lengths, completion_range
from tandem.bench.rl_workload import model_and_data


def test_completion_range():
    assert completion_range(RLBenchConfig(completion_len=64)) == (64, 64)
    assert completion_range(RLBenchConfig(completion_len_dist="uniform:32-512")) == (32, 512)
    for bad in ("uniform:512-32", "normal:1-4", "uniform:0-8", "uniform:8"):
        with pytest.raises(ValueError, match="completion_len_dist must be 'uniform:LO-HI'"):
            completion_range(RLBenchConfig(completion_len_dist=bad))


def test_drawn_lengths_are_seeded_and_keyed_by_the_trainers_prompt_ids():
    tok = make_tokenizer()
    prompts = ["one two three", "Hello, my name is", "The answer is"]
    cfg = RLBenchConfig(completion_len_dist="uniform:2-40", prompt_len=3)
    a, b = completion_lengths(cfg, prompts, tok), completion_lengths(cfg, prompts, tok)
    assert a == b and all(2 <= n <= 40 for n in a.values())
    ids = tok(prompts, add_special_tokens=False)["input_ids"]
    assert set(a) == {tuple(x[-3:]) for x in ids}  # the last prompt_len tokens, as the trainer keeps
    other = completion_lengths(RLBenchConfig(completion_len_dist="uniform:2-40", prompt_len=3, seed=1), prompts, tok)
    assert other != a


def test_trl_lengths_end_each_row_of_transformers_generate_at_its_length():
    """What TRL calls without vLLM: `model.generate` on a left-padded batch; each row ends with EOS
    as its drawn length-th token."""
    model = make_tiny_model("llama")
    eos = model.config.eos_token_id
    rows = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    lengths = {tuple(r): n for r, n in zip(rows, [6, 1, 3])}
    ids = torch.zeros(3, 4, dtype=torch.long)
    mask = torch.zeros(3, 4, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 4 - len(r):], mask[i, 4 - len(r):] = torch.tensor(r), 1
    forced = TRLLengths(model, lengths, eos)
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=10, pad_token_id=0,
                         eos_token_id=eos)
    assert forced.calls == 1
    for row, n in zip(out[:, 4:].tolist(), [6, 1, 3]):
        assert row.index(eos) == n - 1, row  # no EOS before, EOS as the n-th token


def test_bench_rl_on_cpu_varied_lengths_token_budget_and_train_profile(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    make_tiny_model("llama").save_pretrained(model_dir)
    profile = tmp_path / "train_profile.txt"
    cfg = RLBenchConfig(model=str(model_dir), device="cpu", num_prompts=2, num_generations=2, prompt_len=6,
                        completion_len_dist="uniform:2-10", micro_batch=2, steps=1, cpu_kv_cache_space_gib=0.01,
                        padding_free=True, max_tokens_per_micro_batch=20, profile_train=str(profile),
                        num_scheduler_steps=4,  # the rollouts in decode windows: each row its drawn length still
                        output=str(tmp_path / "report.json"))
    run(cfg)
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    check_report(report)
    t = report["results"]["tandem"]
    # the timed step's prompts are the second batch (no shuffling): each completion its drawn length
    _, tok, data = model_and_data(cfg)
    lengths = completion_lengths(cfg, data["prompt"], tok)
    step_prompts = tok(list(data["prompt"])[2:4], add_special_tokens=False)["input_ids"]
    drawn = [lengths[tuple(p)] for p in step_prompts]
    assert t["completion_tokens_per_step"] == 2 * sum(drawn)
    assert t["train_tokens"] == 2 * sum(drawn) + 4 * 6  # real prompt + completion tokens, no padding
    # each prompt's 2 completions with the prompt once where they share a micro-batch
    assert t["share_prompts"] and 2 * sum(drawn) + 2 * 6 <= t["train_computed_tokens"] < t["train_tokens"]
    assert t["padding_free"] and t["max_tokens_per_micro_batch"] == 20 and t["num_scheduler_steps"] == 4
    assert t["micro_batches_per_step"] >= 2 and 0 < t["micro_batch_fill"] <= 1
    assert t["train_mfu"] is None  # no known peak on a CPU
    assert "mean len" in out and "drawn per prompt, uniform 2-10" in out
    assert "tandem train phase" in out and "real tokens" in out and "padding-free on" in out
    assert "computed (each prompt once a micro-batch)" in out
    assert t["reward_inside_train"] and "reward" in out and "(inside train" in out
    text = profile.read_text()
    assert text.startswith("# tandem bench rl --profile-train") and "sorted by self_cpu_time_total" in text
    assert "Self CPU" in text and "aten::" in text
    assert t["profile_train"]["file"] == str(profile)


def test_bad_combinations_are_refused_before_any_run():
    with pytest.raises(ValueError, match="--completion-len-dist, --padding-free apply to tandem vs TRL"):
        run(RLBenchConfig(compare="colocate,server", device="cpu", completion_len_dist="uniform:1-4",
                          padding_free=True))
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch .* needs padding_free=True"):
        run(RLBenchConfig(device="cpu", max_tokens_per_micro_batch=4096))
    with pytest.raises(ValueError, match="completion_len_dist must be"):
        run(RLBenchConfig(device="cpu", completion_len_dist="uniform:9-1"))


def test_cli_flags_reach_the_config(monkeypatch):
    from tandem import cli
    from tandem.bench import rl

    seen = []
    monkeypatch.setattr(rl, "run", seen.append)
    assert cli.main(["bench", "rl", "--completion-len-dist", "uniform:32-512", "--padding-free",
                     "--max-tokens-per-micro-batch", "16384", "--profile-train", "t.txt", "--no-share-prompts"]) == 0
    c = seen[0]
    assert (c.completion_len_dist, c.padding_free, c.max_tokens_per_micro_batch, c.profile_train) == (
        "uniform:32-512", True, 16384, "t.txt")
    assert c.share_prompts is False
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    a = p.parse_args(["rl"])
    assert (a.completion_len_dist, a.padding_free, a.max_tokens_per_micro_batch, a.profile_train) == (
        None, False, None, None)
    assert a.share_prompts is None
