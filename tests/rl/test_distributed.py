"""Data-parallel GRPO on a CPU: two gloo ranks, each with its own engine and half the prompts, take
the same optimizer step as one process on the whole batch; checkpoints come from rank 0."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from datasets import Dataset
from model_fixtures import make_tiny_model, make_tokenizer
from spawn_ranks import spawn_ranks

from tandem.rl import GRPOConfig, GRPOTrainer
from tandem.rl.distributed import DistributedContext

TARGET = 42
WORLD = 2
LOSS_TYPES = ("dapo", "grpo")
PROMPTS = ["Hello, my name is", "The capital of France is", "What is 2 + 3?", "Once upon a time",
           "one two three", "The answer is", "I generate text", "small model"]
# Global batch: 4 prompts x 4 generations = 16 completions in micro-batches of 4, one optimizer
# step. One process accumulates 4 micro-batches; each of the 2 ranks accumulates its own 2.
NUM_GENERATIONS, MICRO, GLOBAL_MICRO_BATCHES = 4, 4, 4
# Token-budget micro-batches on each rank (40 = max_prompt_length + max_completion_length); SGD, so
# equal weights after the step are equal gradients (Adam would magnify rounding in near-0 ones).
BUDGET = {"padding_free": True, "max_tokens_per_micro_batch": 40, "optim": "sgd"}


def target_share(prompts, completions, completion_ids, **kwargs):
    return [sum(t == TARGET for t in ids) / max(1, len(ids)) for ids in completion_ids]


def make_trainer(output_dir, loss_type: str, world_size: int, **overrides) -> GRPOTrainer:
    cfg = GRPOConfig(
        output_dir=str(output_dir), num_generations=NUM_GENERATIONS, per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GLOBAL_MICRO_BATCHES // world_size, max_completion_length=8,
        max_prompt_length=32, learning_rate=1e-2, max_steps=4, temperature=1.0, report_to="none",
        gradient_checkpointing=False, lr_scheduler_type="constant", seed=0, loss_type=loss_type,
        vllm_gpu_memory_utilization=0.1, save_steps=10**6, **overrides,
    )
    return GRPOTrainer(make_tiny_model("llama", seed=3), target_share, cfg,
                       train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                       processing_class=make_tokenizer(), engine_kwargs={"device": "cpu"})


def _snapshot(trainer: GRPOTrainer, metrics: dict) -> dict:
    return {"metrics": metrics, "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}


def _rank(rank: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        for loss_type in LOSS_TYPES:
            trainer = make_trainer(os.path.join(out_dir, loss_type), loss_type, WORLD)
            assert trainer.dist.world_size == WORLD and trainer.dist.rank == rank
            metrics = trainer.step()
            torch.save(_snapshot(trainer, metrics), os.path.join(out_dir, f"{loss_type}-rank{rank}.pt"))
        # Rank 0 writes the checkpoint; every rank resumes from it into a fresh trainer.
        path = trainer.save_checkpoint()
        resumed = make_trainer(os.path.join(out_dir, "resumed"), LOSS_TYPES[-1], WORLD)
        resumed._resume(str(path))
        torch.save({"global_step": resumed.global_step, "sampler": resumed.sampler.state_dict(),
                    "weights": resumed.model.state_dict(),
                    "checkpoints": sorted(os.listdir(os.path.join(out_dir, LOSS_TYPES[-1])))},
                   os.path.join(out_dir, f"resumed-rank{rank}.pt"))
        budget = make_trainer(os.path.join(out_dir, "budget"), "grpo", WORLD, **BUDGET)
        torch.save(_snapshot(budget, budget.step()), os.path.join(out_dir, f"budget-rank{rank}.pt"))
        dist.barrier()  # neither rank tears its connections down while the other still uses them
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    """One spawn of 2 gloo ranks that runs every loss type; returns the output directory."""
    out = tmp_path_factory.mktemp("dp")
    spawn_ranks(_rank, WORLD, str(out / "store"), str(out), log_dir=out / "logs")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_data_parallel_step_equals_single_process_step(dp_run, tmp_path, loss_type):
    single = make_trainer(tmp_path, loss_type, world_size=1)
    ref = _snapshot(single, single.step())
    ranks = [torch.load(dp_run / f"{loss_type}-rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, got in enumerate(ranks):
        for name, w in ref["weights"].items():
            torch.testing.assert_close(got["weights"][name], w, atol=1e-6, rtol=0,
                                       msg=lambda m, r=r, name=name: f"rank {r} {name}: {m}")
        for key in ("loss", "reward", "reward_std", "frac_reward_zero_std", "grad_norm",
                    "completions/mean_length", "completions/num_tokens", "rewards/target_share/mean"):
            assert got["metrics"][key] == pytest.approx(ref["metrics"][key], abs=1e-6), (r, key)
    # the step really moved the weights
    before = make_tiny_model("llama", seed=3).state_dict()
    assert any(not torch.equal(before[k].float(), v) for k, v in ref["weights"].items())


@pytest.mark.slow
def test_data_parallel_token_budget_step_equals_the_fixed_single_process_step(dp_run, tmp_path):
    """Each rank splits its rows by the token budget; the ranks agree on how many micro-batches
    they run, and the step is the single process's with fixed padded micro-batches (grpo: each
    row's weight depends on its fixed micro-batch)."""
    single = make_trainer(tmp_path, "grpo", world_size=1, optim="sgd")
    ref = _snapshot(single, single.step())
    ranks = [torch.load(dp_run / f"budget-rank{r}.pt", weights_only=False) for r in range(WORLD)]
    assert ranks[0]["metrics"]["train/micro_batches"] == ranks[1]["metrics"]["train/micro_batches"] > 1
    for r, got in enumerate(ranks):
        for name, w in ref["weights"].items():
            torch.testing.assert_close(got["weights"][name], w, atol=1e-6, rtol=0,
                                       msg=lambda m, r=r, name=name: f"rank {r} {name}: {m}")
        for key in ("loss", "grad_norm", "train/tokens"):  # fp32: 1e-5 relative
            assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-6), (r, key)


@pytest.mark.slow
def test_data_parallel_checkpoint_from_rank_0_resumes_on_every_rank(dp_run):
    trained = torch.load(dp_run / f"{LOSS_TYPES[-1]}-rank0.pt", weights_only=False)["weights"]
    for r in range(WORLD):
        got = torch.load(dp_run / f"resumed-rank{r}.pt", weights_only=False)
        assert got["checkpoints"] == ["checkpoint-1"]  # written once, by rank 0
        assert got["global_step"] == 1
        assert got["sampler"]["position"] == 1 and got["sampler"]["batch_size"] == 4  # global batch
        for name, w in trained.items():
            torch.testing.assert_close(got["weights"][name], w, atol=0, rtol=0)


def test_one_process_context_is_the_identity():
    ctx = DistributedContext()
    assert ctx.is_main and not ctx.enabled and ctx.world_size == 1
    assert ctx.shard([5, 1, 7]) == [5, 1, 7] and ctx.shard_offset(3) == 0
    t = torch.tensor([1.0, 2.0])
    assert ctx.all_reduce_sum(t) is t and ctx.all_gather(t) is t
    assert ctx.sum_dicts({"a": 1.0}) == {"a": 1.0}


def test_shard_gives_each_rank_a_contiguous_slice_of_whole_prompts():
    indices = [9, 3, 4, 0, 7, 1]
    slices = [DistributedContext(r, 3).shard(indices) for r in range(3)]
    assert slices == [[9, 3], [4, 0], [7, 1]]
    assert [DistributedContext(r, 3).shard_offset(2) for r in range(3)] == [0, 2, 4]
    with pytest.raises(ValueError, match="multiple of the world size"):
        DistributedContext(0, 4).shard(indices)
    with pytest.raises(ValueError, match="outside"):
        DistributedContext(2, 2)
