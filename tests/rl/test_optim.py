"""The optimizer and schedule GRPOConfig names, and GRPOTrainer(optimizers=...) replacing them."""

import importlib.util

import pytest
import torch
from datasets import Dataset
from model_fixtures import make_tiny_model, make_tokenizer

from tandem.rl import GRPOConfig, GRPOTrainer
from tandem.rl.optim import build_optimizer, build_scheduler, warmup_steps


def test_optim_names_build_torch_optimizers_over_trainable_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].requires_grad_(False)
    cpu = torch.device("cpu")
    for name, cls in [("adamw_torch", torch.optim.AdamW), ("adamw_torch_fused", torch.optim.AdamW),
                      ("sgd", torch.optim.SGD), ("adagrad", torch.optim.Adagrad),
                      ("rmsprop", torch.optim.RMSprop)]:
        opt = build_optimizer(model, GRPOConfig(optim=name, learning_rate=0.1), cpu)
        assert type(opt) is cls and len(opt.param_groups[0]["params"]) == 2  # the frozen layer left out


def test_warmup_steps_count_or_share_and_scheduler_kwargs():
    assert warmup_steps(GRPOConfig(warmup_steps=5), 100) == 5
    assert warmup_steps(GRPOConfig(warmup_steps=0.1), 100) == 10
    assert warmup_steps(GRPOConfig(warmup_ratio=0.2), 100) == 20
    opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
    sched = build_scheduler(opt, GRPOConfig(lr_scheduler_type="cosine_with_min_lr",
                                            lr_scheduler_kwargs={"min_lr": 0.5}, learning_rate=1.0), 10)
    for _ in range(10):
        opt.step()
        sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(0.5)


def test_optimizers_given_to_the_trainer_are_used_and_generation_kwargs_checked(tmp_path):
    model = make_tiny_model("llama", seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    args = GRPOConfig(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2,
                      max_completion_length=4, max_prompt_length=16, max_steps=1, report_to="none",
                      save_strategy="no", generation_kwargs={"stop": ["\n"]})
    data = Dataset.from_dict({"prompt": ["a", "b"]})
    trainer = GRPOTrainer(model, lambda completions, **kw: [1.0] * len(completions), args, data,
                          processing_class=make_tokenizer(), optimizers=(opt, sched),
                          engine_kwargs={"device": "cpu"})
    assert trainer.optimizer is opt and trainer.scheduler is sched
    assert trainer.sampling_params.stop == ["\n"]
    args.generation_kwargs = {"beam_width": 4}
    with pytest.raises(ValueError, match=r"generation_kwargs=.*beam_width"):
        GRPOTrainer(model, len, args, data, processing_class=make_tokenizer(), engine_kwargs={"device": "cpu"})


def test_lighter_and_offloaded_optimizers_by_transformers_names():
    from tandem.rl.offload import HostOffloadAdamW

    model = torch.nn.Linear(64, 64)
    cpu = torch.device("cpu")
    opt = build_optimizer(model, GRPOConfig(optim_offload=True), cpu)
    assert isinstance(opt, HostOffloadAdamW) and opt.param_groups[0]["lr"] == 1e-6
    with pytest.raises(ValueError, match="optim_offload=True keeps AdamW's state"):
        GRPOConfig(optim="sgd", optim_offload=True)
    if importlib.util.find_spec("bitsandbytes") is None:
        with pytest.raises(ValueError, match="optim='adamw_bnb_8bit' needs bitsandbytes: pip install bitsandbytes"):
            build_optimizer(model, GRPOConfig(optim="adamw_bnb_8bit"), cpu)
    pytest.importorskip("torchao")
    for name, cls in [("adamw_torch_8bit", "AdamW8bit"), ("adamw_torch_4bit", "AdamW4bit")]:
        opt = build_optimizer(model, GRPOConfig(optim=name, learning_rate=1e-3), cpu)
        assert type(opt).__name__ == cls
        model(torch.randn(2, 64)).sum().backward()
        opt.step()  # torch.compile'd on the CPU too
        assert type(opt.state[model.weight]["exp_avg"]).__name__.startswith("OptimState")
