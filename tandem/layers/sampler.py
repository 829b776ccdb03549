"""Sampler: penalties, temperature, top-k/top-p/min-p and logprobs, all on the device.

The torch path samples by the exponential race in log space (Gumbel-max: argmax of logits / T -
log Exp(1)), which draws from softmax(logits / T) with no host synchronisation; the fused path
(`tandem.kernels.sampling`) draws a chunk of the vocabulary by its mass, then Gumbel-max inside
it, which is the same distribution for a fraction of the noise. Rows with their own seed draw
their noise from their own generator on the torch path; on the fused path their Philox key is
derived on the device from (seed, tokens so far), so a batch full of seeded requests (an RL
rollout: one seed per prompt) costs no per-row work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem import batch_invariant
from tandem.kernels.grammar_mask_ref import apply_token_bitmask_ref


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [S] fp32, 1.0 on greedy rows
    greedy: torch.Tensor  # [S] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [S] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [S] fp32
    min_p: torch.Tensor | None  # [S] fp32
    generators: dict[int, torch.Generator]  # row -> per-request generator (torch path)
    max_num_logprobs: int  # top-k logprobs wanted by any row; -1: none
    processed_logprobs: bool
    # (rows, token ids) whose logits are -inf: EOS and stop tokens before min_tokens
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, token ids, biases) added to the logits first (the requests' logit_bias)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # structured outputs: the constrained rows, and each step their grammars' allowed tokens
    structured_rows: torch.Tensor | None = None  # [R] int64
    structured_rows_cpu: list[int] | None = None
    grammar_bitmask: torch.Tensor | None = None  # [R, ceil(V / 32)] int32, a bit per token
    # ...and the rows whose grammar is a token automaton stepping on the device
    fsm: GrammarFSM | None = None
    # penalties (None when no row has any)
    prompt_mask: torch.Tensor | None = None  # [S, V] bool: token occurs in the prompt
    output_counts: torch.Tensor | None = None  # [S, V] counts in the output so far
    repetition_penalty: torch.Tensor | None = None  # [S]
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    # seeded rows on the fused path: their indices, seeds, and each row's token count this step
    seeded_rows: torch.Tensor | None = None  # [R] int64
    seeded_rows_cpu: list[int] | None = None
    row_seeds: torch.Tensor | None = None  # [R] int64
    seed_offsets: torch.Tensor | None = None  # [R] int64, set every step


@dataclass
class GrammarFSM:
    """Constrained rows whose grammar is a token automaton (`tandem.engine.token_fsm`): each
    row's state lives on the device in `states.tensor[slot]`, local to its grammar, whose tables
    start at row `offset` of the batch's concatenated tables. A step masks the rows' logits with
    their states' allowed tokens, and once sampled moves each state by its token: device work
    only, so the rows decode in windows like free ones."""

    rows: torch.Tensor  # [R] int64, rows of the batch
    slots: torch.Tensor  # [R] int64
    offsets: torch.Tensor  # [R] int32
    allowed: torch.Tensor  # [G, ceil(V / 32)] int32, a bitmask row per state
    next_state: torch.Tensor  # [G, V] int16, each grammar's own state numbers
    states: object  # holds `.tensor`, [slots] int32 (read at each step: it may have grown)

    def _global_states(self) -> torch.Tensor:
        return (self.states.tensor[self.slots] + self.offsets).long()

    def apply(self, logits: torch.Tensor) -> None:
        apply_grammar_bitmask(logits, self.rows, self.allowed[self._global_states()])

    def advance(self, token_ids: torch.Tensor) -> None:
        nxt = self.next_state[self._global_states(), token_ids[self.rows]]
        self.states.tensor[self.slots] = nxt.to(torch.int32)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S] int64
    logprobs: torch.Tensor  # [S] fp32, of the sampled token
    topk_ids: torch.Tensor | None = None  # [S, k]
    topk_logprobs: torch.Tensor | None = None  # [S, k]
    ranks: torch.Tensor | None = None  # [S] rank of the sampled token (1 = most likely)
    prompt_logprobs: PromptLogprobs | None = None  # prefill chunks that asked for them


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens computed in one step: one row R per predicted prompt token."""

    logprobs: torch.Tensor  # [R] fp32, of the prompt token
    ranks: torch.Tensor  # [R] int64
    topk_ids: torch.Tensor | None  # [R, k]
    topk_logprobs: torch.Tensor | None  # [R, k]
    # host, in row order: (index of the sequence in the step, first position, number of rows)
    spans: list[tuple[int, int, int]]


def prompt_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Raw log_softmax(logits)[target], its rank and the top k (vLLM's prompt logprobs)."""
    logprobs_all = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    picked = logprobs_all.gather(1, targets[:, None])  # [R, 1]
    ranks = (logprobs_all > picked).sum(dim=-1) + 1
    top_lps = top_ids = None
    if k > 0:
        top_lps, top_ids = logprobs_all.topk(k, dim=-1)
    return picked.squeeze(1), ranks, top_ids, top_lps


def apply_penalties(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
    """vLLM's semantics: repetition over prompt+output, presence/frequency over the output."""
    counts = m.output_counts
    seen = m.prompt_mask | (counts > 0)
    rep = m.repetition_penalty[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - m.frequency_penalty[:, None] * counts
    logits = logits - m.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor, m: SamplingMetadata) -> None:
    """In place: each request's logit_bias added, the tokens its grammar forbids and (before
    min_tokens) EOS/stop tokens banned. Device work only: nothing waits for the device."""
    if m.logit_bias is not None:
        rows, cols, bias = m.logit_bias
        if logits.is_contiguous():  # (row, token) pairs are unique: one add per element, no sort
            logits.view(-1).index_add_(0, rows * logits.shape[1] + cols, bias.to(logits.dtype))
        else:
            logits.index_put_((rows, cols), bias.to(logits.dtype), accumulate=True)
    if m.grammar_bitmask is not None:
        apply_grammar_bitmask(logits, m.structured_rows, m.grammar_bitmask)
    if m.fsm is not None:
        m.fsm.apply(logits)
    if m.min_tokens_mask is not None:
        logits[m.min_tokens_mask] = float("-inf")


def apply_grammar_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[rows] of the tokens whose bit is 0 become -inf (bit t of a row: token t allowed):
    one Triton pass on a GPU, the torch reference elsewhere."""
    if logits.is_cuda:
        from tandem.kernels.grammar_mask import apply_token_bitmask_

        apply_token_bitmask_(logits, rows, bitmask)
    else:
        apply_token_bitmask_ref(logits, rows, bitmask)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = (logits_sort.size(1) - top_k).clamp(min=0).unsqueeze(1)
        threshold = logits_sort.gather(1, kth)
        logits_sort.masked_fill_(logits_sort < threshold, float("-inf"))
    if top_p is not None:
        cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        logits_sort.masked_fill_(drop, float("-inf"))
    return logits.scatter(1, logits_idx, logits_sort)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, want_ranks: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits)[token] as logit[token] - logsumexp, and (optionally) the token's rank
    (1 = most likely), without materialising the [S, V] log-probabilities."""
    picked = logits.gather(1, token_ids[:, None])  # [S, 1]
    logprobs = (picked - torch.logsumexp(logits, dim=-1, keepdim=True)).squeeze(1)
    ranks = (logits > picked).sum(dim=-1) + 1 if want_ranks else None
    return logprobs, ranks


_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (splitmix64's increment)


def seeded_philox_keys(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Distinct Philox keys for (seed, offset) pairs: seed * golden + offset, wrapping in int64."""
    return seeds * _GOLDEN + offsets


class Sampler(nn.Module):
    """Samples one token per row. On a GPU the common case (temperature only, no penalties, no
    top-k logprobs) is one Triton pass over the logits (`tandem.kernels.sampling`); everything
    else, and every CPU run, takes the torch path below."""

    def __init__(self, seed: int, device: torch.device):
        super().__init__()
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def forward(self, logits: torch.Tensor, m: SamplingMetadata) -> SamplerOutput:
        if batch_invariant.is_enabled():
            out = self._batch_invariant(logits, m)
        elif logits.is_cuda and self.fused_supports(m):
            out = self._fused(logits, m)
        else:
            out = self._torch(logits, m)
        if m.fsm is not None:  # the rows' grammars take the tokens, on the device
            m.fsm.advance(out.token_ids)
        return out

    def _batch_invariant(self, logits: torch.Tensor, m: SamplingMetadata) -> SamplerOutput:
        """Sampled as usual; the sampled token's logprob from the row-wise kernel that a trainer's
        scorer calls too (`tandem.kernels.batch_invariant.token_logprobs`). With top-k/top-p/min-p
        the dropped tokens are -inf in the raw logits it reads, so it renormalises over the kept
        set as the processed logprobs do."""
        from tandem.kernels.batch_invariant import token_logprobs

        raw = logits.float().clone()  # the sampling paths below may write into `logits`
        fused = logits.is_cuda and self.fused_supports(m)
        out = self._fused(logits, m) if fused else self._torch(logits, m)
        if out.topk_logprobs is not None:
            return out  # top-k logprob lists: the plain path's numbers (not covered by the mode)
        apply_logit_bias(raw, m)
        if m.output_counts is not None:
            raw = apply_penalties(raw, m)
        if m.processed_logprobs and not m.all_greedy and (m.top_k is not None or m.top_p is not None
                                                          or m.min_p is not None):
            kept = raw / m.temperature[:, None]
            if m.top_k is not None or m.top_p is not None:
                kept = apply_top_k_top_p(kept, m.top_k, m.top_p)
            if m.min_p is not None:
                kept = apply_min_p(kept, m.min_p)
            raw = raw.masked_fill(kept == float("-inf"), float("-inf"))
        out.logprobs = token_logprobs(raw, out.token_ids, m.temperature if m.processed_logprobs else None)
        return out

    @staticmethod
    def fused_supports(m: SamplingMetadata) -> bool:
        return (
            m.top_k is None and m.top_p is None and m.min_p is None
            and m.output_counts is None and m.max_num_logprobs <= 0
        )

    def _fused(self, logits: torch.Tensor, m: SamplingMetadata) -> SamplerOutput:
        from tandem.kernels.sampling import sample

        apply_logit_bias(logits, m)  # in place: the logits are this step's scratch
        greedy = seeds = None
        if not m.all_greedy:
            greedy = m.greedy
            seeds = self._seeds(logits.shape[0], m, logits.device)
        token_ids, logprobs, ranks = sample(
            logits, m.temperature, greedy, seeds, m.processed_logprobs,
            want_ranks=m.max_num_logprobs == 0,
        )
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, ranks=ranks)

    def _seeds(self, num_rows: int, m: SamplingMetadata, device) -> torch.Tensor:
        """One Philox key per row: from the sampler's generator, or for a seeded row a function of
        its seed and how many tokens it has (so its draws depend on nothing else)."""
        seeds = torch.empty(num_rows, dtype=torch.int64, device=device)
        seeds.random_(generator=self.generator)
        if m.seeded_rows is not None:
            seeds[m.seeded_rows] = seeded_philox_keys(m.row_seeds, m.seed_offsets)
        return seeds

    def _torch(self, logits: torch.Tensor, m: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        apply_logit_bias(logits, m)
        if m.output_counts is not None:
            logits = apply_penalties(logits, m)
        raw = logits
        if m.all_greedy:
            token_ids, processed = logits.argmax(dim=-1), logits
        else:
            processed = logits / m.temperature[:, None]
            if m.top_k is not None or m.top_p is not None:
                processed = apply_top_k_top_p(processed, m.top_k, m.top_p)
            if m.min_p is not None:
                processed = apply_min_p(processed, m.min_p)
            # Gumbel-max: argmax(x / T - log E), E ~ Exp(1), draws from softmax(x / T).
            noise = torch.empty_like(processed).exponential_(generator=self.generator)
            for row, gen in m.generators.items():
                noise[row].exponential_(generator=gen)
            sampled = (processed - noise.log_()).argmax(dim=-1)
            token_ids = torch.where(m.greedy, logits.argmax(dim=-1), sampled)
        source = processed if m.processed_logprobs else raw
        if m.max_num_logprobs <= 0:
            logprobs, ranks = token_logprobs(source, token_ids, m.max_num_logprobs == 0)
            return SamplerOutput(token_ids=token_ids, logprobs=logprobs, ranks=ranks)
        logprobs_all = torch.log_softmax(source, dim=-1)
        token_lps = logprobs_all.gather(1, token_ids[:, None]).squeeze(1)
        out = SamplerOutput(token_ids=token_ids, logprobs=token_lps)
        out.ranks = (logprobs_all > token_lps[:, None]).sum(dim=-1) + 1
        out.topk_logprobs, out.topk_ids = logprobs_all.topk(m.max_num_logprobs, dim=-1)
        return out
