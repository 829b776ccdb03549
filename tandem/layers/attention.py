"""Paged attention layer: writes this step's K/V into the cache, then attends through a backend."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.forward_context import AttentionMetadata, get_attention_metadata
from tandem.kernels.attention_ref import paged_attention_ref, store_kvcache_ref


class TorchAttentionBackend:
    """Reference backend: plain torch, any device, correct rather than fast."""

    name = "torch"

    def store_kvcache(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kvcache_ref(k, v, k_cache, v_cache, meta.slot_mapping)

    def rotary_store_kvcache(self, rotary_emb, positions, q, k, v, k_cache, v_cache,
                             meta: AttentionMetadata):
        """Rotate q and k, then write k and v to the cache; returns the rotated q."""
        q, k = rotary_emb(positions, q, k)
        self.store_kvcache(k, v, k_cache, v_cache, meta)
        return q

    def rotary_store_attend(self, rotary_emb, positions, q, k, v, k_cache, v_cache,
                            meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Rotate q and k, write k and v to the cache, attend: one step's whole attention."""
        q = self.rotary_store_kvcache(rotary_emb, positions, q, k, v, k_cache, v_cache, meta)
        return self.forward(q, k_cache, v_cache, meta, scale)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention_ref(
            q, k_cache, v_cache, meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.block_tables, scale
        )


class Attention(nn.Module):
    """q [T, N, H], k/v [T, Nkv, H] -> [T, N, H]. Cache tensors are bound by the model runner."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.backend = TorchAttentionBackend()

    def forward(self, q_TNH: torch.Tensor, k_TNH: torch.Tensor, v_TNH: torch.Tensor,
                positions: torch.Tensor | None = None, rotary_emb: nn.Module | None = None) -> torch.Tensor:
        """With `rotary_emb`, q and k are rotated at `positions` first (the Triton backend does it
        in the kernel that writes the cache)."""
        meta = get_attention_metadata()
        if meta is None or self.k_cache is None:
            if rotary_emb is not None:
                q_TNH, k_TNH = rotary_emb(positions, q_TNH, k_TNH)
            return self._no_cache_causal(q_TNH, k_TNH, v_TNH)
        if rotary_emb is not None:
            return self.backend.rotary_store_attend(rotary_emb, positions, q_TNH, k_TNH, v_TNH,
                                                    self.k_cache, self.v_cache, meta, self.scale)
        self.backend.store_kvcache(k_TNH, v_TNH, self.k_cache, self.v_cache, meta)
        return self.backend.forward(q_TNH, self.k_cache, self.v_cache, meta, self.scale)

    def _no_cache_causal(self, q, k, v) -> torch.Tensor:
        """One causal sequence, no cache: used by profiling runs before the cache exists."""
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=self.scale
        )
        return o.transpose(0, 1)
