"""The memory plan applied to a trainer on a CPU (fp32, a tiny model): a forced budget
(TANDEM_MEMORY_BUDGET_GIB) makes it recompute, offload the optimizer state or shrink the KV cache,
and the run is the unconstrained one; a budget nothing fits is refused before the model loads."""

from dataclasses import replace

import pytest
import torch
from datasets import Dataset
from model_fixtures import make_tiny_model, make_tokenizer

from tandem.rl import GRPOConfig, GRPOTrainer
from tandem.rl.activations import is_recomputing
from tandem.rl.memory_plan import BUDGET_ENV, GIB, MemoryPlanError, plan_memory
from tandem.rl.offload import HostOffloadAdamW
from tests.rl.test_trainer import make_trainer, target_share

# the engine sleeps while training: these tests make the plan recompute, offload or shrink the cache
OPEN = dict(max_steps=2, gradient_checkpointing=None, vllm_gpu_memory_utilization="auto",
            vllm_enable_sleep_mode=True)


@pytest.fixture(scope="module")
def roomy(tmp_path_factory):
    """The unconstrained run: its plan, and its first two steps."""
    trainer = make_trainer(tmp_path_factory.mktemp("roomy"), **OPEN)
    plan = trainer.memory_plan
    assert not plan.recompute and not plan.offload and plan.measured
    steps = [trainer.step() for _ in range(2)]
    return plan, steps, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def budget_between(monkeypatch, low: int, high: int) -> None:
    """A device capacity whose usable part (98% on a CPU) lies between two peaks."""
    assert low < high
    monkeypatch.setenv(BUDGET_ENV, repr((low + high) / 2 / 0.98 / GIB))


def variant(plan, **work):
    return plan_memory(plan.sizes, replace(plan.work, **work), plan.device, activations=plan.costs)


def same_run(trainer, roomy, atol=1e-6):
    _, steps, params = roomy
    got = [trainer.step() for _ in range(2)]
    for g, want in zip(got, steps):
        assert g["loss"] == pytest.approx(want["loss"], abs=atol)
    for n, p in trainer.model.named_parameters():
        torch.testing.assert_close(p, params[n], rtol=0, atol=atol, msg=n)


def test_a_tight_budget_recomputes_with_the_same_result(tmp_path, monkeypatch, roomy):
    plan = roomy[0]
    budget_between(
        monkeypatch, variant(plan, gradient_checkpointing=True, optim_offload=False).peak, plan.peak
    )
    tight = make_trainer(tmp_path, **OPEN)
    assert (
        tight.memory_plan.recompute
        and not tight.memory_plan.offload
        and is_recomputing(tight.model)
    )
    same_run(tight, roomy)


def test_a_tighter_budget_offloads_adamw_with_the_same_result(tmp_path, monkeypatch, roomy):
    plan = roomy[0]
    on_device = variant(plan, gradient_checkpointing=True, optim_offload=False)
    budget_between(
        monkeypatch,
        variant(plan, gradient_checkpointing=True, optim_offload=True).peak,
        on_device.peak,
    )
    tight = make_trainer(tmp_path, **OPEN)
    assert tight.memory_plan.offload and isinstance(tight.optimizer, HostOffloadAdamW)
    assert tight.memory_plan.rows["optimizer state"] == (0, 0, 0) and tight.memory_plan.host_rows
    same_run(tight, roomy, atol=1e-5)  # torch's fused CPU AdamW kernel against its for-loop


def test_the_plan_keeps_the_engine_awake_where_it_fits_and_puts_it_to_sleep_where_not(
        tmp_path, monkeypatch, roomy):
    """vllm_enable_sleep_mode=None: awake through training while the engine's weights and KV cache
    fit beside the train phase (no release and re-map each step), asleep once they do not; the
    same run either way."""
    auto = {**OPEN, "vllm_enable_sleep_mode": None}
    awake = make_trainer(tmp_path / "awake", **auto)
    assert awake.memory_plan.sleep_level is None and awake.generator.sleep_level is None
    assert "engine awake through training (it fits beside the train phase)" in awake.memory_plan.why
    assert not awake.memory_plan.recompute and not awake.llm.llm_engine.is_sleeping
    same_run(awake, roomy)
    assert not awake.llm.llm_engine.is_sleeping  # it generated and trained twice without sleeping
    plan = roomy[0]  # asleep, nothing recomputed: the awake plan needs the engine's bytes on top
    budget_between(monkeypatch, plan.peak, awake.memory_plan.peak)
    asleep = make_trainer(tmp_path / "asleep", **auto)
    assert asleep.memory_plan.sleep_level == 2 and asleep.generator.sleep_level == 2
    assert not asleep.memory_plan.recompute and asleep.memory_plan.kv_cache_bytes == plan.kv_cache_bytes
    assert any("awake it does not fit" in why for why in asleep.memory_plan.why)
    same_run(asleep, roomy)


def test_a_budget_short_of_a_full_round_shrinks_the_kv_cache(tmp_path, monkeypatch, roomy):
    """The engine awake while training (no sleep mode): its KV cache shares the training phase."""
    plan = roomy[0]
    lean = variant(plan, gradient_checkpointing=True, optim_offload=True, sleep_level=None)
    assert lean.rows["KV cache"][1] == lean.kv_cache_bytes == plan.kv_cache_bytes
    block = lean.kv_block_bytes
    budget_between(monkeypatch, lean.peak - 40 * block, lean.peak - 10 * block)
    tight = make_trainer(tmp_path, **{**OPEN, "vllm_enable_sleep_mode": False})
    kv = tight.memory_plan.kv_cache_bytes
    assert 0 < kv < plan.kv_cache_bytes and "wait their turn" in " ".join(tight.memory_plan.why)
    assert tight.llm.llm_engine.worker.num_blocks * block == kv  # the engine took the plan's size
    same_run(tight, roomy, atol=1e-5)


def test_a_lighter_optimizer_forced_runs(tmp_path, roomy):
    pytest.importorskip("torchao")
    trainer = make_trainer(
        tmp_path, max_steps=1, gradient_checkpointing=None, optim="adamw_torch_4bit"
    )
    assert type(trainer.optimizer).__name__ == "AdamW4bit"
    assert trainer.memory_plan.rows["optimizer state"][0] < roomy[0].rows["optimizer state"][0]
    assert trainer.step()["loss"] == pytest.approx(
        roomy[1][0]["loss"], abs=1e-6
    )  # before any update


def test_a_budget_nothing_fits_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    make_tiny_model("llama").config.save_pretrained(tmp_path)  # a config, no weights, no tokenizer
    monkeypatch.setenv(BUDGET_ENV, "0.0001")
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        num_generations=2,
        per_device_train_batch_size=2,
        max_completion_length=4,
        max_prompt_length=16,
        report_to="none",
        use_cpu=True,
    )
    with pytest.raises(MemoryPlanError, match=r"does not fit on the cpu device.*[GM]iB are usable"):
        GRPOTrainer(str(tmp_path), target_share, args, Dataset.from_dict({"prompt": ["a", "b"]}))
    monkeypatch.setenv(BUDGET_ENV, "lots")
    with pytest.raises(ValueError, match="TANDEM_MEMORY_BUDGET_GIB='lots'"):
        GRPOTrainer(
            make_tiny_model("llama"),
            target_share,
            args,
            Dataset.from_dict({"prompt": ["a"]}),
            processing_class=make_tokenizer(),
            engine_kwargs={"device": "cpu"},
        )


def test_expandable_segments_only_on_cuda_and_never_over_the_users_setting(monkeypatch):
    from tandem.rl.memory_setup import ALLOC_CONF, expandable_segments

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    assert expandable_segments(torch.device("cpu")) is None and not calls
    monkeypatch.setenv(ALLOC_CONF, "expandable_segments:False")
    assert expandable_segments(torch.device("cuda")) is None and not calls  # the user's choice
    monkeypatch.delenv(ALLOC_CONF)
    assert "expandable segments" in expandable_segments(torch.device("cuda"))
    assert calls == ["expandable_segments:True"]
