"""Sharding arithmetic without processes: group ranks, what can be split, and the weight loaders'
slices (each rank's shards put back together give the full tensor)."""

import pytest
import torch
import torch.nn.functional as F
from model_fixtures import make_tiny_model

from tandem import LLM
from tandem.layers.linear import Linear, MergedLinear, QKVLinear
from tandem.parallel.groups import TPGroup, tp_group_ranks
from tandem.parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tandem.parallel.tensor_parallel import validate_tp


def _ranks(size):
    """Rank views for loading only: no collective runs in these tests."""
    cpu = torch.device("cpu")
    return [TPGroup(group=None, rank=r, size=size, ranks=list(range(size)), device=cpu)
            for r in range(size)]


def test_groups_are_consecutive_ranks():
    assert tp_group_ranks(4, 2, 3) == [2, 3]
    assert tp_group_ranks(4, 4, 1) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"world size \(3\) must be a multiple of tensor_parallel"):
        tp_group_ranks(3, 2, 0)


@pytest.mark.parametrize(
    "heads,kv,inter,tp,error",
    [
        (4, 2, 128, 2, None),
        (12, 2, 128, 4, None),  # fewer KV heads than ranks: replicated
        (9, 3, 128, 2, r"must divide num_attention_heads \(9\)"),
        (6, 3, 128, 2, r"num_key_value_heads \(3\)"),
        (4, 2, 130, 4, r"intermediate_size \(130\)"),
    ],
)
def test_validate_tp(heads, kv, inter, tp, error):
    cfg = type("Cfg", (), {"num_attention_heads": heads, "num_key_value_heads": kv,
                           "intermediate_size": inter})
    if error is None:
        validate_tp(cfg, tp)
    else:
        with pytest.raises(ValueError, match=error):
            validate_tp(cfg, tp)


def test_llm_refuses_an_unsplittable_model_before_spawning():
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide num_attention"):
        LLM(make_tiny_model("llama"), tensor_parallel_size=3, device="cpu")


@pytest.mark.parametrize("kv_heads,tp", [(2, 2), (4, 2), (1, 2), (2, 4)])
def test_qkv_shards_by_heads(kv_heads, tp):
    H, heads = 4, 4
    full = QKVLinear(8, H, heads, kv_heads, bias=True)
    torch.nn.init.normal_(full.weight)
    torch.nn.init.normal_(full.bias)
    q, k, v = full.weight.split([heads * H, kv_heads * H, kv_heads * H])
    k_heads, v_heads = k.view(kv_heads, H, 8), v.view(kv_heads, H, 8)
    shards = [QKVParallelLinear.from_module(full, g) for g in _ranks(tp)]
    got_q = torch.cat([s.weight[: s.num_heads * H] for s in shards])
    torch.testing.assert_close(got_q, q, rtol=0, atol=0)
    group = heads // kv_heads
    for r, s in enumerate(shards):
        nq, nkv = s.num_heads, s.num_kv_heads
        sk, sv = s.weight[nq * H :].split(nkv * H)
        for j in range(nq):  # every local query head reads the KV head it read before sharding
            kv_local = j // (nq // nkv)
            kv_global = (r * nq + j) // group
            assert torch.equal(sk.view(nkv, H, 8)[kv_local], k_heads[kv_global])
            assert torch.equal(sv.view(nkv, H, 8)[kv_local], v_heads[kv_global])
        assert s.bias.shape[0] == s.weight.shape[0]


def test_merged_and_row_parallel_shards_reassemble():
    gate_up = MergedLinear(8, [6, 6], [0, 1], bias=False)
    down = Linear(6, 8, bias=True)
    for p in (gate_up.weight, down.weight, down.bias):
        torch.nn.init.normal_(p)
    ranks = _ranks(2)
    cols = [MergedColumnParallelLinear.from_module(gate_up, g) for g in ranks]
    gate = torch.cat([c.weight[:3] for c in cols])
    up = torch.cat([c.weight[3:] for c in cols])
    torch.testing.assert_close(torch.cat([gate, up]), gate_up.weight, rtol=0, atol=0)
    rows = [RowParallelLinear.from_module(down, g) for g in ranks]
    assert torch.equal(torch.cat([r.weight for r in rows], dim=1), down.weight)
    assert all(torch.equal(r.bias, down.bias) for r in rows)  # replicated, added once after the sum
    x = torch.randn(5, 6)  # partial products sum to the full product
    partial = sum(F.linear(xs, r.weight) for xs, r in zip(x.split(3, dim=1), rows))
    torch.testing.assert_close(partial, F.linear(x, down.weight))


def test_vocab_shards_pad_the_last_rank_and_tie():
    embed = torch.nn.Embedding(7, 4)
    ranks = _ranks(2)
    shards = [VocabParallelEmbedding.from_module(embed, g) for g in ranks]
    assert [(s.vocab_start, s.vocab_end) for s in shards] == [(0, 4), (4, 7)]
    assert torch.equal(torch.cat([shards[0].weight, shards[1].weight[:3]]), embed.weight.data)
    assert not shards[1].weight[3].any()  # padding row
    head = ParallelLMHead.from_module(Linear(4, 7, bias=False), ranks[1], tied_to=shards[1])
    assert head.weight is shards[1].weight
    with pytest.raises(ValueError, match="shape mismatch"):
        shards[0].weight_loader(shards[0].weight, torch.zeros(8, 4))
