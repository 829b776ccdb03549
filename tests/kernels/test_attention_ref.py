"""The torch reference attention: exact against a dense masked softmax, and memory linear in the
prompt (no [T, T] mask or score matrix; a 7k-token prompt used to OOM-kill the CPU engine)."""

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import attention_ref
from tandem.kernels.attention_ref import causal_attention, paged_attention_ref


def _dense(q, k, v, scale):
    lq, lk = q.shape[1], k.shape[1]
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    scores = (q @ k.transpose(1, 2)) * scale
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("lq,lk", [(1, 1), (1, 37), (37, 37), (20, 37), (64, 64), (5, 200)])
def test_tiled_causal_attention_matches_dense(lq, lk, monkeypatch):
    monkeypatch.setattr(attention_ref, "_TILE_SCORES", 3 * lk * 4)  # tiles of 4 queries
    g = torch.Generator().manual_seed(lq * 1000 + lk)
    q, k, v = (torch.randn(3, n, 8, generator=g, dtype=torch.float64) for n in (lq, lk, lk))
    torch.testing.assert_close(causal_attention(q, k, v, 0.3), _dense(q, k, v, 0.3))


def test_prefill_holds_no_quadratic_tensor(monkeypatch):
    """Every SDPA call of a 4k-token prefill sees at most a tile's scores, whatever the length."""
    n, heads, kv_heads, head_dim, block = 4096, 4, 2, 8, 16
    sizes = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        sizes.append(q.shape[0] * q.shape[1] * k.shape[1])  # scores this call holds
        if attn_mask is not None:
            sizes.append(attn_mask.numel())
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(attention_ref.F, "scaled_dot_product_attention", spy)
    blocks = n // block
    k_cache = torch.randn(blocks, block, kv_heads, head_dim)
    v_cache = torch.randn(blocks, block, kv_heads, head_dim)
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    for lq in (n, n // 2):  # a whole prompt, and a chunk over a cached prefix
        q = torch.randn(lq, heads, head_dim)
        paged_attention_ref(q, k_cache, v_cache, [0, lq], [n], tables, 0.3)
    assert max(sizes) <= attention_ref._TILE_SCORES < n * n
