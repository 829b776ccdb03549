"""Megatron-style gradient-accumulation fusion for the decoder layers' Linears of the model the
trainer trains (with `GRPOConfig.fused_kernels`, under bf16 autocast over fp32 master weights).

Under autocast each nn.Linear's backward writes its weight gradient as a bf16 [out, in] GEMM
output, autograd casts it to fp32 and AccumulateGrad adds it into `weight.grad`: three passes over
[out, in] a micro-batch, and every micro-batch's gradient rounded to bf16 before it is summed.
Here the forward is autocast's (x and W cast to bf16 once, the casts saved for backward, bias
added by the GEMM) and the backward is one GEMM for grad_x and one for the weight gradient, whose
fp32 output accumulates straight into `weight.grad` (beta = 1; the first micro-batch after
`zero_grad(set_to_none=True)` allocates it as the GEMM's output). Autograd gets None for the
weight, so it does not accumulate again.

The gradient reaches `.grad` inside backward: it suits `loss.backward()` followed by an explicit
reduction (the Replicate strategy's all-reduce after the step's micro-batches), not
`torch.autograd.grad` or hooks on a weight's AccumulateGrad node (DDP's). A patched Linear runs
F.linear, exactly as unpatched, where autocast is off, the weight is frozen (LoRA's base) or not
fp32 (FSDP2 under the trainer's bf16 policy all-gathers bf16 weights itself), has Python grad
hooks, or the batch-invariant mode is on. The patch is per instance, as `fused_layers`'s.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from tandem import batch_invariant
from tandem.layers.linear import addmm_fp32_, linear_fp32_out


class _GradAccumLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        x_lp, w_lp = x.to(dtype), weight.to(dtype)  # autocast's casts, saved as autocast saves them
        ctx.save_for_backward(x_lp, w_lp)
        ctx.x_dtype = x.dtype
        ctx.weight, ctx.bias = weight, bias  # leaves: their .grad is written in backward
        return F.linear(x_lp, w_lp, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, g):
        x_lp, w_lp = ctx.saved_tensors
        g = g.to(w_lp.dtype)
        grad_x = (g @ w_lp).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        g_MO, x_MI = g.reshape(-1, g.shape[-1]), x_lp.reshape(-1, x_lp.shape[-1])
        weight = ctx.weight
        if weight.grad is None:
            weight.grad = linear_fp32_out(g_MO.t(), x_MI.t())  # [out, in] fp32, unrounded
        else:
            addmm_fp32_(weight.grad, g_MO.t(), x_MI)
        bias = ctx.bias
        if bias is not None and bias.requires_grad:
            db = g_MO.sum(0, dtype=torch.float32)
            if bias.grad is None:
                bias.grad = db
            else:
                bias.grad.add_(db)
        return grad_x, None, None, None


def _fusable(weight: torch.Tensor, device_type: str) -> bool:
    return (torch.is_grad_enabled() and torch.is_autocast_enabled(device_type)
            and weight.requires_grad and weight.is_leaf and weight.dtype == torch.float32
            and not weight._backward_hooks and not getattr(weight, "_post_accumulate_grad_hooks", None)
            and not batch_invariant.is_enabled())


def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    device = x.device.type
    bias = self.bias
    if not _fusable(self.weight, device) or (bias is not None and not _fusable(bias, device)):
        return F.linear(x, self.weight, bias)
    return _GradAccumLinear.apply(x, self.weight, bias, torch.get_autocast_dtype(device))


def why_off(bf16: bool, fsdp: bool, batch_invariant: bool, lora: bool) -> str | None:
    """The trainer's settings under which the fusion stays off, as the line that says so."""
    why = ("fp32 training: no autocast cast to fuse" if not bf16 else
           "fsdp=True: FSDP2 hands the Linears bf16 weights, cast by its all-gather" if fsdp else
           "batch_invariant=True: the trainer's numerics stay as they are" if batch_invariant else
           "LoRA: the projections are frozen" if lora else None)
    return None if why is None else f"fused weight-gradient accumulation: off ({why})"


def patch_model(model: torch.nn.Module) -> str:
    """Patch every nn.Linear of `model`'s decoder layers (a HF causal LM) in place; returns the
    line that says so."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = list(getattr(base.get_decoder(), "layers", []))
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears:
        m.forward = types.MethodType(_linear_forward, m)
    return (f"fused weight-gradient accumulation: on ({len(linears)} Linears in {len(layers)} decoder "
            "layers: fp32 weight gradients accumulated by their GEMM)")


def is_patched(model: torch.nn.Module) -> bool:
    return any(getattr(vars(m).get("forward"), "__func__", None) is _linear_forward for m in model.modules())
