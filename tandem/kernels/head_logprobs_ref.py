"""Torch references of `head_logprobs`'s kernels: the spec they are tested against.

Shape suffixes: C = tokens of a chunk, V = vocabulary.
"""

from __future__ import annotations

import torch


def lse_logprobs_ref(x_CV: torch.Tensor,
                     target_C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp of each row [C], x[c, target[c]] - logsumexp [C]) of fp32 logits x [C, V]."""
    lse_C = torch.logsumexp(x_CV, dim=-1)
    return lse_C, x_CV.gather(1, target_C[:, None]).squeeze(1) - lse_C


def logprob_grad_ref(x_CV: torch.Tensor, lse_C: torch.Tensor, grad_C: torch.Tensor,
                     target_C: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """(1[j=t] - exp(x - lse)) * grad / T in `dtype`: d(grad . logp) / d(the logits before / T),
    x being those logits / T."""
    onehot_CV = torch.nn.functional.one_hot(target_C, x_CV.shape[1]).to(torch.float32)
    g_CV = (onehot_CV - torch.exp(x_CV - lse_C[:, None])) * (grad_C / temperature)[:, None]
    return g_CV.to(dtype)
