"""CUDA graphs for every step small enough to be launch-bound, replayed padded up.

Two ladders share one memory pool and one set of static input buffers:

- decode graphs, one per batch size (one query per sequence: split-KV decode attention, logits
  for every row inside the graph);
- mixed graphs, one per token count up to `max_cudagraph_capture_size`: prefill chunks and
  decode rows in any mix (varlen attention, whose grid depends on the token count and batch
  size only). They return hidden states; the rows to sample go through the LM head eagerly.

An eager step of the 1.5B model issues ~300 launches, ~20 ms of host time on an H200 host for
what the GPU does in 3-10 ms; a replay is one launch.
"""

from __future__ import annotations

import torch

import tandem.kernels.decode_attention as decode_kernels
from tandem.forward_context import AttentionMetadata, set_attention_metadata
from tandem.kernels.decode_attention import launch_order
from tandem.layers.attention import Attention


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes to capture."""
    sizes = [s for s in [1, 2, 4] + list(range(8, 513, 8)) if s <= max_num_seqs]
    if max_num_seqs <= 512 and sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def mixed_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts of mixed steps to capture: from 64 tokens on, each at most half again the one
    before (the padding a replay computes costs less than the launches of an eager step)."""
    ladder = [8, 16, 32, 64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536,
              2048, 2560, 3072, 4096, 5120, 6144, 8192]
    return [s for s in ladder if s <= max_tokens]


class CUDAGraphRunner:
    """Owns the static input buffers and the captured graphs.

    Padded tokens write to slot -1; padded sequences have no queries and length 0, so they touch
    no cache and read nothing. Buffers never move, so graphs stay valid as long as the weights and
    KV cache keep their device addresses (see `tandem.engine.sleep_mode`).
    """

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device, max_mixed_tokens: int = 0):
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = self.sizes[-1]
        self.mixed_sizes = mixed_capture_sizes(max_mixed_tokens)
        self.max_mixed_tokens = self.mixed_sizes[-1] if self.mixed_sizes else 0
        n = max(self.max_bs, self.max_mixed_tokens)
        seqs = max(self.max_bs, self._mixed_seqs(self.max_mixed_tokens))
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(seqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(seqs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        # decode attention's order of sequences (`launch_order`), written before every replay
        # when the graphs were captured with one (`TANDEM_BALANCED_DECODE`)
        self.decode_order = torch.arange(self.max_bs, dtype=torch.int32, device=device)
        self.ordered = False
        self._order_rows = 0  # the rows the order was last written for
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # The decode graphs end at the hidden states: each graph's output stays allocated in the
        # pool, and fp32 logits per captured size would hold sum(sizes) x vocab x 4 bytes (2.4 GiB
        # for a 152k vocabulary); the lm_head runs after the replay, on the real rows only.
        self.decode_hidden: dict[int, torch.Tensor] = {}
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.pool = None
        self.num_replays = {"decode": 0, "mixed": 0}

    def _mixed_seqs(self, num_tokens: int) -> int:
        """Sequences a mixed graph of `num_tokens` tokens is captured for: as many as can fit."""
        return min(num_tokens, self.max_num_seqs)

    # -- capture ---------------------------------------------------------------------------------
    def _decode_meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], max_query_len=1,
            max_seq_len=self.block_tables.shape[1], decode_only=True,
            query_start_loc_cpu=[], seq_lens_cpu=[],
            decode_order=self.decode_order[:bs] if self.ordered else None,
        )

    def _mixed_meta(self, num_tokens: int) -> AttentionMetadata:
        seqs = self._mixed_seqs(num_tokens)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens], query_start_loc=self.query_start_loc[: seqs + 1],
            seq_lens=self.seq_lens[:seqs], block_tables=self.block_tables[:seqs],
            max_query_len=num_tokens,  # picks the attention tile: any query may be this long
            max_seq_len=self.block_tables.shape[1], decode_only=False,
            query_start_loc_cpu=[], seq_lens_cpu=[],
        )

    def _forward_decode(self, bs: int) -> torch.Tensor:
        with set_attention_metadata(self._decode_meta(bs)):
            return self.model(self.input_ids[:bs], self.positions[:bs])

    def _forward_mixed(self, num_tokens: int) -> torch.Tensor:
        with set_attention_metadata(self._mixed_meta(num_tokens)):
            return self.model(self.input_ids[:num_tokens], self.positions[:num_tokens])

    def _capture_one(self, forward, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        forward(size)  # warm-up: compiles kernels outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward(size)
        return graph, out

    @torch.inference_mode()
    def capture(self) -> None:
        self.graphs.clear()
        self.decode_hidden.clear()
        self.mixed_graphs.clear()
        self.hidden.clear()
        self.pool = torch.cuda.graph_pool_handle()
        self.ordered = decode_kernels.BALANCED_ORDER
        if self.ordered:  # what `launch_order` needs of the attention: its cache's shape
            k_cache = next(m for m in self.model.modules() if isinstance(m, Attention)).k_cache
            _, block_size, kv_heads, head_dim = k_cache.shape
            self._order_shape = (kv_heads, head_dim, k_cache.dtype, self.block_tables.shape[1] * block_size)
        # Largest activations first, so that smaller graphs reuse their pool memory.
        for num_tokens in reversed(self.mixed_sizes):
            self.mixed_graphs[num_tokens], self.hidden[num_tokens] = self._capture_one(
                self._forward_mixed, num_tokens)
        for bs in reversed(self.sizes):
            self.graphs[bs], self.decode_hidden[bs] = self._capture_one(self._forward_decode, bs)
        torch.cuda.synchronize()

    def all_graphs(self) -> list[torch.cuda.CUDAGraph]:
        return [*self.graphs.values(), *self.mixed_graphs.values()]

    # -- replay ----------------------------------------------------------------------------------
    def can_run(self, num_seqs: int) -> bool:
        """Whether a decode step of `num_seqs` sequences has a graph."""
        return bool(self.graphs) and num_seqs <= self.max_bs

    def can_run_mixed(self, num_tokens: int, num_seqs: int) -> bool:
        if not self.mixed_graphs or num_tokens > self.max_mixed_tokens:
            return False
        size = next(s for s in self.mixed_sizes if s >= num_tokens)
        return num_seqs <= self._mixed_seqs(size)

    def _load(self, input_ids, positions, slot_mapping, seq_lens, block_tables, padded_tokens: int,
              padded_seqs: int) -> None:
        n, b = input_ids.shape[0], seq_lens.shape[0]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:b].copy_(seq_lens, non_blocking=True)
        self.block_tables[:b, : block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        if padded_tokens > n:
            self.slot_mapping[n:padded_tokens].fill_(-1)
        if padded_seqs > b:
            self.seq_lens[b:padded_seqs].fill_(0)

    def run(self, input_ids, positions, slot_mapping, seq_lens, block_tables,
            seq_lens_cpu=None) -> torch.Tensor:
        """Copy one decode batch into the static buffers, replay, return logits [B, V].
        `seq_lens_cpu` (the lengths on the host) orders decode attention's sequences where the
        graphs were captured to take an order; None keeps the order written last (a decode
        window's later steps: the same batch, every length one longer, the same order)."""
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        self._load(input_ids, positions, slot_mapping, seq_lens, block_tables, bs, bs)
        if self.ordered:
            self._load_order(seq_lens_cpu, bs)
        self.graphs[bs].replay()
        self.num_replays["decode"] += 1
        return self.model.compute_logits(self.decode_hidden[bs][:n])

    def _load_order(self, seq_lens_cpu, bs: int) -> None:
        """Writes the whole order a graph of bs rows reads, from a fresh pinned buffer (a window's
        replays are queued before the first one runs); None keeps the last one, written for the
        same bs."""
        if seq_lens_cpu is None:
            assert self._order_rows == bs, f"no order written for {bs} rows (last: {self._order_rows})"
            return
        order = torch.from_numpy(launch_order(seq_lens_cpu, bs, *self._order_shape, self.decode_order.device))
        if self.decode_order.is_cuda:  # (a CPU runner, in tests, has no pinned memory)
            order = order.pin_memory()
        self.decode_order[:bs].copy_(order, non_blocking=True)
        self._order_rows = bs

    def run_mixed(self, input_ids, positions, slot_mapping, query_start_loc, seq_lens,
                  block_tables) -> torch.Tensor:
        """Copy one mixed step into the static buffers, replay, return hidden states [T, hidden]."""
        n, b = input_ids.shape[0], seq_lens.shape[0]
        size = next(s for s in self.mixed_sizes if s >= n)
        seqs = self._mixed_seqs(size)
        self._load(input_ids, positions, slot_mapping, seq_lens, block_tables, size, seqs)
        self.query_start_loc[: b + 1].copy_(query_start_loc, non_blocking=True)
        if seqs > b:  # padded sequences: no queries (they start where the real tokens end)
            self.query_start_loc[b + 1 : seqs + 1].fill_(n)
        self.mixed_graphs[size].replay()
        self.num_replays["mixed"] += 1
        return self.hidden[size][:n]
