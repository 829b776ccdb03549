"""The grammar-mask kernel and its torch reference against a plain loop over bits."""

import pytest
import torch

from tandem.kernels.grammar_mask import BLOCK, apply_token_bitmask_
from tandem.kernels.grammar_mask_ref import apply_token_bitmask_ref


def naive(logits: torch.Tensor, rows: list[int], words: list[list[int]]) -> torch.Tensor:
    out = logits.clone()
    for i, r in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (words[i][t // 32] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("V", [70, BLOCK + 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_and_reference_match_bits(device, V, dtype):
    gen = torch.Generator().manual_seed(V)
    S, rows = 5, [3, 0, 4]
    logits = torch.randn(S, V, generator=gen).to(dtype)
    W = (V + 31) // 32
    words = torch.randint(-(2**31), 2**31 - 1, (len(rows), W), generator=gen, dtype=torch.int64)
    words[0, 0] = 0  # a word banning all of its 32 tokens
    words[1, :] = -1  # a row allowing everything
    want = naive(logits, rows, [[w & 0xFFFFFFFF for w in row] for row in words.tolist()])
    bitmask = words.to(torch.int32)  # the same bits, two's complement

    ref = logits.clone()
    apply_token_bitmask_ref(ref, torch.tensor(rows), bitmask)
    assert torch.equal(ref, want)

    got = logits.to(device)
    apply_token_bitmask_(got, torch.tensor(rows, device=device), bitmask.to(device))
    assert torch.equal(got.cpu(), want)
    assert torch.equal(got[1].cpu(), logits[1])  # an unconstrained row is untouched


def test_no_rows_is_a_no_op(device):
    logits = torch.randn(2, 64, device=device)
    before = logits.clone()
    apply_token_bitmask_(logits, torch.empty(0, dtype=torch.int64, device=device),
                         torch.empty(0, 2, dtype=torch.int32, device=device))
    assert torch.equal(logits, before)
