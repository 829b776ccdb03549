"""Torch reference for paged attention: the spec the Triton kernels are tested against.

Cache layout: k_cache, v_cache are [num_blocks, block_size, num_kv_heads, head_dim]; token slot
s lives at block s // block_size, offset s % block_size. A slot of -1 is skipped (padding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kvcache_ref(
    k_TNH: torch.Tensor,
    v_TNH: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    nkv, hd = k_cache.shape[-2:]
    k_cache.view(-1, nkv, hd)[slots] = k_TNH[valid].to(k_cache.dtype)
    v_cache.view(-1, nkv, hd)[slots] = v_TNH[valid].to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence's cache, [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


# Scores held at once by one query tile, [N, tile, Lk] floats: memory stays linear in the prompt
# (a dense [Lq, Lk] mask made the math fallback hold every score: +1.4 GB at 4k tokens).
_TILE_SCORES = 4 << 20


def causal_attention(q_NLH: torch.Tensor, k_NLH: torch.Tensor, v_NLH: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal attention of Lq queries that are the last of Lk keys: query i, at position
    Lk - Lq + i, sees keys 0 .. Lk - Lq + i. q [N, Lq, H], k/v [N, Lk, H] -> [N, Lq, H]."""
    num_heads, lq, _ = q_NLH.shape
    lk = k_NLH.shape[1]
    if lq == 1:  # decode: the one query sees every key
        return F.scaled_dot_product_attention(q_NLH, k_NLH, v_NLH, scale=scale)
    # Query tiles, each with its own small mask. (is_causal=True without a mask is no better on
    # a CPU: measured, its fallback held all the scores too, +5.5 GB at 8k tokens.)
    tile = max(1, _TILE_SCORES // (num_heads * lk))
    out = torch.empty_like(q_NLH)
    for t0 in range(0, lq, tile):
        t1 = min(lq, t0 + tile)
        end = lk - lq + t1  # keys past the tile's last query are seen by none of it
        mask = torch.ones(t1 - t0, end, dtype=torch.bool, device=q_NLH.device)
        mask = mask.tril(diagonal=lk - lq + t0)
        out[:, t0:t1] = F.scaled_dot_product_attention(
            q_NLH[:, t0:t1], k_NLH[:, :end], v_NLH[:, :end], attn_mask=mask, scale=scale
        )
    return out


def paged_attention_ref(
    q_TNH: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention for a flattened batch whose keys and values are all in the paged cache.

    Sequence b owns queries q[query_start_loc[b]:query_start_loc[b+1]], the last tokens of its
    seq_lens[b] tokens; query i sees keys at positions <= its own. Covers prefill, chunked prefill
    over a cached prefix, and decode (one query per sequence).
    """
    out = torch.empty_like(q_TNH)
    num_heads = q_TNH.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    for b in range(len(seq_lens)):
        q0, q1, n = query_start_loc[b], query_start_loc[b + 1], seq_lens[b]
        if q1 == q0:
            continue
        q = q_TNH[q0:q1].transpose(0, 1)  # [N, Lq, H]
        k = gather_kv(k_cache, block_tables[b], n).transpose(0, 1).to(q.dtype)  # [Nkv, Lk, H]
        v = gather_kv(v_cache, block_tables[b], n).transpose(0, 1).to(q.dtype)
        if group > 1:
            k = k.repeat_interleave(group, dim=0)
            v = v.repeat_interleave(group, dim=0)
        o = causal_attention(q, k, v, scale)
        out[q0:q1] = o.transpose(0, 1)
    return out
