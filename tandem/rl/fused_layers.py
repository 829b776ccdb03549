"""Fused Triton training kernels in the HF model the trainer trains (`GRPOConfig.fused_kernels`):
RMSNorm, SwiGLU and rotary as one kernel each way, instead of HF's chains of elementwise ops
and autocast's casts.

The patch is per instance: each decoder layer's norms, attention and MLP of *this* model get a
forward of their own (`module.forward`); transformers' classes and every other model in the
process are untouched. The forwards call the model's own submodules (q_proj, ..., peft's LoRA
wrappers when they are there), so LoRA, gradient checkpointing (HF's per-layer checkpoint
recomputes these forwards), padding-free packing (the attention function is still the one
`config._attn_implementation` names) and FSDP2 (the parameters are read at call time, unsharded)
work as they do unpatched.

Numerics: HF's, op for op, with one kind of change, under autocast only (bf16 over fp32 master
weights): a layer's two norms and the rotary hand their consumers autocast's dtype directly,
the very values autocast's cast would have made (so q/k/v and gate/up no longer each cast the
same fp32 tensor, and the attention gets bf16 q/k). The backward differs in one place: the
gradients of a norm's consumers (q, k, v; gate, up) arrive in bf16 and autograd sums them in
bf16, where HF sums their fp32 casts; each addend is a bf16 GEMM's output either way.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types

import torch
import torch.nn.functional as F

from tandem.checks import check_triton_device

logger = logging.getLogger(__name__)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # tandem.models.registry's, by model_type


def resolve(fused_kernels: bool | None, device: torch.device, use_liger_kernel: bool = False) -> tuple[bool, str]:
    """Whether to patch, and the line that says so when not. None is on for CUDA with Triton
    installed and off elsewhere; use_liger_kernel=True (TRL's switch) stands for True when
    fused_kernels is None; True where the kernels cannot run is a ValueError naming the field."""
    name = "fused_kernels"
    if fused_kernels is None and use_liger_kernel:
        fused_kernels, name = True, "use_liger_kernel"
    triton = importlib.util.find_spec("triton") is not None
    if fused_kernels is None:
        if device.type == "cuda" and triton:
            return True, ""
        why = "triton is not installed" if not triton else f"training on {device.type!r}"
        return False, f"fused kernels: off ({why}; fused_kernels=None turns them on with CUDA and Triton)"
    if not fused_kernels:
        return False, "fused kernels: off (fused_kernels=False)"
    if not triton:
        raise ValueError(f"{name}=True runs tandem's Triton kernels and triton is not installed; "
                         f"install it or set {name}=False")
    check_triton_device(f"{name}=True", device.type, f"; or set {name}=False")
    return True, ""


# -- autograd functions -----------------------------------------------------------------------------
class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, out_dtype):
        from tandem.kernels.rmsnorm import rms_norm

        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm(x, weight, eps, out_dtype)

    @staticmethod
    def backward(ctx, dy):
        from tandem.kernels.rmsnorm import rms_norm_backward

        x, weight = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, ctx.eps, weight_grad=ctx.needs_input_grad[1])
        return dx, dw, None, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        from tandem.kernels.activation import silu_mul

        ctx.save_for_backward(gate, up)  # the backward recomputes silu from the gate
        return silu_mul(gate, up)

    @staticmethod
    def backward(ctx, dy):
        from tandem.kernels.activation import silu_mul_backward

        gate, up = ctx.saved_tensors
        return silu_mul_backward(dy, gate, up)


class _RotaryQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BLNH, k_BLKH, cos_BLH, sin_BLH, out_dtype):
        from tandem.kernels.rotary_train import rotary_qk

        ctx.save_for_backward(cos_BLH, sin_BLH)
        ctx.dtype = q_BLNH.dtype
        return rotary_qk(q_BLNH, k_BLKH, cos_BLH, sin_BLH, out_dtype)

    @staticmethod
    def backward(ctx, dq_BNLH, dk_BKLH):
        from tandem.kernels.rotary_train import rotary_qk_backward

        cos, sin = ctx.saved_tensors
        dq, dk = rotary_qk_backward(dq_BNLH, dk_BKLH, cos, sin, ctx.dtype)
        return dq, dk, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None):
    """HF's RMSNorm as one kernel each way (autograd); `out_dtype` rounds its output to another dtype."""
    return _RMSNorm.apply(x, weight, eps, out_dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up as one kernel each way (autograd)."""
    return _SiluMul.apply(gate, up)


def rotary_qk(q_BLNH, k_BLKH, cos_BLH, sin_BLH, out_dtype: torch.dtype | None = None):
    """HF's `apply_rotary_pos_emb` on q/k as the projections give them ([B, L, heads, H]), as one
    kernel each way (autograd); returns them rotated in HF's [B, heads, L, H] layout."""
    return _RotaryQK.apply(q_BLNH, k_BLKH, cos_BLH, sin_BLH, out_dtype)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


# -- the forwards set on the modules (self: the HF module) --------------------------------------------
def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # A layer norm whose consumers are all autocast linears emits their input dtype: the same
    # values autocast's cast of HF's fp32 output would be (see the module docstring).
    out_dtype = _autocast_dtype(hidden_states) if self._tandem_feeds_linears else None
    return rms_norm(hidden_states, self.weight, self.variance_epsilon, out_dtype)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    act = silu_mul(gate, up) if gate.dtype == up.dtype else F.silu(gate) * up
    return self.down_proj(act)


_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """HF's Llama/Mistral/Qwen2/Qwen3 attention forward with `apply_rotary_pos_emb` fused; with a
    KV cache (generation) or cos/sin that need a gradient: HF's own forward."""
    cos, sin = position_embeddings if position_embeddings is not None else (None, None)
    if any(kwargs.get(k) is not None for k in _CACHE_KWARGS) or cos is None or cos.dim() != 3 \
            or cos.requires_grad or sin.requires_grad:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)
    for k in _CACHE_KWARGS:
        kwargs.pop(k, None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q_BLNH = self.q_proj(hidden_states).view(hidden_shape)
    k_BLKH = self.k_proj(hidden_states).view(hidden_shape)
    v_BKLH = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    if self._tandem_qk_norm:  # Qwen3: RMSNorm over each head's dims, before the rotation
        q_BLNH, k_BLKH = self.q_norm(q_BLNH), self.k_norm(k_BLKH)
    if q_BLNH.dtype != k_BLKH.dtype:
        raise ValueError(f"fused rotary: q is {q_BLNH.dtype} and k {k_BLKH.dtype}")
    # On CUDA under autocast every attention casts q/k to autocast's dtype: emit it directly.
    out_dtype = _autocast_dtype(q_BLNH) if q_BLNH.is_cuda else None
    q_BNLH, k_BKLH = rotary_qk(q_BLNH.contiguous(), k_BLKH.contiguous(), cos, sin, out_dtype)
    attention = _attention_function(self)
    extra = {} if self._tandem_sliding is False else {
        "sliding_window": getattr(self, "sliding_window", getattr(self.config, "sliding_window", None))}
    out, weights = attention(self, q_BNLH, k_BKLH, v_BKLH, attention_mask,
                             dropout=0.0 if not self.training else self.attention_dropout,
                             scaling=self.scaling, **extra, **kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def _attention_function(module):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = module.config._attn_implementation
    eager = sys.modules[type(module).__module__].eager_attention_forward
    get = getattr(ALL_ATTENTION_FUNCTIONS, "get_interface", None)
    if get is not None:
        return get(impl, eager)
    return eager if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]


# -- the patch ----------------------------------------------------------------------------------------
def patch_model(model: torch.nn.Module) -> str:
    """Patch `model` (a HF causal LM of a family in FAMILIES, or its peft wrapper) in place; returns
    one line saying what was patched, or why nothing was."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    family = getattr(base.config, "model_type", None)
    if family not in FAMILIES:
        return f"fused kernels: off (model_type {family!r} is not one of {', '.join(FAMILIES)})"
    decoder = base.get_decoder()
    layers = list(getattr(decoder, "layers", []))
    missing = [name for name in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
               if not layers or not all(hasattr(layer, name) for layer in layers)]
    if missing or not hasattr(decoder, "norm"):
        return f"fused kernels: off ({type(base).__name__}'s decoder layers lack {missing or ['norm']})"
    silu = base.config.hidden_act in ("silu", "swish")
    for layer in layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            _patch_norm(norm, feeds_linears=True)
        attn = layer.self_attn
        attn._tandem_qk_norm = hasattr(attn, "q_norm")
        if attn._tandem_qk_norm:
            _patch_norm(attn.q_norm, feeds_linears=False)
            _patch_norm(attn.k_norm, feeds_linears=False)
        attn._tandem_sliding = family != "llama"  # Mistral/Qwen pass sliding_window, Llama not
        attn.forward = types.MethodType(_attention_forward, attn)
        if silu:
            layer.mlp.forward = types.MethodType(_mlp_forward, layer.mlp)
    _patch_norm(decoder.norm, feeds_linears=False)  # the head's input: HF's fp32, exactly
    ops = "RMSNorm, rotary" + (", SwiGLU" if silu else f" (hidden_act {base.config.hidden_act!r}: MLP as HF's)")
    return f"fused kernels: on ({ops}; Triton) in {len(layers)} {family} decoder layers"


def _patch_norm(norm: torch.nn.Module, feeds_linears: bool) -> None:
    norm._tandem_feeds_linears = feeds_linears
    norm.forward = types.MethodType(_norm_forward, norm)


def is_patched(model: torch.nn.Module) -> bool:
    return any("forward" in vars(m) and getattr(m.forward, "__func__", None) in
               (_norm_forward, _attention_forward, _mlp_forward) for m in model.modules())
