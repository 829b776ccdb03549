"""Rotary position embedding with a precomputed cos/sin cache, numerically as HF computes it."""

from __future__ import annotations

import torch
from torch import nn

from tandem.kernels.rotary_ref import apply_rotary_ref


def rope_parameters(hf_config) -> dict:
    """The model's rope settings as one dict (transformers 5 `rope_parameters`, or 4.x fields)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    for k, v in legacy.items():
        params.setdefault(k, v)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling; non-default rope types use transformers' code."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type in ("dynamic", "longrope"):
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3, yarn"
        )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k shaped [T, N, H] at the given positions [T].

    On a GPU one Triton kernel rotates q and k in place (no autograd through it); elsewhere, or
    when q or k needs a gradient, plain torch returns new tensors
    (`tandem.kernels.rotary.apply_rotary_ref`). Both round alike.
    """

    def __init__(self, hf_config, head_dim: int, max_position: int):
        super().__init__()
        inv_freq, scaling = inverse_frequencies(hf_config, head_dim)
        t = torch.arange(max_position, dtype=torch.float)
        freqs = t[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # fp32 cache; cast to the activations' dtype at use, as HF does.
        self.register_buffer("cos_cache", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scaling, persistent=False)

    def forward(
        self, positions: torch.Tensor, q_TNH: torch.Tensor, k_TNH: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q_TNH.is_cuda and not (q_TNH.requires_grad or k_TNH.requires_grad):
            from tandem.kernels.rotary import apply_rotary

            return apply_rotary(positions, q_TNH, k_TNH, self.cos_cache, self.sin_cache)
        return apply_rotary_ref(positions, q_TNH, k_TNH, self.cos_cache, self.sin_cache)
