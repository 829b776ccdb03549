"""Padding-free training batches (`GRPOConfig.padding_free`): a micro-batch's rows concatenated
into one sequence, position ids restarting at each row, attention kept inside each row.

No FLOP is spent on padding, whatever the spread of completion lengths. HF's model code runs as
it is: the attention is a function registered with transformers' `AttentionInterface` that reads
the rows' boundaries (`cu_seq_lens_q`, as flash-attention's padding-free path names them) and
runs causal attention per row: torch's varlen flash attention on a GPU in bf16, SDPA row by row
otherwise (exact, for the CPU and tests).

Shapes: S = tokens of the packed micro-batch, H = heads, K = kv heads, D = head dim, B = rows.
"""

from __future__ import annotations

import inspect
from functools import cache

import torch
import torch.nn.functional as F

ATTENTION = "tandem_varlen"


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor,
              seq_lens_cpu: torch.Tensor | None = None) -> dict:
    """Right-padded rows [B, L] -> one packed row: input_ids / position_ids [1, S], the row
    boundaries cu_seqlens [B + 1] (int32), the longest row, and where each row starts.
    `seq_lens_cpu`: the rows' lengths on the host, where the caller has them: the packing is then
    planned there and the device is not read back."""
    # no row is left-padded (rollout.pack): a row's tokens are its first `length`
    lengths = (attention_mask.sum(-1).cpu() if seq_lens_cpu is None else seq_lens_cpu).to(torch.int64)
    B, L = input_ids.shape
    cu = F.pad(torch.cumsum(lengths, 0), (1, 0))
    row = torch.repeat_interleave(torch.arange(B), lengths)  # [S]: each packed token's row
    positions = torch.arange(int(cu[-1])) - cu[:-1].repeat_interleave(lengths)
    dev = input_ids.device
    flat = to_device(row * L + positions, dev)  # each packed token's place in [B, L]
    return {"input_ids": input_ids.reshape(-1)[flat][None], "position_ids": to_device(positions, dev)[None],
            "cu_seqlens": to_device(cu.to(torch.int32), dev), "max_len": int(lengths.max()),
            "row_starts": to_device(cu[:-1], dev)}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied without waiting for the device's queue."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                     scaling: float | None = None, **kwargs):
    """transformers' attention-function protocol: query [1, H, S, D], key/value [1, K, S, D];
    returns ([1, S, H, D], None). Causal within each of the rows `cu_seq_lens_q` delimits."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise ValueError("the padding-free attention needs cu_seq_lens_q (rows packed by rl.packing)")
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [S, ., D]
    dtype = torch.get_autocast_dtype("cuda") if q.is_cuda and torch.is_autocast_enabled("cuda") else q.dtype
    if q.is_cuda and dtype in (torch.bfloat16, torch.float16) and _flash_varlen() is not None:
        out = _flash_varlen()(q.to(dtype), k.to(dtype), v.to(dtype), cu, int(kwargs["max_length_q"]), scaling)
    else:
        out = torch.empty_like(q)
        groups = q.shape[1] // k.shape[1]
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            qs, ks, vs = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
            if groups > 1:
                ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
            out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling).transpose(0, 1)
    return out[None], None


@cache
def _flash_varlen():
    """torch's varlen flash attention as fn(q, k, v, cu, max_len, scale), if this torch has it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}

    def run(q, k, v, cu, max_len, scale):
        if k.shape[1] != q.shape[1] and "enable_gqa" not in params:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        extra = {"enable_gqa": True} if "enable_gqa" in params and k.shape[1] != q.shape[1] else {}
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **causal, **extra)

    return run


def use_varlen_attention(model: torch.nn.Module) -> None:
    """The model's attention is `ATTENTION` from now on: a padding-free trainer runs every pass
    packed, and activation checkpointing recomputes each layer inside backward, after the
    forward's own switch (`logprobs._attention`) would have been undone."""
    model.config._attn_implementation = register()


@cache
def register() -> str:
    """Make `ATTENTION` a transformers attention implementation (and one that builds no mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, varlen_attention)
    AttentionMaskInterface.register(ATTENTION, lambda *args, **kwargs: None)
    return ATTENTION
