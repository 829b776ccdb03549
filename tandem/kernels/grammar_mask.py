"""The grammar's token mask applied to the logits in place, in one pass: logits[rows[i], t] becomes
-inf where bit t of bitmask[i] is 0 (llguidance's layout: int32 words, bit t % 32 of word t // 32).

One program per (constrained row, BLOCK columns); no [R, V] intermediate, no host synchronisation.
The torch reference is `grammar_mask_ref.apply_token_bitmask_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # columns (a multiple of 32: whole bitmask words) per program


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, logits_stride, rows_ptr, mask_ptr, mask_stride, V,
                                BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    words = tl.load(mask_ptr + i * mask_stride + cols // 32, mask=inside, other=-1)
    banned = ((words >> (cols % 32)) & 1) == 0
    row = tl.load(rows_ptr + i).to(tl.int64)
    tl.store(logits_ptr + row * logits_stride + cols, tl.full([BLOCK], float("-inf"), tl.float32)
             .to(logits_ptr.dtype.element_ty), mask=inside & banned)


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [S, V] (fp32/bf16/fp16, rows contiguous), rows [R] int64, bitmask [R, ceil(V/32)]
    int32: the tokens row rows[i]'s grammar forbids become -inf, in place."""
    R, V = bitmask.shape[0], logits.shape[1]
    if R == 0:
        return
    assert logits.stride(1) == 1 and bitmask.dtype == torch.int32 and bitmask.shape[1] * 32 >= V
    _apply_token_bitmask_kernel[(R, triton.cdiv(V, BLOCK))](
        logits, logits.stride(0), rows, bitmask, bitmask.stride(0), V, BLOCK=BLOCK)
