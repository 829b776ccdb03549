"""Triton attention backend: the GPU counterpart of `TorchAttentionBackend`, with no host sync.

Decode-only steps (one query per sequence, CUDA-graph friendly) go to split-KV decode attention,
which also rotates q and k and writes the cache (one launch per layer); every other step
(prefill, chunked prefill, mixed batches) goes to varlen prefill attention.
"""

from __future__ import annotations

import torch

from tandem import batch_invariant
from tandem.forward_context import AttentionMetadata
import tandem.kernels.decode_attention as decode_kernels
from tandem.kernels.decode_attention import (
    decode_attention,
    decode_config,
    launch_order,
    rotary_store_decode_attention,
)
from tandem.kernels.kv_cache import store_kvcache
from tandem.kernels.prefill_attention import prefill_attention
from tandem.kernels.rotary import apply_rotary_and_store_kv


class TritonAttentionBackend:
    """Paged attention through Triton kernels; reads only device tensors and max_query_len."""

    name = "triton"

    def __init__(self, fuse_decode: bool = True):
        # Decode steps: rotary, cache write and attention in one kernel (True), bit for bit the
        # two-kernel path (tests/kernels/test_decode_attention.py, on the H200 too).
        self.fuse_decode = fuse_decode

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

    def rotary_store_attend(self, rotary_emb, positions, q, k, v, k_cache, v_cache,
                            meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """A decode step is one kernel (`rotary_store_decode_attention`); any other step, or one
        needing autograd or batch-invariant numerics, rotates and stores, then attends."""
        if (self.fuse_decode and meta.decode_only and not batch_invariant.is_enabled()
                and not (q.requires_grad or k.requires_grad or v.requires_grad)):
            return rotary_store_decode_attention(
                positions, q, k, v, rotary_emb.cos_cache, rotary_emb.sin_cache, k_cache, v_cache,
                meta.slot_mapping, meta.seq_lens, meta.block_tables, scale,
                order=self.decode_order(meta, q, k_cache))
        q = self.rotary_store_kvcache(rotary_emb, positions, q, k, v, k_cache, v_cache, meta)
        return self.forward(q, k_cache, v_cache, meta, scale)

    @staticmethod
    def decode_order(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor | None:
        """The order of the step's sequences in decode attention's grid: a CUDA graph's buffer
        (`CUDAGraphRunner`), or for an eager step with `TANDEM_BALANCED_DECODE`, `launch_order`
        of its lengths on the host, made by the first layer and kept on the step's metadata."""
        if meta.decode_order is not None or not decode_kernels.BALANCED_ORDER or not meta.seq_lens_cpu:
            return meta.decode_order
        order = torch.from_numpy(launch_order(
            meta.seq_lens_cpu, q.shape[0], k_cache.shape[2], q.shape[2], q.dtype,
            meta.block_tables.shape[1] * k_cache.shape[1], q.device))
        meta.decode_order = (order.pin_memory().to(q.device, non_blocking=True) if q.is_cuda
                             else order.to(q.device))
        return meta.decode_order

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if batch_invariant.is_enabled():
            return per_query_decode_attention(q, k_cache, v_cache, meta, scale)
        if meta.decode_only:
            return decode_attention(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale,
                                    order=self.decode_order(meta, q, k_cache))
        return prefill_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale,
        )


def per_query_decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Batch-invariant attention: every query, prefill or decode, is one decode-kernel query over
    its own sequence's keys up to its position, in one split. A token's output then depends on
    its sequence alone, never on how the step chunked or batched it. Padding tokens past the
    last sequence (a graph's padded step) read the last sequence's keys; their output is unused.
    The launch config is the batch-free one (`decode_config` without a batch) for the same reason."""
    config = decode_config(k_cache.shape[2], q.shape[2], q.dtype)
    if meta.decode_only:
        return decode_attention(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale, num_splits=1,
                                config=config)
    T = q.shape[0]
    qsl = meta.query_start_loc
    tokens = torch.arange(T, device=q.device, dtype=qsl.dtype)
    seq = torch.searchsorted(qsl[1:], tokens, right=True).clamp_(max=qsl.numel() - 2)
    # keys up to and including this query: the context before the step plus the step's own so far
    own = meta.seq_lens[seq]
    seq_lens = torch.minimum(own - (qsl[seq + 1] - qsl[seq]) + (tokens - qsl[seq]) + 1, own)
    return decode_attention(q, k_cache, v_cache, seq_lens.clamp_(min=1).to(torch.int32),
                            meta.block_tables[seq], scale, num_splits=1, config=config)
