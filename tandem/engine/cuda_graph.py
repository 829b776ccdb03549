"""CUDA graphs for decode steps: captured once per batch size of a ladder, replayed padded up."""

from __future__ import annotations

import torch

from tandem.engine.forward_context import AttentionMetadata, set_attention_metadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in [1, 2, 4] + list(range(8, 513, 8)) if s <= max_num_seqs]
    if max_num_seqs <= 512 and sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class CUDAGraphRunner:
    """Owns the static input buffers and one captured graph (model + logits) per batch size.

    Padded rows write to slot -1 and have sequence length 0, so they touch no cache and read
    nothing. Buffers never move, so graphs stay valid as long as the weights and KV cache keep
    their device addresses (see `tandem.engine.sleep`).
    """

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device):
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = self.sizes[-1]
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], max_query_len=1,
            max_seq_len=self.block_tables.shape[1], decode_only=True,
            query_start_loc_cpu=[], seq_lens_cpu=[],
        )

    def _forward(self, bs: int) -> torch.Tensor:
        with set_attention_metadata(self._meta(bs)):
            hidden = self.model(self.input_ids[:bs], self.positions[:bs])
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        self.graphs.clear()
        self.logits.clear()
        self.pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
            self._forward(bs)  # warm-up: compiles kernels outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[bs] = self._forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int) -> bool:
        return bool(self.graphs) and num_seqs <= self.max_bs

    def run(self, input_ids, positions, slot_mapping, seq_lens, block_tables) -> torch.Tensor:
        """Copy one decode batch into the static buffers, replay, return logits [B, V]."""
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, : block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        if bs > n:
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(0)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
