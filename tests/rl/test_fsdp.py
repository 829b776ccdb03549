"""FSDP2 GRPO on a CPU: two gloo ranks with sharded parameters and optimizer state take the same
step as one process on the whole batch, fill their engines one FSDP unit at a time, and resume
from a rank-0 checkpoint exactly."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from datasets import Dataset
from model_fixtures import make_tiny_model, make_tokenizer
from spawn_ranks import spawn_ranks
from torch.distributed.tensor import DTensor

from tandem import LLM
from tandem.rl import GRPOConfig, GRPOTrainer
from tandem.rl import fsdp as fsdp_mod
from tandem.weights import sync as weight_sync_mod

WORLD = 2
TARGET = 42
PROMPTS = ["Hello, my name is", "The capital of France is", "What is 2 + 3?", "Once upon a time",
           "one two three", "The answer is", "I generate text", "small model"]
# Global batch: 4 prompts x 4 generations = 16 completions in micro-batches of 4, one optimizer step.
NUM_GENERATIONS, MICRO, GLOBAL_MICRO_BATCHES = 4, 4, 4


def target_share(prompts, completions, completion_ids, **kwargs):
    return [sum(t == TARGET for t in ids) / max(1, len(ids)) for ids in completion_ids]


def tied_model():
    # Tied embeddings: the harder case for sharding (one parameter, two names) and checkpoints.
    return make_tiny_model("llama", seed=3, tie_word_embeddings=True)


def make_trainer(output_dir, world_size: int, fsdp: bool, device: str = "cpu") -> GRPOTrainer:
    engine = {"device": "cpu", "cpu_kv_cache_space_gib": 0.05} if device == "cpu" else {}
    cfg = GRPOConfig(
        output_dir=str(output_dir), num_generations=NUM_GENERATIONS, per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GLOBAL_MICRO_BATCHES // world_size, max_completion_length=8,
        max_prompt_length=32, learning_rate=1e-2, max_steps=4, temperature=1.0, report_to="none",
        gradient_checkpointing=False, lr_scheduler_type="constant", seed=0, loss_type="dapo",
        vllm_gpu_memory_utilization=0.1, save_steps=10**6, fsdp=fsdp, bf16=False,
    )
    return GRPOTrainer(tied_model(), target_share, cfg, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                       processing_class=make_tokenizer(), engine_kwargs=engine)


def _full_weights(trainer: GRPOTrainer) -> dict:
    if fsdp_mod.is_sharded(trainer.model):
        return fsdp_mod.gather_state_dicts(trainer.model, trainer.optimizer)[0]
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _spy_on_units(trainer: GRPOTrainer, record: dict) -> None:
    """Count, at every tensor the engine receives, how many FSDP units are gathered in full."""
    units = fsdp_mod.fsdp_units(trainer.model)
    owned = [fsdp_mod._owned_parameter_names(u) for u in units]  # a unit's own, not its nested units'
    inner = trainer.generator.weight_sync.weights

    def spied():
        for name, t in inner():
            gathered = sum(any(not isinstance(u.get_parameter(n), DTensor) for n in names)
                           for u, names in zip(units, owned))
            record["max_gathered"] = max(record.get("max_gathered", 0), gathered)
            record["names"] = record.get("names", []) + [name]
            yield name, t

    trainer.generator.weight_sync.weights = spied


def _rank(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)

    def save(obj, name):
        torch.save(obj, os.path.join(out, f"{name}-rank{rank}.pt"))

    try:
        trainer = make_trainer(os.path.join(out, "straight"), WORLD, fsdp=True)
        assert isinstance(trainer.model.model.embed_tokens.weight, DTensor)
        m1 = trainer.step()
        save({"metrics": m1, "weights": _full_weights(trainer)}, "step1")
        spy: dict = {}
        _spy_on_units(trainer, spy)
        trainer.generator.sync()  # layer by layer into this rank's engine
        save({**spy, "engine": trainer.llm.llm_engine.model.state_dict(),
              "version": trainer.generator.weights_version}, "sync")
        trainer.step()
        path = trainer.save_checkpoint()
        m3 = trainer.step()
        save({"metrics": m3, "weights": _full_weights(trainer)}, "straight")

        resumed = make_trainer(os.path.join(out, "resumed"), WORLD, fsdp=True)
        resumed._resume(str(path))
        step = resumed.global_step
        m3r = resumed.step()
        save({"metrics": m3r, "weights": _full_weights(resumed), "step": step}, "resumed")
        dist.barrier()  # neither rank tears its connections down while the other still uses them
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    spawn_ranks(_rank, WORLD, str(out / "store"), str(out), log_dir=out / "logs")
    return out


def _load(out, name: str, rank: int = 0) -> dict:
    return torch.load(out / f"{name}-rank{rank}.pt", weights_only=False)


@pytest.mark.slow
def test_fsdp_step_equals_single_process_step(fsdp_run, tmp_path):
    single = make_trainer(tmp_path, world_size=1, fsdp=False)
    metrics = single.step()
    want = _full_weights(single)
    got = _load(fsdp_run, "step1")  # gathered to rank 0
    assert set(got["weights"]) >= set(want) - {"lm_head.weight"}
    for name, w in want.items():
        if name in got["weights"]:
            torch.testing.assert_close(got["weights"][name], w, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    for key in ("loss", "reward", "grad_norm", "completions/num_tokens"):
        assert got["metrics"][key] == pytest.approx(metrics[key], abs=1e-5), key
    before = tied_model().state_dict()
    assert not torch.allclose(before["model.embed_tokens.weight"], want["model.embed_tokens.weight"])


@pytest.mark.slow
def test_engines_get_the_full_weights_one_unit_at_a_time(fsdp_run):
    full = _load(fsdp_run, "step1")["weights"]
    model = tied_model()
    model.load_state_dict(full, strict=False)  # lm_head is the embedding
    llm = LLM(model, tokenizer=make_tokenizer(), device="cpu", dtype="float32", cpu_kv_cache_space_gib=0.05)
    expected = llm.llm_engine.model.state_dict()
    for rank in range(WORLD):
        sync = _load(fsdp_run, "sync", rank)
        assert sync["max_gathered"] == 1  # never more than one FSDP unit in full at once
        assert sorted(sync["names"]) == sorted(n for n, _ in model.named_parameters())
        assert sync["version"] >= 2  # the initial build, then the sync after the step
        for name, w in expected.items():
            assert torch.equal(sync["engine"][name], w), (rank, name)


@pytest.mark.slow
def test_fsdp_checkpoint_resumes_identically(fsdp_run):
    from transformers import AutoModelForCausalLM

    for rank in range(WORLD):
        straight, resumed = _load(fsdp_run, "straight", rank), _load(fsdp_run, "resumed", rank)
        assert resumed["step"] == 2
        for key in ("loss", "reward", "grad_norm"):
            assert resumed["metrics"][key] == pytest.approx(straight["metrics"][key], abs=1e-6), key
    straight, resumed = _load(fsdp_run, "straight"), _load(fsdp_run, "resumed")
    # the step after the resume used the restored AdamW moments: its weights match too
    for name, w in straight["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], w, atol=1e-6, rtol=0)
    ckpts = sorted(os.listdir(fsdp_run / "straight"))
    assert ckpts == ["checkpoint-2"]  # written once, by rank 0, atomically
    hf = AutoModelForCausalLM.from_pretrained(fsdp_run / "straight" / "checkpoint-2")
    assert hf.config.tie_word_embeddings and hf.lm_head.weight is hf.model.embed_tokens.weight
    state = torch.load(fsdp_run / "straight" / "checkpoint-2" / "optimizer.pt", weights_only=True)
    assert "model.embed_tokens.weight" in state["state"]  # full, keyed by parameter name


def test_fsdp_without_a_process_group_says_how_to_launch(tmp_path):
    with pytest.raises(ValueError, match="torchrun"):
        make_trainer(tmp_path, world_size=1, fsdp=True)


def test_local_rows_follow_torch_chunk():
    t = torch.arange(10.0).reshape(5, 2)
    assert weight_sync_mod.local_rows(t) == (t, slice(0, 5))  # not sharded: every row


def _rank_nccl(rank: int, store: str, out: str) -> None:
    """On 2 GPUs, fp32: the all-reduce trainer and the FSDP trainer see the same rollouts on each
    rank (same engine, prompts, seeds), so only the gradient reduction differs between them."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        replicas = make_trainer(os.path.join(out, "dp"), WORLD, fsdp=False, device="cuda")
        m_dp = replicas.step()
        sharded = make_trainer(os.path.join(out, "fsdp"), WORLD, fsdp=True, device="cuda")
        m_fsdp = sharded.step()
        full = {k: v.full_tensor() for k, v in sharded.model.state_dict().items()}
        spy: dict = {}
        _spy_on_units(sharded, spy)
        sharded.generator.sync()
        model = tied_model().cuda()
        model.load_state_dict(full, strict=False)
        ref = LLM(model, tokenizer=make_tokenizer(), dtype="float32", gpu_memory_utilization=0.05)
        engine_equal = all(torch.equal(sharded.llm.llm_engine.model.state_dict()[k], w)
                           for k, w in ref.llm_engine.model.state_dict().items())
        diff = max((full[k] - w).abs().max().item() for k, w in replicas.model.state_dict().items() if k in full)
        torch.save({"loss": (m_dp["loss"], m_fsdp["loss"]), "max_weight_diff": diff,
                    "engine_equal": engine_equal, "max_gathered": spy["max_gathered"]},
                   os.path.join(out, f"nccl-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp_on_two_gpus_matches_the_all_reduce_trainer(tmp_path):
    spawn_ranks(_rank_nccl, WORLD, str(tmp_path / "store"), str(tmp_path), log_dir=tmp_path / "logs")
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"nccl-rank{rank}.pt", weights_only=False)
        assert got["loss"][1] == pytest.approx(got["loss"][0], abs=1e-5)
        assert got["max_weight_diff"] < 1e-5
        assert got["engine_equal"] and got["max_gathered"] == 1
