"""Torch references of `batch_invariant`'s kernels: what they compute, not how they order it."""

from __future__ import annotations

import torch


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) accumulated in fp32, rounded once to `out_dtype` (x's by default)."""
    out = x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or x.dtype)


def token_logprobs_ref(logits: torch.Tensor, tokens: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T)[token] per row, in fp32."""
    lp = torch.log_softmax(logits.float() / temperature.float()[:, None], dim=-1)
    return lp.gather(1, tokens.long()[:, None]).squeeze(1)
