"""Triton attention backend: the GPU counterpart of `TorchAttentionBackend`, with no host sync.

Decode-only steps (one query per sequence, CUDA-graph friendly) go to split-KV decode attention;
every other step (prefill, chunked prefill, mixed batches) goes to varlen prefill attention.
"""

from __future__ import annotations

import torch

from tandem.forward_context import AttentionMetadata
from tandem.kernels.decode_attention import decode_attention
from tandem.kernels.kv_cache import store_kvcache
from tandem.kernels.prefill_attention import prefill_attention
from tandem.kernels.rotary import apply_rotary_and_store_kv


class TritonAttentionBackend:
    """Paged attention through Triton kernels; reads only device tensors and max_query_len."""

    name = "triton"

    def store_kvcache(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)

    def rotary_store_kvcache(self, rotary_emb, positions, q, k, v, k_cache, v_cache,
                             meta: AttentionMetadata):
        """One kernel rotates q and k in place and writes k and v to the cache."""
        if q.requires_grad or k.requires_grad:  # the kernel has no backward
            q, k = rotary_emb(positions, q, k)
            self.store_kvcache(k, v, k_cache, v_cache, meta)
            return q
        q, _ = apply_rotary_and_store_kv(positions, q, k, v, rotary_emb.cos_cache, rotary_emb.sin_cache,
                                         k_cache, v_cache, meta.slot_mapping)
        return q

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.decode_only:
            return decode_attention(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale)
        return prefill_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale,
        )
