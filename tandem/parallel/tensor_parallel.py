"""apply_tp: shard a single-device model for one tensor-parallel rank, from outside the model code.

The plan (Megatron-LM's, as gpt-fast and torchtitan apply it):

    embed_tokens           vocab-parallel     ids outside the shard masked, all-reduce
    q/k/v (merged)         column-parallel    by heads; KV heads split (replicated if fewer than ranks)
    o_proj                 row-parallel       all-reduce
    gate/up (merged)       column-parallel
    down_proj              row-parallel       all-reduce
    lm_head                column-parallel    all-gather: every rank gets the full [B, V] logits

Norms, rotary and q/k norms are replicated. Attention blocks are found by their children
(`qkv_proj`, `o_proj`, `attn`), MLPs by theirs (`gate_up_proj`, `down_proj`).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from tandem.layers.attention import Attention
from tandem.layers.linear import MergedLinear, QKVLinear
from tandem.parallel.groups import TPGroup, init_tp_group
from tandem.parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


def validate_tp(hf_config, tp_size: int) -> None:
    """Raise a ValueError naming what cannot be split `tp_size` ways."""
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) must divide num_attention_heads ({heads})"
        )
    if kv % tp_size and tp_size % kv:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) must divide num_key_value_heads ({kv}) or be a "
            f"multiple of it (then KV heads are replicated)"
        )
    inter = hf_config.intermediate_size
    if inter % tp_size:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) must divide intermediate_size ({inter})"
        )


def _parallelize_attention(block: nn.Module, tp: TPGroup) -> None:
    qkv = QKVParallelLinear.from_module(block.qkv_proj, tp)
    block.qkv_proj = qkv
    block.o_proj = RowParallelLinear.from_module(block.o_proj, tp)
    # The block reshapes with its own head counts and the paged-attention layer sizes the KV
    # cache from its: both become this rank's.
    block.num_heads, block.num_kv_heads = qkv.num_heads, qkv.num_kv_heads
    block.attn.num_heads, block.attn.num_kv_heads = qkv.num_heads, qkv.num_kv_heads


def _parallelize_mlp(mlp: nn.Module, tp: TPGroup) -> None:
    mlp.gate_up_proj = MergedColumnParallelLinear.from_module(mlp.gate_up_proj, tp)
    mlp.down_proj = RowParallelLinear.from_module(mlp.down_proj, tp)


def _parallelize_vocab(model: nn.Module, tp: TPGroup) -> None:
    embeds = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if len(embeds) != 1 or not isinstance(getattr(model, "lm_head", None), nn.Linear):
        raise ValueError(
            f"{type(model).__name__}: expected one nn.Embedding and an nn.Linear lm_head"
        )
    name, embed = embeds[0]
    tied = model.lm_head.weight is embed.weight
    parallel_embed = VocabParallelEmbedding.from_module(embed, tp)
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, parallel_embed)
    model.lm_head = ParallelLMHead.from_module(model.lm_head, tp, parallel_embed if tied else None)


@torch.no_grad()
def apply_tp(model: nn.Module, tp: TPGroup) -> nn.Module:
    """Turn `model` (single-device, any weights) into rank `tp.rank`'s shard, in place."""
    validate_tp(model.config, tp.size)
    for module in list(model.modules()):
        if isinstance(getattr(module, "qkv_proj", None), QKVLinear) and isinstance(
            getattr(module, "attn", None), Attention
        ):
            _parallelize_attention(module, tp)
        elif isinstance(getattr(module, "gate_up_proj", None), MergedLinear):
            _parallelize_mlp(module, tp)
    _parallelize_vocab(model, tp)
    return model.requires_grad_(False)


# Settings that steer scheduling and sampling: ranks that differ in any of them fall out of step.
_SAME_ON_EVERY_RANK = ("seed", "max_num_seqs", "max_num_batched_tokens", "block_size",
                       "enable_prefix_caching", "enable_chunked_prefill", "max_model_len",
                       "logprobs_mode")


def check_same_settings(config, tp: TPGroup) -> None:
    settings = {name: getattr(config, name) for name in _SAME_ON_EVERY_RANK}
    if not tp.all_equal(zlib.crc32(repr(settings).encode())):
        raise ValueError(
            f"tensor-parallel ranks {tp.ranks} must build their engines with the same "
            f"{', '.join(_SAME_ON_EVERY_RANK)}; rank {tp.rank} has {settings}"
        )


def init_tensor_parallel(model: nn.Module, config, device: torch.device) -> TPGroup | None:
    """The engine's hook: for tensor_parallel_size > 1, join this rank's group, shard the model."""
    if config.tensor_parallel_size == 1:
        return None
    tp = init_tp_group(config.tensor_parallel_size, device)
    check_same_settings(config, tp)
    apply_tp(model, tp)
    return tp
