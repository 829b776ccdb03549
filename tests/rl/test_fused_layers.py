"""The fused training kernels patched into a HF model (`tandem.rl.fused_layers`): logprobs, the
GRPO loss and every parameter's gradient equal the unpatched model's, padded and padding-free,
with and without recompute, with LoRA; the patch stays on its instance; the switch's decisions.

CPU: the kernels run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch
from model_fixtures import make_tiny_model

from tandem.rl import GRPOConfig
from tandem.rl.activations import set_recompute
from tandem.rl.fused_layers import is_patched, patch_model, resolve
from tandem.rl.logprobs import completion_logps
from tandem.rl.loss import grpo_loss

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
# The CPU tests run the kernels on CPU tensors: only the interpreter can (a GPU box runs the gpu test).
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

SMALL = {"vocab_size": 64, "hidden_size": 48, "intermediate_size": 80}  # 48 / 80: not powers of two


def _model(arch: str):
    if arch == "mistral":
        import transformers

        torch.manual_seed(0)
        cfg = transformers.MistralConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         sliding_window=None, **SMALL)
        return transformers.MistralForCausalLM(cfg).train()
    return make_tiny_model(arch, **SMALL).train()


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (3, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0
    mask[2, 6:] = 0  # right padding, rows of three lengths
    return ids, mask, torch.tensor([3, 4, 2])


def _loss_and_grads(model, padding_free: bool):
    ids, mask, prompt_lengths = _batch()
    logp = completion_logps(model, ids, mask, prompt_lengths, 7, padding_free=padding_free)
    completion_mask = (torch.arange(7)[None] + prompt_lengths[:, None] < mask.sum(-1, keepdim=True)).float()
    loss, _ = grpo_loss(logp, None, torch.tensor([1.0, -0.5, 0.25]), completion_mask)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), loss.detach(), grads


def _assert_same(a, b, tol=1e-5):
    scale = max(1.0, b.abs().max().item())
    assert (a - b).abs().max().item() <= tol * scale, ((a - b).abs().max().item(), scale)


def _compare(ref, fused, padding_free: bool):
    logp_r, loss_r, grads_r = _loss_and_grads(ref, padding_free)
    logp_f, loss_f, grads_f = _loss_and_grads(fused, padding_free)
    _assert_same(logp_f, logp_r)
    _assert_same(loss_f, loss_r)
    assert grads_f.keys() == grads_r.keys() and grads_r
    for name in grads_r:
        _assert_same(grads_f[name], grads_r[name])


# padding-free with recompute is left out here: this comparison calls backward after
# completion_logps has switched the attention back; the trainer keeps the varlen attention on for
# the whole run (`packing.use_varlen_attention`; test_logprobs covers a packed step with recompute)
@interpreted
@pytest.mark.parametrize("mode", ["padded", "padded+recompute", "padding_free"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_patched_model_matches_hf(arch, mode):
    ref = _model(arch)
    fused = copy.deepcopy(ref)
    assert patch_model(fused).startswith("fused kernels: on") and is_patched(fused)
    for m in (ref, fused):
        set_recompute(m, "recompute" in mode)
    _compare(ref, fused, padding_free=mode == "padding_free")


@interpreted
def test_lora_on_a_patched_model_matches_hf():
    from peft import LoraConfig

    from tandem.rl.lora import apply_peft

    ref = _model("qwen2")
    fused = copy.deepcopy(ref)
    patch_model(fused)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    ref, fused = apply_peft(ref, lora), apply_peft(fused, copy.deepcopy(lora))
    fused.load_state_dict(ref.state_dict())  # the same random adapters
    assert is_patched(fused)
    _compare(ref, fused, padding_free=False)


def test_the_patch_stays_on_its_instance():
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

    before = (LlamaRMSNorm.forward, LlamaAttention.forward, LlamaMLP.forward)
    patched, other = _model("llama"), _model("llama")
    patch_model(patched)
    assert (LlamaRMSNorm.forward, LlamaAttention.forward, LlamaMLP.forward) == before
    assert not is_patched(other)
    twin = copy.deepcopy(patched)  # the trainer's reference model: its forwards bind to the copy
    layer = twin.model.layers[0]
    assert layer.mlp.forward.__self__ is layer.mlp and layer.self_attn.forward.__self__ is layer.self_attn


def test_an_unrecognised_model_is_left_as_it_is():
    import transformers

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    line = patch_model(model)
    assert line.startswith("fused kernels: off") and "'gpt2'" in line
    assert not is_patched(model)


@interpreted
def test_generation_with_a_kv_cache_takes_hf_forward():
    ref = _model("llama").eval()
    fused = copy.deepcopy(ref)
    patch_model(fused)
    ids = torch.randint(3, 64, (1, 5))
    with torch.no_grad():
        a = ref.generate(ids, max_new_tokens=4, do_sample=False)
        b = fused.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b)


@interpreted
def test_the_switch(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve(None, cuda) == (True, "")
    on, line = resolve(None, cpu)
    assert not on and "fused kernels: off" in line
    assert resolve(False, cuda)[0] is False
    assert resolve(True, cpu)[0]  # the tests' TRITON_INTERPRET=1
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="fused_kernels=True .*TRITON_INTERPRET=1"):
        resolve(True, cpu)
    with pytest.raises(ValueError, match="use_liger_kernel=True"):
        resolve(None, cpu, use_liger_kernel=True)
    assert resolve(False, cpu, use_liger_kernel=True)[0] is False  # the explicit field wins
    with pytest.raises(ValueError, match="fused_kernels must be True, False or None"):
        GRPOConfig(fused_kernels="yes")


@interpreted
def test_trainer_patches_the_policy_and_its_reference(tmp_path, capsys):
    from datasets import Dataset
    from model_fixtures import make_tokenizer

    from tandem.rl import GRPOTrainer

    cfg = GRPOConfig(output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=8,
                     max_completion_length=4, max_prompt_length=16, max_steps=1, report_to="none",
                     gradient_checkpointing=False, vllm_gpu_memory_utilization=0.1, save_steps=10**6,
                     beta=0.04, fused_kernels=True)
    trainer = GRPOTrainer(make_tiny_model("llama", seed=3), lambda completions, **kw: [0.0] * len(completions),
                          cfg, train_dataset=Dataset.from_dict({"prompt": ["Hello", "The answer is"]}),
                          processing_class=make_tokenizer(), engine_kwargs={"device": "cpu"})
    out = capsys.readouterr().out
    assert "fused kernels: on" in out and "fused weight-gradient accumulation: off (fp32" in out
    assert is_patched(trainer.model) and is_patched(trainer.ref_model)
    metrics = trainer.step()
    assert torch.isfinite(torch.tensor(metrics["loss"]))


@interpreted
def test_fsdp2_shards_a_patched_model(tmp_path):
    """FSDP2's per-layer units around the patched forwards (one gloo rank): the gathered gradients
    are the unsharded unpatched model's."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tandem.rl.fsdp import apply_fsdp

    ref = _model("llama")
    fused = copy.deepcopy(ref)
    patch_model(fused)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        apply_fsdp(fused, torch.device("cpu"), bf16=False)
        logp_r, loss_r, grads_r = _loss_and_grads(ref, padding_free=False)
        logp_f, loss_f, grads_f = _loss_and_grads(fused, padding_free=False)
    finally:
        dist.destroy_process_group()
    _assert_same(logp_f, logp_r)
    _assert_same(loss_f, loss_r)
    assert isinstance(fused.model.layers[0].mlp.up_proj.weight, DTensor)
    for name, g in grads_r.items():
        got = grads_f[name]
        _assert_same(got.full_tensor() if isinstance(got, DTensor) else got, g)


@interpreted
def test_under_autocast_the_norms_hand_the_linears_bf16():
    """CPU autocast: the layer norms emit bf16 (the linears' input dtype) and take bf16 gradients
    back. Measured against the fp32 model, the patched model's bf16 logprobs and gradients are
    as close as HF's bf16 ones (the interpreter truncates to bf16: neither is exact)."""
    ref = _model("qwen2")
    fused, fp32 = copy.deepcopy(ref), copy.deepcopy(ref)
    patch_model(fused)
    seen = []
    fused.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp_r, _, grads_r = _loss_and_grads(ref, padding_free=False)
        logp_f, _, grads_f = _loss_and_grads(fused, padding_free=False)
    logp_32, _, grads_32 = _loss_and_grads(fp32, padding_free=False)
    assert seen == [torch.bfloat16]
    assert (logp_f - logp_32).abs().max() <= 1.5 * (logp_r - logp_32).abs().max() + 1e-3

    def flat(grads):
        return torch.cat([grads[n].flatten() for n in sorted(grads_32)])

    assert (flat(grads_f) - flat(grads_32)).norm() <= 1.5 * (flat(grads_r) - flat(grads_32)).norm()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["padded", "padded+recompute", "padding_free"])
def test_qwen2_1p5b_shaped_layers_in_bf16_on_the_gpu(mode):
    """Two Qwen2.5-1.5B-shaped layers (random weights, fp32 master, bf16 autocast as the trainer
    runs them, SDPA / varlen flash): against the fp32 model, the patched model's logprobs and
    gradients are as close as HF's own bf16 ones."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                                   num_key_value_heads=2, head_dim=128, num_hidden_layers=2, vocab_size=4096,
                                   rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=1024,
                                   attn_implementation="sdpa")
    ref = transformers.Qwen2ForCausalLM(cfg).cuda().train()
    fused, fp32 = copy.deepcopy(ref), copy.deepcopy(ref)
    patch_model(fused)
    for m in (ref, fused, fp32):
        set_recompute(m, "recompute" in mode)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(10, 4096, (8, 320), generator=gen).cuda()
    lengths = torch.randint(200, 321, (8,), generator=gen).cuda()
    mask = (torch.arange(320, device="cuda")[None] < lengths[:, None]).long()
    prompt_lengths = torch.full((8,), 64, device="cuda")
    completion_mask = (torch.arange(256, device="cuda")[None] + 64 < lengths[:, None]).float()
    advantages = torch.linspace(-1, 1, 8, device="cuda")

    def run(model, bf16):
        amp = torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False, enabled=bf16)
        with amp:
            logp = completion_logps(model, ids, mask, prompt_lengths, 256, head_dtype=torch.bfloat16 if bf16 else None,
                                    padding_free=mode == "padding_free")
        loss, _ = grpo_loss(logp, None, advantages, completion_mask)
        loss.backward()
        return logp.detach() * completion_mask, torch.cat([p.grad.flatten() for p in model.parameters()])

    logp_r, grad_r = run(ref, True)
    logp_f, grad_f = run(fused, True)
    logp_32, grad_32 = run(fp32, False)
    hf_err, fused_err = (logp_r - logp_32).abs().max(), (logp_f - logp_32).abs().max()
    assert fused_err <= 1.25 * hf_err + 1e-3, (fused_err, hf_err)
    hf_gerr, fused_gerr = (grad_r - grad_32).norm(), (grad_f - grad_32).norm()
    assert fused_gerr <= 1.25 * hf_gerr, (fused_gerr / grad_32.norm(), hf_gerr / grad_32.norm())
    assert (logp_f - logp_r).abs().max() < 0.05
