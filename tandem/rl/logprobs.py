"""The trainer's per-token log-probabilities, computed as the engine computes its sampling logprobs.

Two rules keep the two sides as equal as bf16 allows (docs/rl-numerics.md has the measurements):
- logits in fp32 from the GEMM's accumulator on both sides: the engine's lm_head returns fp32
  (`tandem.layers.linear.linear_fp32_out`), and so does the trainer's head here, from the same
  bf16-rounded hidden state and weight (bf16 logits added ~0.01 nats a token to the gap);
- the same distribution: with top-k / top-p / min-p the engine reports logprobs of the truncated,
  renormalised distribution ("processed_logprobs"), so the trainer renormalises over the same kept
  set (`SamplingFilter`), not over the whole vocabulary.

The head is fused with the selective log-softmax and chunked over tokens, so the [tokens, vocab]
logits never exist at once, in the forward or the backward pass. The GEMMs are cuBLAS's; on CUDA
the elementwise work on a chunk's fp32 logits is one Triton pass each way
(`tandem.kernels.head_logprobs`: the logsumexp and the target's logprob; the logits' gradient,
written in the GEMM's dtype), where torch takes five.

Shape suffixes: N = tokens scored, D = hidden, V = vocabulary, C = a chunk of N, B = rows, L = row
length, T = completion tokens.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass

import torch

from tandem import batch_invariant
from tandem.checks import check_triton_device
from tandem.layers.linear import addmm_fp32_, linear_fp32_out
from tandem.layers.sampler import apply_min_p, apply_top_k_top_p
from tandem.rl.packing import ATTENTION, pack_rows, packed_positions, register, to_device

_CHUNK_BYTES = 1 << 30  # fp32 logits of one chunk: 1 GiB (fewer, larger GEMMs; grad_w read less often)


@dataclass(frozen=True)
class SamplingFilter:
    """The engine's truncation of the sampling distribution (vLLM semantics: top_k 0 / top_p 1 /
    min_p 0 disable)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def apply(self, x_CV: torch.Tensor, target_C: torch.Tensor) -> torch.Tensor:
        """x (logits / T) with the dropped tokens at -inf. The sampled token is always kept: the
        engine kept it (it sampled it), and a rounding difference at the edge of the set must not
        make its logprob -inf."""
        C, dev = x_CV.shape[0], x_CV.device
        out = x_CV
        if self.top_k > 0 or self.top_p < 1.0:  # the sampler's own functions, as the engine ran them
            top_k = torch.full((C,), self.top_k, device=dev) if self.top_k > 0 else None
            top_p = torch.full((C,), self.top_p, device=dev) if self.top_p < 1.0 else None
            out = apply_top_k_top_p(out, top_k, top_p)
        if self.min_p > 0.0:
            out = apply_min_p(out, torch.full((C,), self.min_p, device=dev))
        return out.scatter(1, target_C[:, None], x_CV.gather(1, target_C[:, None]))


class _FusedHeadLogProbs(torch.autograd.Function):
    """log_softmax(filter(hidden @ weight.T / T))[target], chunk by chunk, fp32 logits.

    hidden [N, D] and weight [V, D] are cast to `dtype` for the GEMMs (bf16 under bf16 training:
    exactly what the engine's bf16 copy computes with); the products accumulate in fp32. The
    backward pass recomputes each chunk's logits: d logp / d logits_j = (1[j=t] - p_j) / T.
    """

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, target_N, temperature, dtype, filt, chunk, kernels):  # type: ignore[override]
        h_ND, w_VD = hidden_ND.to(dtype), weight_VD.to(dtype)
        out_N = torch.empty(target_N.shape, dtype=torch.float32, device=hidden_ND.device)
        lse_N = torch.empty_like(out_N)
        for s in range(0, h_ND.shape[0], chunk):
            e = s + chunk
            x_CV = _chunk_logits(h_ND[s:e], w_VD, target_N[s:e], temperature, filt)
            if kernels:  # one pass over the chunk's logits
                from tandem.kernels.head_logprobs import lse_logprobs

                lse_N[s:e], out_N[s:e] = lse_logprobs(x_CV, target_N[s:e])
            else:
                lse_N[s:e] = torch.logsumexp(x_CV, dim=-1)
                out_N[s:e] = x_CV.gather(1, target_N[s:e, None]).squeeze(1) - lse_N[s:e]
        ctx.save_for_backward(h_ND, weight_VD, target_N, lse_N)
        ctx.args = (temperature, dtype, filt, chunk, hidden_ND.dtype, kernels)
        return out_N

    @staticmethod
    def backward(ctx, grad_N):  # type: ignore[override]
        # the forward ran with autocast off (head_logprobs); backward may be called under it
        with torch.autocast(grad_N.device.type, enabled=False):
            return _FusedHeadLogProbs._backward(ctx, grad_N)

    @staticmethod
    def _backward(ctx, grad_N):
        h_ND, weight_VD, target_N, lse_N = ctx.saved_tensors
        temperature, dtype, filt, chunk, hidden_dtype, kernels = ctx.args
        w_VD = weight_VD.to(dtype)
        grad_h = torch.empty(h_ND.shape, dtype=hidden_dtype, device=h_ND.device)
        grad_w = torch.zeros(weight_VD.shape, dtype=torch.float32, device=h_ND.device)
        for s in range(0, h_ND.shape[0], chunk):
            e = s + chunk
            x_CV = _chunk_logits(h_ND[s:e], w_VD, target_N[s:e], temperature, filt)
            g_CV = _logits_grad(x_CV, lse_N[s:e], grad_N[s:e].float(), target_N[s:e], temperature,
                                dtype, kernels)
            grad_h[s:e] = (g_CV @ w_VD).to(hidden_dtype)
            addmm_fp32_(grad_w, g_CV.t(), h_ND[s:e])
        return grad_h, grad_w.to(weight_VD.dtype), None, None, None, None, None, None


def _logits_grad(x_CV, lse_C, g_C, target_C, temperature, dtype, kernels: bool) -> torch.Tensor:
    """d(g . logp) / d(the GEMM's logits) = (1[j=t] - p_j) g / T in `dtype`, made from the chunk's
    logits x = logits / T (which it consumes)."""
    if kernels:  # one read of x, one write in `dtype` over x's storage
        from tandem.kernels.head_logprobs import logprob_grad_

        return logprob_grad_(x_CV, lse_C, g_C, target_C, temperature, dtype)
    # in place over the chunk's own logits: p_j = exp(x_j - lse), then -g p_j (0 where dropped),
    # g added at the target, / T
    g_CV = x_CV.sub_(lse_C[:, None]).exp_().mul_(-g_C[:, None])
    g_CV.scatter_add_(1, target_C[:, None], g_C[:, None])
    if temperature != 1.0:
        g_CV = g_CV.div_(temperature)
    return g_CV.to(dtype)


def _chunk_logits(h_CD, w_VD, target_C, temperature, filt: SamplingFilter | None) -> torch.Tensor:
    x_CV = linear_fp32_out(h_CD, w_VD)
    if temperature != 1.0:
        x_CV = x_CV.div_(temperature)
    return filt.apply(x_CV, target_C) if filt is not None and filt.active else x_CV


def head_chunk_rows(vocab: int) -> int:
    """Tokens per chunk of the fused head: fp32 logits of about 1 GiB."""
    return max(16, _CHUNK_BYTES // (4 * vocab))


def head_logprobs(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    target_N: torch.Tensor,
    temperature: float = 1.0,
    dtype: torch.dtype | None = None,
    sampling: SamplingFilter | None = None,
    chunk_size: int | None = None,
    kernels: bool | None = None,
) -> torch.Tensor:
    """log p(target) under the (filtered) softmax of hidden @ weight.T / temperature, in fp32;
    extra memory O(chunk_size * V) in both passes. `kernels`: each chunk's elementwise work in one
    Triton pass each way (`tandem.kernels.head_logprobs`) instead of torch's several; None is on
    for CUDA; True on a CPU needs TRITON_INTERPRET=1 (tests)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = dtype or hidden_ND.dtype
    chunk = chunk_size or head_chunk_rows(weight_VD.shape[0])
    kernels = _use_kernels(kernels, hidden_ND.device)
    with torch.autocast(hidden_ND.device.type, enabled=False):
        return _FusedHeadLogProbs.apply(hidden_ND, weight_VD, target_N.long(), float(temperature),
                                        dtype, sampling, chunk, kernels)


def _use_kernels(kernels: bool | None, device: torch.device) -> bool:
    """Batch-invariant mode keeps the torch ops (its arithmetic is fixed, whatever is asked)."""
    if batch_invariant.is_enabled():
        return False
    if kernels is None:
        return device.type == "cuda" and importlib.util.find_spec("triton") is not None
    if kernels:
        check_triton_device("kernels=True", device.type)
    return kernels


def completion_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_lengths: torch.Tensor,
    num_completion_tokens: int,
    temperature: float = 1.0,
    micro_batch_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    sampling: SamplingFilter | None = None,
    padding_free: bool = False,
    lengths_cpu: tuple[torch.Tensor, torch.Tensor] | None = None,
    prompt_groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token log-probs [B, T] (fp32) of each row's completion under an HF causal LM.

    input_ids / attention_mask [B, L]: prompt then completion then right padding, never left
    padding: a left-padded row has query positions that attend to nothing, and SDPA's bf16
    backward turns those fully masked rows into NaN gradients. Row i's completion starts at
    prompt_lengths[i]; positions count from 0 at each row's first token, as the engine numbers
    them. Completion positions past a row's end score 0. `padding_free`: each micro-batch's rows
    run as one packed sequence (`tandem.rl.packing`), so no FLOP goes to padding.

    Padded rows run with the causal mask alone: a right pad comes after every real token of its
    row, so no real query attends to it, and the pads' own outputs are never scored. That spares
    the model's mask (and the read-back HF's mask code makes to check it). `lengths_cpu`: the
    rows' (prompt_lengths, lengths) on the host, where the caller has them (`rollout.pack`): the
    scored positions are then found there, and a micro-batch's forward is launched without
    reading the device back. `prompt_groups` [B] (host, with `lengths_cpu` and `padding_free`):
    rows with one id have the same prompt, packed once per micro-batch (`tandem.rl.packing`).
    """
    B = input_ids.shape[0]
    dev = input_ids.device
    if prompt_groups is not None and (lengths_cpu is None or not padding_free):
        raise ValueError("prompt_groups needs padding_free=True and the rows' lengths on the host (lengths_cpu)")
    prompt_len, seq_len = lengths_cpu or (prompt_lengths, attention_mask.sum(-1))
    tgt_pos = prompt_len[:, None] + torch.arange(num_completion_tokens, device=prompt_len.device)
    valid = tgt_pos < seq_len[:, None]  # [B, T]: a completion token sits there (right padding)
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("an lm_head with a bias is not supported by the fused log-prob head")
    step = micro_batch_size or B
    out = torch.zeros(valid.shape, dtype=torch.float32, device=input_ids.device)
    for s in range(0, B, step):
        rows = slice(s, s + step)
        b_idx, t_idx = valid[rows].nonzero(as_tuple=True)  # on the host with lengths_cpu
        pred_pos = tgt_pos[rows][b_idx, t_idx] - 1  # the state that predicts each token
        if lengths_cpu is not None:
            b_idx, t_idx, pred_pos = (to_device(t, dev) for t in (b_idx, t_idx, pred_pos))
        targets = input_ids[rows][b_idx, pred_pos + 1]
        state_row = b_idx  # where the predicting states sit: [b, L], or [1, packed] below
        if padding_free:
            groups = None if prompt_groups is None else (prompt_len[rows], prompt_groups[rows])
            packed = pack_rows(input_ids[rows], attention_mask[rows],
                               None if lengths_cpu is None else lengths_cpu[1][rows], groups)
            pred_pos, state_row = packed_positions(packed, b_idx, pred_pos), torch.zeros_like(b_idx)
            kw = packed["model_kwargs"]
        else:  # positions 0, 1, ... as the engine numbers them; causal mask only (see above)
            kw = dict(input_ids=input_ids[rows])
        scorer = _ScoringHead(head, state_row, pred_pos, targets, temperature, head_dtype, sampling)
        model.set_output_embeddings(scorer)
        try:  # the model's own forward, so a sharded (FSDP) root gathers the head's weight
            with _attention(model, ATTENTION if padding_free else None):
                lp_N = model(**kw, logits_to_keep=0, use_cache=False).logits
        finally:
            model.set_output_embeddings(head)
        out[rows] = out[rows].index_put((b_idx, t_idx), lp_N)
    return out


@contextlib.contextmanager
def _attention(model: torch.nn.Module, implementation: str | None):
    """The model's attention implementation switched for one forward pass (None: as it is)."""
    if implementation is None:
        yield
        return
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = register()
    try:
        yield
    finally:
        config._attn_implementation = before


class _ScoringHead(torch.nn.Module):
    """Stands in for the lm_head during one forward pass: instead of [b, L, V] logits it returns
    the log-probs of the targets, from the states that predict them, through the real head's
    weight (`head_logprobs`)."""

    def __init__(self, head, b_idx, pred_pos, targets, temperature, dtype, sampling):
        super().__init__()
        self.head = head
        self.b_idx, self.pred_pos, self.targets = b_idx, pred_pos, targets
        self.args = (temperature, dtype, sampling)

    def forward(self, hidden_bLD: torch.Tensor) -> torch.Tensor:
        return head_logprobs(hidden_bLD[self.b_idx, self.pred_pos], self.head.weight, self.targets,
                             *self.args)
