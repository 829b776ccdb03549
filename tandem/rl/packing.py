"""Padding-free training batches (`GRPOConfig.padding_free`): a micro-batch's rows concatenated
into one sequence, position ids restarting at each row, attention kept inside each row.

No FLOP is spent on padding, whatever the spread of completion lengths. HF's model code runs as
it is: the attention is a function registered with transformers' `AttentionInterface` that reads
the segments' boundaries (`cu_seq_lens_q` / `cu_seq_lens_k`, as flash-attention's padding-free
path names them) and runs causal attention per segment: torch's varlen flash attention on a GPU
in bf16, SDPA segment by segment otherwise (exact, for the CPU and tests).

Shared prompts (`GRPOConfig.share_prompts`): a GRPO group's G rows start with the same prompt,
whose hidden states are the same in every row (causal attention: a prompt token sees only the
prompt). Packed with its prompt once, a group is [prompt, completion 1, ..., completion G]: the
prompt's segment attends causally to itself, each completion's to the prompt's keys and its own,
causally from the bottom right (flash attention's alignment when there are more keys than
queries). The keys are gathered per segment (`tandem_kv_index`); autograd sums the G completions'
gradients into the prompt's once. G rows of P + C tokens cost P + G C tokens instead of G (P + C).

Shapes: S = tokens of the packed micro-batch, Sk = keys over all segments, H = heads, K = kv
heads, D = head dim, B = rows.
"""

from __future__ import annotations

import inspect
from functools import cache
from itertools import pairwise

import torch
import torch.nn.functional as F

ATTENTION = "tandem_varlen"


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, seq_lens_cpu: torch.Tensor | None = None,
              prompt_groups: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """Right-padded rows [B, L] -> one packed row. Returns the model's keyword arguments
    (`model_kwargs`: input_ids / position_ids [1, S], the segments' boundaries and longest
    lengths) and where each row's tokens went (`packed_positions`). `seq_lens_cpu`: the rows'
    lengths on the host, where the caller has them: the packing is then planned there and the
    device is not read back. `prompt_groups`: the rows' (prompt lengths, group ids) on the host;
    rows with one id have the same prompt, which is then packed once (module docstring)."""
    # no row is left-padded (rollout.pack): a row's tokens are its first `length`
    lengths = (attention_mask.sum(-1).cpu() if seq_lens_cpu is None else seq_lens_cpu).to(torch.int64)
    B, L = input_ids.shape
    if prompt_groups is None:
        cu = F.pad(torch.cumsum(lengths, 0), (1, 0))
        positions = torch.arange(int(cu[-1])) - cu[:-1].repeat_interleave(lengths)
        flat = torch.repeat_interleave(torch.arange(B), lengths) * L + positions  # each token's place in [B, L]
        cu_q = cu_k = cu
        kv_index, row_starts, shift = None, cu[:-1], None
    else:
        flat, positions, cu_q, cu_k, kv_index, row_starts, shift = _shared_layout(lengths, *prompt_groups, L)
    dev = input_ids.device
    cu_q32 = to_device(cu_q.to(torch.int32), dev)
    kwargs = dict(input_ids=input_ids.reshape(-1)[to_device(flat, dev)][None],
                  position_ids=to_device(positions, dev)[None],
                  cu_seq_lens_q=cu_q32, max_length_q=int(cu_q.diff().max()),
                  cu_seq_lens_k=cu_q32 if kv_index is None else to_device(cu_k.to(torch.int32), dev),
                  max_length_k=int(cu_k.diff().max()))
    if kv_index is not None:
        kwargs["tandem_kv_index"] = to_device(kv_index, dev)
    out = {"model_kwargs": kwargs, "row_starts": to_device(row_starts, dev), "tokens": int(cu_q[-1])}
    if shift is not None:
        out["prompt_lens"], out["completion_shift"] = to_device(prompt_groups[0], dev), to_device(shift, dev)
    return out


def _shared_layout(lengths: torch.Tensor, prompt_lens: torch.Tensor, groups: torch.Tensor, L: int):
    """The packing with each group's prompt once: per group (in order of its first row), the
    prompt (taken from its first row), then each row's completion. Returns each packed token's
    place in [B, L], its position, the query and key segments' boundaries, the keys' source
    tokens, each row's prompt start and how far its completion sits past prompt start + prompt."""
    prompt_lens, lengths = prompt_lens.tolist(), lengths.tolist()
    flat, positions, q_lens, k_lens, kv = [], [], [], [], []
    row_starts, shift = [0] * len(lengths), [0] * len(lengths)
    at = 0  # packed tokens so far
    for rows in rows_by_prompt(groups.tolist()):
        P = prompt_lens[rows[0]]
        if any(prompt_lens[b] != P for b in rows):
            raise ValueError(f"rows {rows} share a prompt group but not a prompt length "
                             f"({[prompt_lens[b] for b in rows]})")
        prompt = torch.arange(at, at + P)
        flat.append(rows[0] * L + torch.arange(P))
        positions.append(torch.arange(P))
        q_lens.append(P)
        k_lens.append(P)
        kv.append(prompt)
        start, at = at, at + P
        for b in rows:
            C = lengths[b] - P
            row_starts[b], shift[b] = start, at - (start + P)
            if C <= 0:
                continue
            flat.append(b * L + torch.arange(P, P + C))
            positions.append(torch.arange(P, P + C))
            q_lens.append(C)
            k_lens.append(P + C)
            kv += [prompt, torch.arange(at, at + C)]
            at += C
    cu_q = F.pad(torch.cumsum(torch.tensor(q_lens), 0), (1, 0))
    cu_k = F.pad(torch.cumsum(torch.tensor(k_lens), 0), (1, 0))
    return (torch.cat(flat), torch.cat(positions), cu_q, cu_k, torch.cat(kv),
            torch.tensor(row_starts), torch.tensor(shift))


def rows_by_prompt(ids: list[int]) -> list[list[int]]:
    """The rows of each prompt group id, groups in order of their first row."""
    members: dict[int, list[int]] = {}
    for row, g in enumerate(ids):
        members.setdefault(g, []).append(row)
    return list(members.values())


def packed_positions(packed: dict, b_idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Where row b_idx's token at position pos sits in the packed sequence (`pack_rows`)."""
    out = packed["row_starts"][b_idx] + pos
    if "completion_shift" in packed:  # a completion sits after its group's earlier completions
        out = out + torch.where(pos >= packed["prompt_lens"][b_idx], packed["completion_shift"][b_idx], 0)
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, copied without waiting for the device's queue."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                     scaling: float | None = None, **kwargs):
    """transformers' attention-function protocol: query [1, H, S, D], key/value [1, K, S, D];
    returns ([1, S, H, D], None). Causal within each segment `cu_seq_lens_q` delimits, over the
    keys `cu_seq_lens_k` delimits (of the tokens `tandem_kv_index` names, when it is given),
    aligned at the bottom right."""
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is None:
        raise ValueError("the padding-free attention needs cu_seq_lens_q (rows packed by rl.packing)")
    cu_k, kv_index = kwargs.get("cu_seq_lens_k", cu_q), kwargs.get("tandem_kv_index")
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [S, ., D]
    if kv_index is not None:
        k, v = k.index_select(0, kv_index), v.index_select(0, kv_index)  # [Sk, K, D]
    dtype = torch.get_autocast_dtype("cuda") if q.is_cuda and torch.is_autocast_enabled("cuda") else q.dtype
    if q.is_cuda and dtype in (torch.bfloat16, torch.float16) and _flash_varlen() is not None:
        out = _flash_varlen()(q.to(dtype), k.to(dtype), v.to(dtype), cu_q, cu_k, int(kwargs["max_length_q"]),
                              int(kwargs.get("max_length_k", kwargs["max_length_q"])), scaling)
    else:
        out = torch.empty_like(q)
        groups = q.shape[1] // k.shape[1]
        for (qs, qe), (ks, ke) in zip(_pairs(cu_q), _pairs(cu_k)):
            qi, ki, vi = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
            if groups > 1:
                ki, vi = ki.repeat_interleave(groups, 0), vi.repeat_interleave(groups, 0)
            Lq, Lk = qe - qs, ke - ks
            mask = None if Lq == Lk else torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril(Lk - Lq)
            out[qs:qe] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=mask is None,
                                                        scale=scaling).transpose(0, 1)
    return out[None], None


def _pairs(cu: torch.Tensor) -> list[tuple[int, int]]:
    return list(pairwise(cu.tolist()))


@cache
def _flash_varlen():
    """torch's varlen flash attention as fn(q, k, v, cu_q, cu_k, max_q, max_k, scale), causal
    from the bottom right, if this torch has it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}

    def run(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        if k.shape[1] != q.shape[1] and "enable_gqa" not in params:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        extra = {"enable_gqa": True} if "enable_gqa" in params and k.shape[1] != q.shape[1] else {}
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, **causal, **extra)

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
