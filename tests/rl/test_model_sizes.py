"""Sizes from the config alone: exact parameter counts on the meta device, and the activation
formula against what autograd really saves (`measure_activations`)."""

import contextlib

import pytest
import torch
from model_fixtures import make_tiny_model

from tandem.models.presets import preset_config
from tandem.rl.activations import measure_activations, set_recompute
from tandem.rl.model_sizes import model_sizes, sizes_of_model


def test_qwen25_7b_counts_by_hand():
    s = model_sizes(preset_config("qwen2.5-7b"))  # meta device: no memory
    D, I, L, V, KV = 3584, 18944, 28, 152064, 4 * 128
    layer = (
        (D * D + D) + 2 * (D * KV + KV) + D * D + 3 * D * I + 2 * D
    )  # q, k, v (biases), o, MLP, norms
    assert s.num_params == L * layer + 2 * V * D + D == 7_615_616_512  # untied head, final norm
    assert s.num_trainable == s.num_params and s.kv_bytes_per_token(2) == 2 * L * KV * 2
    assert s.layer_linear_params == L * (2 * D * D + 2 * D * KV + 3 * D * I)
    assert s.largest_linear == D * I and not s.tied


def test_meta_sizes_equal_the_built_model_and_a_lora_adapter_trains_alone():
    model = make_tiny_model("qwen2", tie_word_embeddings=True)
    built, meta = sizes_of_model(model), model_sizes(model.config)
    assert built == meta and built.tied
    assert built.num_params == sum(p.numel() for p in model.parameters())  # the tied head once
    from peft import LoraConfig

    lora = model_sizes(model.config, LoraConfig(r=4, target_modules="all-linear"))
    linears = [
        m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n
    ]
    adapter = sum(4 * (m.in_features + m.out_features) for m in linears)
    assert lora.num_trainable == adapter and lora.num_params == built.num_params + adapter


@pytest.mark.parametrize(
    "arch,kw",
    [
        ("llama", {}),
        ("qwen3", {}),
        (
            "qwen2",
            dict(
                hidden_size=96,
                intermediate_size=256,
                num_attention_heads=6,
                num_key_value_heads=2,
                num_hidden_layers=3,
            ),
        ),
    ],
)
def test_the_activation_formula_is_what_autograd_saves(arch, kw):
    model = make_tiny_model(arch, **kw)
    sizes = sizes_of_model(model)
    for bf16 in (False, True):
        precision = (
            (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
            if bf16
            else contextlib.nullcontext
        )
        for recompute in (False, True):
            set_recompute(model, recompute)
            got, want = measure_activations(model, precision), sizes.activations(bf16, recompute)
            assert want.per_token == pytest.approx(got.per_token, rel=0.01), (bf16, recompute)
            assert (
                want.fixed == pytest.approx(got.fixed, abs=64) and want.per_row_sq == got.per_row_sq
            )
        set_recompute(model, False)
