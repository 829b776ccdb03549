"""Finds a model's config, weights and tokenizer: HF dir, in-memory HF model, preset, GGUF."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tandem.models import gguf, hub
from tandem.models.decoder import DecoderForCausalLM
from tandem.models.presets import preset_config
from tandem.models.registry import get_decoder_spec


@dataclass
class ModelSource:
    """Where a model comes from; `weights()` yields (hf_name, tensor) pairs."""

    hf_config: object
    path: str | None = None  # HF directory
    hf_model: nn.Module | None = None  # in-memory transformers model
    tokenizer_path: str | None = None

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.hf_model is not None:
            yield from self.hf_model.state_dict().items()
        elif self.path is not None:
            yield from iterate_checkpoint(self.path)
        else:
            raise ValueError("this model has no weights to load; use load_format='dummy'")


def resolve_model(model, load_format: str, trust_remote_code: bool = False,
                  revision: str | None = None) -> ModelSource:
    """Where `model` comes from: an in-memory model, None (the embedded default), a GGUF file, a
    local directory, a preset architecture (load_format="dummy") or a hub id (`tandem.models.hub`)."""
    from transformers import AutoConfig

    if isinstance(model, nn.Module):
        if not hasattr(model, "config"):
            raise ValueError("model: an in-memory model must be a transformers PreTrainedModel")
        path = getattr(model.config, "_name_or_path", None)
        tok = path if path and os.path.isdir(path) else None
        return ModelSource(hf_config=model.config, hf_model=model, tokenizer_path=tok)
    if model is None:
        model = str(gguf.converted_dir(gguf.default_gguf_path()))
    model = str(model)
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ValueError(f"model: GGUF file {model!r} does not exist")
        model = str(gguf.converted_dir(Path(model)))
    if not os.path.isdir(model) and hub.looks_like_repo_id(model) and not (
        load_format == "dummy" and preset_config(model) is not None
    ):
        model = hub.snapshot_dir(model, revision)
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model: directory {model!r} has no config.json")
        cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        has_tok = any(
            os.path.isfile(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer_config.json")
        )
        return ModelSource(hf_config=cfg, path=model, tokenizer_path=model if has_tok else None)
    cfg = preset_config(model)
    if cfg is not None:
        if load_format != "dummy":
            raise ValueError(
                f"model: {model!r} names an architecture without weights here; "
                "pass load_format='dummy' for random weights, or a local model directory"
            )
        return ModelSource(hf_config=cfg)
    raise ValueError(
        f"model: {model!r} is not a local directory, a .gguf file or a known architecture name; "
        "a hub id is 'org/name'"
    )


def iterate_checkpoint(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors import safe_open

        for f in files:
            with safe_open(f, framework="pt") as fh:
                for name in fh.keys():
                    yield name, fh.get_tensor(name)
        return
    files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not files:
        raise ValueError(f"model: no *.safetensors or pytorch_model*.bin weights in {path!r}")
    for f in files:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()


def build_model(hf_config, max_position: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    spec = get_decoder_spec(hf_config)
    with torch.device(device):
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = DecoderForCausalLM(hf_config, max_position, spec)
        finally:
            torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def _target_name(model: nn.Module, name: str) -> tuple[str, object]:
    for ckpt, (merged, shard) in model.packed_modules_mapping.items():
        if f".{ckpt}." in name:
            return name.replace(f".{ckpt}.", f".{merged}."), shard
    return name, None


def checkpoint_target(model: nn.Module, params: dict, name: str):
    """(parameter name, shard id, parameter) that an HF checkpoint tensor loads into, or None for
    a tensor the model does not keep (rotary's inv_freq, a tied lm_head). Unknown names raise, so
    a renamed checkpoint cannot silently leave random weights behind."""
    if "rotary_emb.inv_freq" in name:
        return None
    if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
        return None
    target, shard = _target_name(model, name)
    param = params.get(target)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
    return target, shard, param


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy HF-named tensors into the model's (possibly merged) parameters, in place.

    Returns the parameter names that were filled. Unknown names raise, so a renamed checkpoint
    cannot silently leave random weights behind.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        found = checkpoint_target(model, params, name)
        if found is None:
            continue
        target, shard, param = found
        module = model.get_submodule(target.rsplit(".", 1)[0])
        loader = getattr(module, "weight_loader", None)
        tensor = tensor.to(device=param.device, dtype=param.dtype, non_blocking=True)
        if loader is not None:
            loader(param, tensor, shard)
        elif param.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != parameter {tuple(param.shape)}")
        else:
            param.data.copy_(tensor)
        loaded.add(target)
    return loaded


def check_all_loaded(model: nn.Module, loaded: set[str]) -> None:
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights with sane scales (norms 1, small uniform elsewhere), as vLLM's dummy format."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
            continue
        gen = gens.get(p.device)
        if gen is None:
            gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        p.uniform_(-1e-3, 1e-3, generator=gen)
