"""One rollout: the engine's G completions per prompt with their sampling logprobs, as tensors.

Shapes: N = prompts x G completions, P = longest prompt (left-padded), T = longest completion
(right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from tandem.engine.detokenizer import batch_decode
from tandem.outputs import FlatLogprobs
from tandem.rl.data import PromptBatch
from tandem.sampling_params import SamplingParams


@dataclass
class Rollout:
    prompt_ids: list[list[int]]  # [N] each prompt repeated G times
    completion_ids: list[list[int]]  # [N]
    engine_logps: list[list[float]]  # [N] the engine's logprob of each sampled token
    truncated: list[bool]  # [N] stopped by max_tokens rather than EOS / stop
    texts: list[str]  # [N] decoded completions

    @property
    def num_completion_tokens(self) -> int:
        return sum(map(len, self.completion_ids))


def generate_rollout(llm, batch: PromptBatch, num_generations: int, params: SamplingParams,
                     seed: int | None = None, prompt_offset: int = 0) -> Rollout:
    """G samples per prompt from the engine; they share the prompt's KV blocks (prefix caching).

    With `seed`, prompt i samples with seed + i * num_generations (its G samples take the next
    ones), so a resumed run draws exactly what an uninterrupted one would. `prompt_offset` is the
    global index of batch.prompt_ids[0] when a data-parallel rank holds a slice of the batch, so
    each prompt samples as it would in the single-process run.
    """
    # The texts are decoded once, in one batch, at the end (no per-token logprob text either);
    # stop strings are matched in the engine's detokenized text, so they keep it.
    detokenize = bool(params.stop_strings)
    per_prompt = [
        params.clone(n=num_generations, logprobs=0, detokenize=detokenize,
                     seed=None if seed is None else seed + (prompt_offset + i) * num_generations)
        for i in range(len(batch.prompt_ids))
    ]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in batch.prompt_ids], per_prompt, use_tqdm=False)
    r = Rollout([], [], [], [], [])
    for ids, out in zip(batch.prompt_ids, outs):
        for c in out.outputs:
            r.prompt_ids.append(ids)
            r.completion_ids.append(list(c.token_ids))
            r.engine_logps.append(sampled_logprobs(c))
            r.truncated.append(c.finish_reason == "length")
            r.texts.append(c.text)
    tokenizer = llm.get_tokenizer()
    if not detokenize and tokenizer is not None:
        r.texts = batch_decode(tokenizer, r.completion_ids, params.skip_special_tokens)
    return r


def sampled_logprobs(c) -> list[float]:
    """The logprob of each sampled token of a completion asked with logprobs=0."""
    lp = c.logprobs
    if isinstance(lp, FlatLogprobs) and len(lp.token_ids) == len(lp):  # one entry a position
        return lp.logprobs
    return [position[t].logprob for position, t in zip(lp, c.token_ids)]


def pack(rollout: Rollout, pad_id: int, device: torch.device, mask_truncated: bool = False) -> dict:
    """Tensors for the trainer: each row is its prompt, its completion, then right padding.

    input_ids / attention_mask [N, L], prompt_lengths [N] (where row i's completion starts),
    completion_mask and engine_logp [N, T] on `device`; prompt_lengths_cpu, seq_lens_cpu [N]
    (prompt + completion tokens) and prompt_groups_cpu [N] (one id for the rows of one prompt's
    tokens, `GRPOConfig.share_prompts`) on the host. No row is left-padded: a left pad is a query
    position that attends to nothing, which SDPA's bf16 backward turns into NaN gradients
    (`logprobs.py`).
    Truncated completions get an all-zero mask when `mask_truncated`.
    """
    N = len(rollout.prompt_ids)
    if any(len(lp) != len(c) for lp, c in zip(rollout.engine_logps, rollout.completion_ids)):
        raise ValueError("every completion needs one engine logprob per token (Rollout.engine_logps)")
    prompt_lengths = torch.tensor([len(p) for p in rollout.prompt_ids], dtype=torch.long)
    completion_lengths = torch.tensor([len(c) for c in rollout.completion_ids], dtype=torch.long)
    seq_lens = prompt_lengths + completion_lengths
    T = max(1, int(completion_lengths.max()))
    L = int(seq_lens.max())
    # Each row's tokens fill its first seq_len places, so the row-major order of the mask's places
    # is the rows' tokens one after another: one array from one pass, not a tensor per row.
    attention = (torch.arange(L) < seq_lens[:, None]).long()
    input_ids = torch.full((N, L), pad_id, dtype=torch.long)
    tokens = chain.from_iterable(chain(p, c) for p, c in zip(rollout.prompt_ids, rollout.completion_ids))
    input_ids[attention.bool()] = torch.from_numpy(np.fromiter(tokens, np.int64, int(seq_lens.sum())))
    sampled = torch.arange(T) < completion_lengths[:, None]  # [N, T]: a completion token sits there
    engine_logp = torch.zeros((N, T), dtype=torch.float32)
    engine_logp[sampled] = torch.from_numpy(
        np.fromiter(chain.from_iterable(rollout.engine_logps), np.float32, int(completion_lengths.sum())))
    completion_mask = sampled.float()
    if mask_truncated:
        completion_mask[torch.tensor(rollout.truncated, dtype=torch.bool)] = 0.0
    group_of: dict[tuple[int, ...], int] = {}
    groups = torch.tensor([group_of.setdefault(tuple(p), len(group_of)) for p in rollout.prompt_ids])
    return {
        "input_ids": input_ids.to(device), "attention_mask": attention.to(device),
        "prompt_lengths": prompt_lengths.to(device), "completion_mask": completion_mask.to(device),
        "engine_logp": engine_logp.to(device),
        # on the host, for what the trainer plans from them without reading the device back
        "prompt_lengths_cpu": prompt_lengths, "seq_lens_cpu": seq_lens, "prompt_groups_cpu": groups,
    }
