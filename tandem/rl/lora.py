"""LoRA through `peft`: the trainer trains the adapter; the engine gets merged weights.

The merged weight of an adapted layer, W + scale * B @ A, is computed on the device, one layer at a
time, and handed to the engine's `load_weights` as the HF-named tensor it replaces. The trainer's
module is never merged and unmerged (peft's merge would write into the frozen base weight and back,
with a rounding error each round); `get_delta_weight` is the same product peft's merge adds.

The weight-sync check compares one adapted weight in the engine with the trainer's merged one, so a
sync that skipped the adapter cannot pass for one that did not.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def apply_peft(model: nn.Module, peft_config) -> nn.Module:
    """The model wrapped with a fresh adapter (base weights frozen); needs `pip install peft`."""
    try:
        from peft import get_peft_model
    except ImportError as exc:
        raise ImportError("peft_config needs peft: pip install 'tandem[rl]' (or pip install peft)") from exc
    return get_peft_model(model, peft_config)


def _lora_layers(base: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}


def _delta(layer: nn.Module) -> torch.Tensor | None:
    deltas = [layer.get_delta_weight(a) for a in layer.active_adapters
              if a in layer.lora_A and not layer.disable_adapters and not layer.merged]
    return sum(deltas) if deltas else None


@torch.no_grad()
def merged_weights(peft_model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the base model with every adapter merged in, lazily, on the device."""
    base = peft_model.get_base_model()
    layers = _lora_layers(base)
    for name, p in base.named_parameters():
        module, _, leaf = name.rpartition(".")
        if ".lora_" in f".{name}" or ".original_module." in f".{name}":
            continue  # adapter factors; a modules_to_save copy's frozen original
        if ".modules_to_save." in name:  # the trained copy of a whole module stands for it
            head, _, rest = name.partition(".modules_to_save.")
            yield f"{head}.{rest.split('.', 1)[1]}", p.detach()
            continue
        owner = module.removesuffix(".base_layer")
        if module.endswith(".base_layer") and owner in layers:
            delta = _delta(layers[owner]) if leaf == "weight" else None
            yield f"{owner}.{leaf}", p.detach() if delta is None else p.detach() + delta.to(p.dtype)
        else:
            yield name, p.detach()


@torch.no_grad()
def check_engine_has_adapter(peft_model: nn.Module, engine_model: nn.Module) -> None:
    """The engine's copy of the first adapted weight must equal the trainer's merged one (in the
    engine's dtype)."""
    base = peft_model.get_base_model()
    layers = _lora_layers(base)
    if not layers:
        return
    owner, layer = next(iter(layers.items()))
    weight = layer.get_base_layer().weight
    delta = _delta(layer)
    ours = weight if delta is None else weight + delta.to(weight.dtype)
    prefix, _, proj = owner.rpartition(".")
    packed = getattr(engine_model, "packed_modules_mapping", {}).get(proj)
    target = f"{prefix}.{packed[0]}" if packed else owner
    engine_layer = engine_model.get_submodule(target)
    theirs = engine_layer.weight
    if packed:
        start, size = engine_layer.shard_range(packed[1])
        theirs = theirs.narrow(0, start, size)
    if not torch.equal(ours.to(theirs.dtype), theirs):
        raise RuntimeError(f"after the weight sync the engine's {owner}.weight differs from the "
                           "trainer's merged LoRA weight")


def load_adapter(peft_model: nn.Module, path) -> None:
    """Restore the adapter weights a checkpoint's `save_pretrained` wrote."""
    from pathlib import Path

    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = Path(path) / "adapter_model.safetensors"
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no adapter_model.safetensors (was it written with peft_config?)")
    result = set_peft_model_state_dict(peft_model, load_file(str(file)))
    if getattr(result, "unexpected_keys", None):
        raise RuntimeError(f"{path}: adapter does not fit the model: {result.unexpected_keys[:5]}")


class AdapterDisabled(nn.Module):
    """The reference policy under LoRA: the same model with its adapter switched off (no copy)."""

    def __init__(self, peft_model: nn.Module):
        super().__init__()
        object.__setattr__(self, "peft_model", peft_model)  # not a submodule: no second owner

    def forward(self, *args, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model(*args, **kwargs)

    # The log-prob scorer swaps the lm_head for one forward (tandem.rl.logprobs).
    def get_output_embeddings(self):
        return self.peft_model.get_output_embeddings()

    def set_output_embeddings(self, head) -> None:
        self.peft_model.set_output_embeddings(head)
