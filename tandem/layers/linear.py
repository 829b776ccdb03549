"""Linear layers with weight loaders, so checkpoints load into merged (q/k/v, gate/up) weights.

Tensor parallelism replaces these from outside the model (`tandem.parallel`); each layer's
`weight_loader(param, loaded, shard_id)` is where a parallel version picks its slice.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from tandem import batch_invariant
from tandem.kernels.cublaslt import LtAlgo
from tandem.kernels.sm90_gemm import Sm90GemmConfig, Sm90GluConfig


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


# Whether an MLP's down projection takes SiLU-and-mul into its Triton decode GEMM where its table
# picks that GEMM (`apply_down_proj`): off until measured on the GPU; `TANDEM_FUSED_SILU_DOWN=1`
# turns it on (an A/B switch, read once at import, as `tandem.kernels.pdl`'s).
FUSED_SILU_DOWN = os.environ.get("TANDEM_FUSED_SILU_DOWN", "0") == "1"

_MM_OUT_DTYPE: dict[str, bool] = {}  # device type -> whether torch.mm takes out_dtype there
_ADDMM_OUT_DTYPE: dict[str, bool] = {}  # device type -> whether torch.addmm takes out_dtype (and out=) there


def linear_fp32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in fp32: one GEMM in the inputs' dtype whose fp32 accumulator is returned
    unrounded (bf16 products are exact in fp32). The lm_head of the engine and the trainer's
    log-prob head both use it, so the two score tokens from the same numbers; rounding logits
    to bf16 alone moves a token's logprob by ~0.03 nats."""
    if batch_invariant.is_enabled():
        from tandem.kernels.batch_invariant import linear as bi_linear

        return bi_linear(x, weight, out_dtype=torch.float32)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return x @ weight.t()
    dev = x.device.type
    if _MM_OUT_DTYPE.get(dev, True):
        try:
            return torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32).view(
                *x.shape[:-1], weight.shape[0])
        except (RuntimeError, NotImplementedError, TypeError):
            _MM_OUT_DTYPE[dev] = False  # e.g. the CPU backend: upcast instead (same products)
    return x.float() @ weight.float().t()


def addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc += a @ b in place, acc fp32 and a, b in their own dtype (bf16 products are exact in
    fp32): one GEMM accumulating into acc (beta = 1) where the backend has it, no fp32 [M, N]
    temporary and no separate add."""
    if a.dtype == b.dtype == torch.float32 or batch_invariant.is_enabled():
        return acc.add_(linear_fp32_out(a, b.t()))
    dev = a.device.type
    if _ADDMM_OUT_DTYPE.get(dev, True):
        try:
            return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        except (RuntimeError, NotImplementedError, TypeError):
            _ADDMM_OUT_DTYPE[dev] = False
    return acc.add_(linear_fp32_out(a, b.t()))


def _decode_choice(decode_gemm: tuple | None, x: torch.Tensor, weight: torch.Tensor):
    """The layer's table entry for x's rows (`tandem.layers.decode_gemm.pick`), or None where no
    decode kernel may run: no table, or autograd (the kernels have no backward)."""
    if decode_gemm is None or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return None
    from tandem.layers.decode_gemm import pick

    return pick(decode_gemm, x.numel() // x.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           decode_gemm: tuple | None = None) -> torch.Tensor:
    """F.linear, or its batch-invariant kernel when that mode is on (`tandem.batch_invariant`), or
    the Triton decode GEMM, a cuBLASLt algorithm or the Hopper cluster GEMM where the layer's
    table (`tandem.layers.decode_gemm`) picks one."""
    if batch_invariant.is_enabled():
        from tandem.kernels.batch_invariant import linear as bi_linear

        return bi_linear(x, weight, bias)
    config = _decode_choice(decode_gemm, x, weight)
    if isinstance(config, LtAlgo):
        if bias is None:  # (`apply_decode_gemm` gives biased layers none)
            from tandem.kernels.cublaslt import linear as lt_linear

            return lt_linear(x, weight, config)
    elif isinstance(config, Sm90GemmConfig):
        from tandem.kernels.sm90_gemm import linear as sm90_linear

        return sm90_linear(x, weight, bias, config, static_weight=True)  # a parameter
    elif config is not None:
        from tandem.kernels.decode_gemm import linear as triton_linear

        return triton_linear(x, weight, bias, config)
    return F.linear(x, weight, bias)


def apply_mlp(gate_up_proj: nn.Module, act_fn: nn.Module, down_proj: nn.Module,
              x: torch.Tensor) -> torch.Tensor:
    """`down_proj(act_fn(gate_up_proj(x)))` for an MLP whose activation is SiLU-and-mul. Where
    the gate/up layer's decode GEMM table gives these rows the cluster GEMM with the activation
    in its epilogue (an `Sm90GluConfig`), one launch for both (`sm90_gemm.gate_up_silu`, the
    bits of the GEMM then the activation kernel); else `apply_down_proj`'s paths."""
    if not batch_invariant.is_enabled():
        config = _decode_choice(getattr(gate_up_proj, "decode_gemm", None), x, gate_up_proj.weight)
        if isinstance(config, Sm90GluConfig):
            from tandem.kernels.sm90_gemm import gate_up_silu

            return down_proj(gate_up_silu(x, gate_up_proj.weight, gate_up_proj.bias, config,
                                          static_weight=True))
    return apply_down_proj(down_proj, act_fn, gate_up_proj(x))


def apply_down_proj(down_proj: nn.Module, act_fn: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """`down_proj(act_fn(gate_up))`, an MLP's down projection after SiLU-and-mul. Where the
    layer's decode GEMM table picks the Triton GEMM for these rows (and `FUSED_SILU_DOWN`), one
    launch instead of two: the activation computed in the GEMM's loads, the same bits
    (`decode_gemm.silu_and_mul_linear`)."""
    if FUSED_SILU_DOWN and not batch_invariant.is_enabled():
        from tandem.kernels.decode_gemm import GemmConfig, silu_and_mul_linear

        config = _decode_choice(getattr(down_proj, "decode_gemm", None), gate_up, down_proj.weight)
        if isinstance(config, GemmConfig):
            return silu_and_mul_linear(gate_up, down_proj.weight, down_proj.bias, config)
    return down_proj(act_fn(gate_up))


class Linear(nn.Linear):
    """A plain linear layer (no sharding)."""

    decode_gemm: tuple | None = None  # set by `tandem.layers.decode_gemm.apply_decode_gemm`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.decode_gemm)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)


class LMHead(Linear):
    """The vocabulary projection; returns fp32 logits (`linear_fp32_out`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return linear_fp32_out(x, self.weight) + self.bias.float()
        return linear_fp32_out(x, self.weight)


class MergedLinear(nn.Linear):
    """Several projections of one input stored as one weight, e.g. q/k/v or gate/up."""

    decode_gemm: tuple | None = None  # as Linear's

    def __init__(self, in_features: int, output_sizes: list[int], shard_ids: list, bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes
        self.shard_ids = list(shard_ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.decode_gemm)

    def shard_range(self, shard_id) -> tuple[int, int]:
        i = self.shard_ids.index(shard_id)
        start = sum(self.output_sizes[:i])
        return start, self.output_sizes[i]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # already merged in the checkpoint
            default_weight_loader(param, loaded)
            return
        start, size = self.shard_range(shard_id)
        default_weight_loader(param.data.narrow(0, start, size), loaded)


class QKVLinear(MergedLinear):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool):
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q, kv, kv], ["q", "k", "v"], bias)
