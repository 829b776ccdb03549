"""Checking a weight update whole before any of it is copied, so a bad one changes nothing.

`check_weights` runs each tensor's own weight loader on meta tensors (shapes and dtypes, no
data): every name, shape and dtype that `load_weights` would refuse part-way is refused here
first, merged q/k/v and gate/up and tensor-parallel shards included.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable

import torch
from torch import nn

from tandem.models.loader import checkpoint_target

# (name, shape, dtype): what a weight update will hold, known before its data is
TensorSpec = tuple[str, tuple[int, ...], torch.dtype]

# safetensors header dtypes (the floating ones load; the others are refused)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
              "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def specs_of(weights: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [(name, tuple(t.shape), t.dtype) for name, t in weights]


def checkpoint_specs(path: str) -> list[TensorSpec] | None:
    """The specs of a safetensors checkpoint directory, from its headers alone (None for other
    formats: their tensors are read to be checked)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        return None
    from safetensors import safe_open

    specs = []
    for f in files:
        with safe_open(f, framework="pt") as fh:
            for name in fh.keys():
                part = fh.get_slice(name)
                dtype = _ST_DTYPES.get(part.get_dtype())
                if dtype is None:
                    raise ValueError(f"{name}: dtype {part.get_dtype()} cannot be loaded")
                specs.append((name, tuple(part.get_shape()), dtype))
    return specs


@torch.no_grad()
def check_weights(model: nn.Module, specs: Iterable[TensorSpec]) -> set[str]:
    """The parameter names the update fills; a ValueError naming the first tensor that
    `load_weights` would refuse (an unknown name, a wrong shape, a dtype that is not floating)."""
    params = dict(model.named_parameters())
    targets: set[str] = set()
    for name, shape, dtype in specs:
        found = checkpoint_target(model, params, name)  # the loader's own name mapping
        if found is None:
            continue
        target, shard, param = found
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"{name}: dtype {dtype} is not a floating-point type "
                             f"(the parameter is {param.dtype})")
        module = model.get_submodule(target.rsplit(".", 1)[0])
        loader = getattr(module, "weight_loader", None)
        shadow = torch.empty(param.shape, dtype=param.dtype, device="meta")
        loaded = torch.empty(shape, dtype=param.dtype, device="meta")
        try:
            if loader is not None:
                loader(shadow, loaded, shard)  # on meta tensors: the checks, no copy
            elif tuple(param.shape) != tuple(shape):
                raise ValueError(f"shape {tuple(shape)} != parameter {tuple(param.shape)}")
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"{name}: {e}") from None
        targets.add(target)
    return targets
