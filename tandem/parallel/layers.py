"""Column-, row- and vocabulary-parallel layers (Megatron-LM's sharding) for one TP rank.

Each layer holds this rank's shard and a `weight_loader(param, loaded, shard_id)` that picks the
shard out of a full checkpoint tensor, so `tandem.models.loader.load_weights` (and with it in-place
RL weight updates) works unchanged. `from_module` builds a layer from its single-device twin and
shards the twin's current values. Nothing here synchronises with the host: CUDA graphs capture the
collectives with the rest of the forward.

Shape suffixes: T = tokens, D = hidden, V = vocabulary, Vr = this rank's vocabulary rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.linear import MergedLinear, QKVLinear, default_weight_loader, linear_fp32_out
from tandem.parallel.groups import TPGroup


def _like(module: nn.Module) -> dict:
    w = module.weight
    return {"device": w.device, "dtype": w.dtype}


class _ColumnShards(nn.Linear):
    """Output rows split across ranks. Several projections of one input (q/k/v, gate/up) each
    contribute a slice, stored side by side in shard order."""

    def __init__(self, in_features: int, shards: dict, bias: bool, tp: TPGroup, **like):
        # shards: shard_id -> (full rows in the checkpoint, rows kept here, first row kept)
        out_features = sum(rows for _, rows, _ in shards.values())
        super().__init__(in_features, out_features, bias=bias, **like)
        self.tp = tp
        self.shards = shards
        self.offsets, off = {}, 0
        for sid, (_, rows, _) in shards.items():
            self.offsets[sid] = off
            off += rows

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # the projections arrive already merged, at full size
            full = [f for f, _, _ in self.shards.values()]
            if loaded.shape[0] != sum(full):
                raise ValueError(f"shape mismatch: {sum(full)} merged rows expected, "
                                 f"checkpoint has {tuple(loaded.shape)}")
            for sid, part in zip(self.shards, loaded.split(full, dim=0)):
                self.weight_loader(param, part, sid)
            return
        full, rows, first = self.shards[shard_id]
        if loaded.shape[0] != full:
            raise ValueError(f"shape mismatch: shard {shard_id!r} has {full} rows in a checkpoint, "
                             f"got {tuple(loaded.shape)}")
        dst = param.data.narrow(0, self.offsets[shard_id], rows)
        default_weight_loader(dst, loaded.narrow(0, first, rows))

    def _shard_from(self, src: nn.Linear) -> None:
        self.weight_loader(self.weight, src.weight.data)
        if self.bias is not None:
            self.weight_loader(self.bias, src.bias.data)


class QKVParallelLinear(_ColumnShards):
    """q/k/v split by heads. KV heads are split too when tp divides them; when there are fewer KV
    heads than ranks, each rank keeps the one KV head its query heads read (vLLM's replication)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, tp: TPGroup, **like):
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        first_kv = tp.rank * num_kv_heads // tp.size  # read by this rank's first query head
        q, kv, H = num_heads * head_dim, num_kv_heads * head_dim, head_dim
        shards = {
            "q": (q, self.num_heads * H, tp.rank * self.num_heads * H),
            "k": (kv, self.num_kv_heads * H, first_kv * H),
            "v": (kv, self.num_kv_heads * H, first_kv * H),
        }
        super().__init__(hidden_size, shards, bias, tp, **like)

    @classmethod
    def from_module(cls, src: QKVLinear, tp: TPGroup) -> QKVParallelLinear:
        layer = cls(src.in_features, src.head_dim, src.num_heads, src.num_kv_heads,
                    src.bias is not None, tp, **_like(src))
        layer._shard_from(src)
        return layer


class MergedColumnParallelLinear(_ColumnShards):
    """gate/up (or any merged projections): each split evenly across ranks."""

    def __init__(self, in_features: int, output_sizes: list[int], shard_ids: list, bias: bool,
                 tp: TPGroup, **like):
        shards = {}
        for sid, n in zip(shard_ids, output_sizes):
            shards[sid] = (n, n // tp.size, tp.rank * (n // tp.size))
        super().__init__(in_features, shards, bias, tp, **like)

    @classmethod
    def from_module(cls, src: MergedLinear, tp: TPGroup) -> MergedColumnParallelLinear:
        layer = cls(src.in_features, src.output_sizes, src.shard_ids, src.bias is not None, tp,
                    **_like(src))
        layer._shard_from(src)
        return layer


class RowParallelLinear(nn.Linear):
    """Input columns split across ranks; partial outputs are summed with an all-reduce. The bias
    (replicated) is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, **like):
        super().__init__(in_features // tp.size, out_features, bias=bias, **like)
        self.tp = tp
        self.full_in_features = in_features

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias (replicated), or a meta stand-in for it (weights.check)
            default_weight_loader(param, loaded)
            return
        if tuple(loaded.shape) != (self.out_features, self.full_in_features):
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)}, expected "
                             f"{(self.out_features, self.full_in_features)} before sharding")
        cols = self.in_features
        default_weight_loader(param, loaded.narrow(1, self.tp.rank * cols, cols))

    def forward(self, x_TI: torch.Tensor) -> torch.Tensor:
        y_TD = self.tp.all_reduce(F.linear(x_TI, self.weight))
        return y_TD if self.bias is None else y_TD + self.bias

    @classmethod
    def from_module(cls, src: nn.Linear, tp: TPGroup) -> RowParallelLinear:
        layer = cls(src.in_features, src.out_features, src.bias is not None, tp, **_like(src))
        layer.weight_loader(layer.weight, src.weight.data)
        if src.bias is not None:
            layer.weight_loader(layer.bias, src.bias.data)
        return layer


class _VocabRows(nn.Module):
    """Vocabulary rows [start, end) on this rank; the last rank's shard is padded with zero rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup, **like):
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        per_rank = -(-num_embeddings // tp.size)
        self.vocab_start = min(tp.rank * per_rank, num_embeddings)
        self.vocab_end = min(self.vocab_start + per_rank, num_embeddings)
        weight = torch.zeros(per_rank, embedding_dim, **like)
        self.weight = nn.Parameter(weight, requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)}, expected "
                             f"{(self.num_embeddings, self.embedding_dim)} before sharding")
        n = self.vocab_end - self.vocab_start
        default_weight_loader(param.data[:n], loaded[self.vocab_start : self.vocab_end])
        param.data[n:].zero_()


class VocabParallelEmbedding(_VocabRows):
    """Each rank looks up the ids it owns (zeros elsewhere); an all-reduce assembles the rows."""

    def forward(self, ids_T: torch.Tensor) -> torch.Tensor:
        local_T = ids_T - self.vocab_start
        inside_T = (local_T >= 0) & (local_T < self.vocab_end - self.vocab_start)
        x_TD = F.embedding(local_T.masked_fill(~inside_T, 0), self.weight)
        return self.tp.all_reduce(x_TD.masked_fill(~inside_T.unsqueeze(-1), 0))

    @classmethod
    def from_module(cls, src: nn.Embedding, tp: TPGroup) -> VocabParallelEmbedding:
        layer = cls(src.num_embeddings, src.embedding_dim, tp, **_like(src))
        layer.weight_loader(layer.weight, src.weight.data)
        return layer


class ParallelLMHead(_VocabRows):
    """Column-parallel lm_head: each rank scores its vocabulary rows, an all-gather hands every
    rank the full [B, V] logits (so every rank samples the same tokens)."""

    def forward(self, x_BD: torch.Tensor) -> torch.Tensor:
        B = x_BD.shape[0]
        logits_BVr = linear_fp32_out(x_BD, self.weight)  # fp32, as the single-device LMHead
        gathered = self.tp.all_gather(logits_BVr)  # [tp * B, Vr], rank-major
        logits_BV = gathered.view(self.tp.size, B, -1).transpose(0, 1).reshape(B, -1)
        return logits_BV[:, : self.num_embeddings]

    @classmethod
    def from_module(
        cls, src: nn.Linear, tp: TPGroup, tied_to: VocabParallelEmbedding | None = None
    ) -> ParallelLMHead:
        if src.bias is not None:
            raise ValueError("a tensor-parallel lm_head with a bias is not supported")
        layer = cls(src.out_features, src.in_features, tp, **_like(src))
        if tied_to is not None:
            layer.weight = tied_to.weight  # one parameter, as in the single-device model
        else:
            layer.weight_loader(layer.weight, src.weight.data)
        return layer
