"""The fused weight-gradient accumulation (`tandem.rl.grad_accum_linear`): under bf16 autocast the
patched model's losses are HF's bit for bit and its accumulated gradients HF's within bf16, closer
to the exact sum; with recompute too. Exactly HF's where it falls back: fp32, LoRA's frozen base,
batch-invariant mode, grad hooks. The trainer's switch. No Triton needed (the trainer test's
fused_kernels is: it runs in the interpreter).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import types

import pytest
import torch
from model_fixtures import make_tiny_model

from tandem import batch_invariant
from tandem.rl import grad_accum_linear
from tandem.rl.activations import set_recompute
from tandem.rl.grad_accum_linear import _GradAccumLinear, _linear_forward, is_patched, patch_model
from tandem.rl.logprobs import completion_logps
from tandem.rl.loss import grpo_loss

SMALL = {"vocab_size": 64, "hidden_size": 48, "intermediate_size": 80}


def _micro_batches(n: int = 3):
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(n):
        ids = torch.randint(3, 64, (3, 11), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, 8:] = 0
        mask[2, 6:] = 0
        batches.append((ids, mask, torch.tensor([3, 4, 2]), torch.randn(3, generator=gen)))
    return batches


def _accumulate(model, bf16: bool, n: int = 3):
    """Losses of n micro-batches, backward after each, and the parameters' accumulated .grad."""
    losses = []
    for ids, mask, prompt_lengths, advantages in _micro_batches(n):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=bf16):
            logp = completion_logps(model, ids, mask, prompt_lengths, 7)
        completion_mask = (torch.arange(7)[None] + prompt_lengths[:, None] < mask.sum(-1, keepdim=True)).float()
        loss, _ = grpo_loss(logp, None, advantages, completion_mask)
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _pair(arch: str):
    ref = make_tiny_model(arch, **SMALL).train()
    patched = copy.deepcopy(ref)
    assert patch_model(patched).startswith("fused weight-gradient accumulation: on (14 Linears")
    return ref, patched


def _flat(grads, names):
    return torch.cat([grads[n].double().flatten() for n in names])


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with bias
def test_accumulated_grads_match_hf_under_autocast_and_are_closer_to_exact(arch, recompute, monkeypatch):
    ref, patched = _pair(arch)
    exact = copy.deepcopy(ref).double()
    for m in (ref, patched, exact):
        set_recompute(m, recompute)
    loss_r, grads_r = _accumulate(ref, bf16=True)
    calls = []
    forward = _GradAccumLinear.forward
    monkeypatch.setattr(_GradAccumLinear, "forward", staticmethod(lambda *a: calls.append(1) or forward(*a)))
    loss_p, grads_p = _accumulate(patched, bf16=True)
    assert len(calls) == 3 * 14 * (2 if recompute else 1)  # micro-batches x Linears (x recompute)
    _, grads_64 = _accumulate(exact, bf16=False)
    assert torch.equal(loss_p, loss_r)  # the forward is autocast's, op for op
    assert grads_p.keys() == grads_r.keys() == grads_64.keys()
    for name, g in grads_r.items():
        assert grads_p[name].dtype == torch.float32
        scale = g.abs().max().item()
        assert (grads_p[name] - g).abs().max().item() <= 2e-2 * scale, name
    # Against the fp64 model: the bf16 forward dominates both errors; no worse for the fp32 sums.
    linears = [n for n in grads_r if "_proj" in n]
    err_r = (_flat(grads_r, linears) - _flat(grads_64, linears)).norm()
    err_p = (_flat(grads_p, linears) - _flat(grads_64, linears)).norm()
    assert err_p <= err_r, (err_p, err_r)


def test_one_linear_accumulates_the_exact_sum_in_fp32():
    """Eight micro-batches through one Linear: HF rounds each weight gradient to bf16 before
    summing, the patched one sums them in fp32; both against the exact sum of the same bf16 GEMMs."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(96, 40)
    patched = copy.deepcopy(ref)
    patched.forward = types.MethodType(_linear_forward, patched)
    xs = [torch.randn(3, 50, 96) for _ in range(8)]
    gs = [torch.randn(3, 50, 40).bfloat16() for _ in range(8)]
    grad_x = {}
    for name, m in (("ref", ref), ("patched", patched)):
        grad_x[name] = []
        for x, g in zip(xs, gs):
            x = x.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                y = m(x)
            y.backward(g)
            grad_x[name].append(x.grad)
    assert all(torch.equal(a, b) for a, b in zip(grad_x["ref"], grad_x["patched"]))
    w_exact = sum(g.double().reshape(-1, 40).T @ x.bfloat16().double().reshape(-1, 96)
                  for x, g in zip(xs, gs))
    b_exact = sum(g.double().reshape(-1, 40).sum(0) for g in gs)

    def rel(got, want):
        return ((got.double() - want).norm() / want.norm()).item()

    assert rel(patched.weight.grad, w_exact) < 1e-6 and rel(ref.weight.grad, w_exact) > 1e-3
    assert rel(patched.bias.grad, b_exact) < 1e-6 and rel(ref.bias.grad, b_exact) > 1e-4


@pytest.mark.parametrize("case", ["fp32", "batch_invariant", "grad_hook"])
def test_where_it_falls_back_the_grads_are_hf_exactly(case):
    if case == "batch_invariant" and torch.cuda.is_available():
        pytest.skip("CPU tensors: the batch-invariant Triton kernels run there only under the interpreter")
    ref, patched = _pair("qwen2")
    if case == "grad_hook":  # e.g. an optimizer that copies gradients in hooks: they must still fire
        fired = []
        for m in (ref, patched):
            m.model.layers[0].mlp.up_proj.weight.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    with batch_invariant.enabled(case == "batch_invariant"):
        loss_r, grads_r = _accumulate(ref, bf16=case != "fp32", n=2)
        loss_p, grads_p = _accumulate(patched, bf16=case != "fp32", n=2)
    assert torch.equal(loss_p, loss_r)
    if case == "grad_hook":
        assert len(fired) == 4  # two micro-batches, each model
        name = "model.layers.0.mlp.up_proj.weight"
        assert torch.equal(grads_p[name], grads_r[name])
        return
    assert all(torch.equal(grads_p[n], grads_r[n]) for n in grads_r)


def test_lora_base_layers_fall_back_and_the_adapters_are_left_plain():
    from peft import LoraConfig

    from tandem.rl.lora import apply_peft

    ref, patched = _pair("qwen2")  # patched before LoRA, as the trainer does
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    ref, patched = apply_peft(ref, lora), apply_peft(patched, copy.deepcopy(lora))
    patched.load_state_dict(ref.state_dict())  # the same random adapters
    q = patched.base_model.model.model.layers[0].self_attn.q_proj
    assert vars(q.base_layer)["forward"].__func__ is _linear_forward
    assert "forward" not in vars(q.lora_A["default"]) and not q.base_layer.weight.requires_grad
    loss_r, grads_r = _accumulate(ref, bf16=True)
    loss_p, grads_p = _accumulate(patched, bf16=True)
    assert torch.equal(loss_p, loss_r) and grads_r and all("lora_" in n for n in grads_r)
    assert all(torch.equal(grads_p[n], grads_r[n]) for n in grads_r)


def test_under_fsdp2s_bf16_policy_the_linears_fall_back(tmp_path, monkeypatch):
    """FSDP2 as the trainer applies it with bf16 (one gloo rank): the Linears get its bf16
    all-gathered weights and the fused function never runs."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tandem.rl.fsdp import apply_fsdp

    _, patched = _pair("qwen2")
    calls = []
    forward = _GradAccumLinear.forward
    monkeypatch.setattr(_GradAccumLinear, "forward", staticmethod(lambda *a: calls.append(1) or forward(*a)))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        apply_fsdp(patched, torch.device("cpu"), bf16=True)
        _, grads_p = _accumulate(patched, bf16=True, n=2)
    finally:
        dist.destroy_process_group()
    assert not calls and isinstance(grads_p["model.layers.0.mlp.up_proj.weight"], DTensor)


def test_the_trainer_keeps_it_off_where_it_would_be_wrong():
    settings = {"bf16": True, "fsdp": False, "batch_invariant": False, "lora": False}
    assert grad_accum_linear.why_off(**settings) is None
    for field, value, why in (("bf16", False, "fp32"), ("fsdp", True, "fsdp=True"),
                              ("batch_invariant", True, "batch_invariant=True"), ("lora", True, "LoRA")):
        line = grad_accum_linear.why_off(**{**settings, field: value})
        assert line.startswith("fused weight-gradient accumulation: off") and why in line


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="fused_kernels=True on a CPU needs triton and TRITON_INTERPRET=1")
def test_a_bf16_trainer_step_with_the_fusion(tmp_path, capsys, monkeypatch):
    """bf16 on the CPU: one GRPO step with the fusion on equals the step with it off (the forward
    is the same; the updated weights within bf16 of each other)."""
    from datasets import Dataset
    from model_fixtures import make_tokenizer

    from tandem.rl import GRPOConfig, GRPOTrainer

    def reward(completion_ids, **kwargs):
        return [float(sum(c) % 7) for c in completion_ids]

    def make(out):
        cfg = GRPOConfig(output_dir=str(out), num_generations=4, per_device_train_batch_size=4,
                         gradient_accumulation_steps=2, max_completion_length=4, max_prompt_length=16,
                         max_steps=1, report_to="none", gradient_checkpointing=False, seed=0,
                         learning_rate=1e-3, lr_scheduler_type="constant", save_strategy="no",
                         vllm_gpu_memory_utilization=0.1, fused_kernels=True, bf16=True,
                         use_cpu=True)
        return GRPOTrainer(make_tiny_model("llama", seed=3), reward, cfg,
                           train_dataset=Dataset.from_dict({"prompt": ["Hello", "The answer is"]}),
                           processing_class=make_tokenizer(), engine_kwargs={"device": "cpu"})

    on = make(tmp_path / "on")
    assert "fused weight-gradient accumulation: on" in capsys.readouterr().out
    assert is_patched(on.model)
    monkeypatch.setattr(grad_accum_linear, "why_off", lambda *a: "fused weight-gradient accumulation: off")
    off = make(tmp_path / "off")
    assert not is_patched(off.model)
    m_on, m_off = on.step(), off.step()
    assert m_on["loss"] == m_off["loss"]
    assert abs(m_on["grad_norm"] - m_off["grad_norm"]) <= 2e-2 * m_off["grad_norm"]
    for (name, a), b in zip(on.model.named_parameters(), off.model.parameters()):
        assert (a - b).abs().max() <= 1e-2 * b.abs().max(), name
