"""The completion lengths of the `tandem bench rl` workload, and how each trainer is made to hit them.

`--completion-len N`: every completion has N tokens. `--completion-len-dist uniform:LO-HI`: each
prompt draws its length once (seeded by `--seed`); its G completions all have it. tandem's engine
gets one SamplingParams per prompt (max_tokens = the length, ignore_eos), vLLM's per-request
params. TRL's transformers `generate` takes one max_new_tokens for the batch, so a logits processor
ends each row at its length (EOS barred before it, forced as its last token, which TRL counts as a
completion token): the same completion tokens, though `generate` runs until its batch's longest
row ends, as it would with real EOS tokens.
"""

from __future__ import annotations

import random
import statistics

from tandem.bench.rl_workload import RLBenchConfig


def completion_range(cfg: RLBenchConfig) -> tuple[int, int]:
    """The shortest and longest completion of the workload."""
    if cfg.completion_len_dist is None:
        return cfg.completion_len, cfg.completion_len
    kind, _, span = cfg.completion_len_dist.partition(":")
    lo, _, hi = span.partition("-")
    if kind != "uniform" or not (lo.isdigit() and hi.isdigit()) or not 1 <= int(lo) <= int(hi):
        raise ValueError("completion_len_dist must be 'uniform:LO-HI' with 1 <= LO <= HI (e.g. "
                         f"uniform:32-512), got {cfg.completion_len_dist!r}")
    return int(lo), int(hi)


def completion_lengths(cfg: RLBenchConfig, prompts: list[str], tok) -> dict[tuple[int, ...], int]:
    """Each prompt's completion length, keyed by its token ids as both trainers see them (no
    special tokens, the last prompt_len kept)."""
    lo, hi = completion_range(cfg)
    rng = random.Random(f"{cfg.seed}:completion lengths")
    ids = tok(list(prompts), add_special_tokens=False)["input_ids"]
    return {tuple(x[-cfg.prompt_len :]): rng.randint(lo, hi) for x in ids}


def mean_length(lengths: dict[tuple[int, ...], int]) -> float:
    return statistics.mean(lengths.values())


def _length_of(lengths: dict[tuple[int, ...], int], ids) -> int:
    key = tuple(int(t) for t in ids)
    if key not in lengths:
        raise KeyError(f"a prompt of {len(key)} tokens that the workload did not draw a length for")
    return lengths[key]


def stop_at_drawn_lengths(llm, lengths: dict[tuple[int, ...], int]) -> None:
    """From now on this engine's generate gives each prompt its own SamplingParams: max_tokens its
    drawn length, ignore_eos, so every completion has exactly that many tokens."""
    generate = llm.generate

    def per_prompt(prompts, sampling_params, use_tqdm: bool = True):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        params = [p.clone(max_tokens=_length_of(lengths, x["prompt_token_ids"]), ignore_eos=True)
                  for x, p in zip(prompts, params)]
        return generate(prompts, params, use_tqdm=use_tqdm)

    llm.generate = per_prompt


class EndAtLength:
    """A transformers logits processor: row b's completion ends after lengths[b] tokens, the last
    one EOS (before it EOS is barred). prompt_len: the (left-padded) prompt width of the batch."""

    def __init__(self, lengths, prompt_len: int, eos_token_id: int):
        self.lengths, self.prompt_len, self.eos = lengths, prompt_len, eos_token_id

    def __call__(self, input_ids, scores):
        made = input_ids.shape[1] - self.prompt_len  # tokens generated so far, the same for every row
        scores = scores.clone()
        scores[made < self.lengths - 1, self.eos] = float("-inf")
        last = made == self.lengths - 1
        scores[last] = float("-inf")
        scores[last, self.eos] = 0.0
        return scores


class TRLLengths:
    """Makes `model.generate` (what TRL's GRPOTrainer calls without vLLM) end each row at its
    prompt's drawn length; `calls` counts the generate calls it ended, so the report can say
    whether TRL went through it."""

    def __init__(self, model, lengths: dict[tuple[int, ...], int], eos_token_id: int):
        import torch
        from transformers import LogitsProcessorList

        self.calls = 0
        generate = model.generate

        def per_row(*args, **kwargs):
            ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            mask = kwargs.get("attention_mask")
            rows = ids if mask is None else [r[m.bool()] for r, m in zip(ids, mask)]
            targets = torch.tensor([_length_of(lengths, r.tolist()) for r in rows], device=ids.device)
            end = EndAtLength(targets, ids.shape[1], eos_token_id)
            kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), end])
            self.calls += 1
            return generate(*args, **kwargs)

        model.generate = per_row
