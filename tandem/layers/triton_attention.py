"""Triton attention backend: the GPU counterpart of `TorchAttentionBackend`, with no host sync.

Decode-only steps (one query per sequence, CUDA-graph friendly) go to split-KV decode attention;
every other step (prefill, chunked prefill, mixed batches) goes to varlen prefill attention.
"""

from __future__ import annotations

import torch

from tandem.engine.forward_context import AttentionMetadata
from tandem.kernels.decode_attention import decode_attention
from tandem.kernels.kv_cache import store_kvcache
from tandem.kernels.prefill_attention import prefill_attention


class TritonAttentionBackend:
    """Paged attention through Triton kernels; reads only device tensors and max_query_len."""

    name = "triton"

    def store_kvcache(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.decode_only:
            return decode_attention(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale)
        return prefill_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale,
        )
