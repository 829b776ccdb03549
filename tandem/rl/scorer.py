"""The trainer's log-prob values from the engine's own model code and kernels (`batch_invariant`).

In bf16 any two different computations of a token's log-prob differ by ~0.01-0.03 nats (a
reduction order, a rounding point: docs/rl-numerics.md measures them), so the trainer's HF forward
cannot agree with the engine's paged decode to 0.005. With `batch_invariant=True` the engine runs
kernels whose per-row arithmetic is fixed, and this scorer runs the same model class
(`DecoderForCausalLM`) on the trainer's current weights, cast as the weight sync casts them, over
the finished rollout: every token a query of the same decode kernel over the same keys, every GEMM
the same fixed-order sum. Its log-probs equal the engine's bit for bit while the weights are those
the engine sampled with, and they are the current policy's exact values after updates.

The trainer's HF forward still supplies the gradient: the loss sees
`logp + (exact - logp).detach()`, the exact value with the HF model's derivative (whose own
forward differs by bf16 noise). Costs one more forward per micro-batch and a bf16 copy of the
weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from tandem.forward_context import AttentionMetadata, set_attention_metadata
from tandem.kernels.batch_invariant import token_logprobs
from tandem.layers.attention import Attention
from tandem.layers.triton_attention import TritonAttentionBackend
from tandem.models.loader import build_model, check_all_loaded, load_weights

_BLOCK = 16  # KV-cache block size of the scorer's scratch cache
_LOGITS_BYTES = 1 << 28  # fp32 logits of one chunk of scored tokens: 256 MiB


class BatchInvariantScorer:
    def __init__(self, hf_config, max_position: int, device: torch.device,
                 weights: Callable[[], Iterable[tuple[str, torch.Tensor]]], dtype: torch.dtype = torch.bfloat16):
        self.model = build_model(hf_config, max_position, dtype, device)
        self.attn = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attn:
            layer.backend = TritonAttentionBackend()
        self.weights = weights  # HF-named tensors of the trainer's current weights (what the engine gets)
        self.device, self.dtype = device, dtype
        self.stale = True

    def mark_stale(self) -> None:
        self.stale = True

    @torch.no_grad()
    def refresh(self) -> None:
        check_all_loaded(self.model, load_weights(self.model, self.weights()))
        self.stale = False

    @torch.no_grad()
    def logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor,
              num_completion_tokens: int, temperature: float) -> torch.Tensor:
        """Per-token log-probs [B, T] (fp32) of each row's completion, as `completion_logps`
        lays them out (rows: prompt, completion, right padding; 0 past a row's end)."""
        if self.stale:
            self.refresh()
        dev = self.device
        B = input_ids.shape[0]
        lengths = attention_mask.sum(1)
        lens = lengths.tolist()
        real = attention_mask.bool()
        ids = input_ids[real]
        positions = (attention_mask.long().cumsum(1) - 1)[real]
        starts = torch.zeros(B + 1, dtype=torch.long, device=dev)
        starts[1:] = lengths.cumsum(0)
        nblocks = [-(-n // _BLOCK) for n in lens]
        first = torch.tensor([0] + nblocks, device=dev).cumsum(0)[:-1]  # each row's first block
        width = max(nblocks)
        tables = (first[:, None] + torch.arange(width, device=dev)).to(torch.int32)
        row = torch.repeat_interleave(torch.arange(B, device=dev), lengths)
        slots = (first[row] * _BLOCK + positions).long()
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=starts.to(torch.int32), seq_lens=lengths.to(torch.int32),
            block_tables=tables, max_query_len=max(lens), max_seq_len=max(lens), decode_only=False,
            query_start_loc_cpu=starts.tolist(), seq_lens_cpu=lens)
        cfg = self.model.config
        head_dim = self.attn[0].head_dim
        cache = torch.empty(len(self.attn), 2, sum(nblocks), _BLOCK, self.attn[0].num_kv_heads, head_dim,
                            dtype=self.dtype, device=dev)
        for i, layer in enumerate(self.attn):
            layer.k_cache, layer.v_cache = cache[i, 0], cache[i, 1]
        try:
            with set_attention_metadata(meta):
                hidden = self.model(ids, positions)
        finally:
            for layer in self.attn:
                layer.k_cache = layer.v_cache = None
        del cache
        # completion token j of row b sits at flat starts[b] + prompt_lengths[b] + j, predicted by
        # the state just before it
        j = torch.arange(num_completion_tokens, device=dev)
        valid = prompt_lengths[:, None] + j < lengths[:, None]
        flat = (starts[:-1, None] + prompt_lengths[:, None] + j)[valid]
        targets = ids[flat]
        out = torch.zeros(B, num_completion_tokens, dtype=torch.float32, device=dev)
        scored = torch.empty(flat.numel(), dtype=torch.float32, device=dev)
        chunk = max(1, _LOGITS_BYTES // (4 * cfg.vocab_size))
        temp = torch.full((min(chunk, max(1, flat.numel())),), float(temperature), device=dev)
        for s in range(0, flat.numel(), chunk):
            e = min(s + chunk, flat.numel())
            logits = self.model.compute_logits(hidden[flat[s:e] - 1])
            scored[s:e] = token_logprobs(logits, targets[s:e], temp[: e - s])
        out[valid] = scored
        return out
