"""Prompts for load tests: random (token ids or words), ShareGPT JSON, JSONL of prompts.

Random prompts follow vLLM's RandomDataset: lengths uniform in [L(1-r), L(1+r)]. With
`--tokenizer` they are decoded random token ids with exact lengths; without one they are random
common English words, about one token each, and their lengths are reported as approximate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATASETS = ("random", "sharegpt", "jsonl")

# Short common words: most are one token (with their leading space) in BPE vocabularies.
_WORDS = (
    "the of and to in is was for on are with as by at be this from or have an they which one you "
    "were her all she there would their we him been has when who will more no if out so said what "
    "up its about into than them can only other new some could time these two may then do first "
    "any my now such like our over man me even most made after also did many before must through "
    "back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since "
    "against go came right used take three house light water city river tree stone fire road"
).split()


@dataclass
class DatasetConfig:
    """Which prompts to send and how long the outputs must be."""

    dataset_name: str = "random"  # random | sharegpt | jsonl
    dataset_path: str | None = None
    num_prompts: int = 1000
    input_len: int = 1024  # random: mean prompt tokens
    output_len: int = 128  # random and jsonl: output tokens forced with ignore_eos
    range_ratio: float = 0.0  # random: lengths uniform in [L(1-r), L(1+r)]
    sharegpt_output_len: int | None = None  # override ShareGPT's reply lengths
    tokenizer: str | None = None  # HF tokenizer dir: exact random-token prompts and lengths
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset_name not in DATASETS:
            raise ValueError(f"dataset_name must be one of {DATASETS}, got {self.dataset_name!r}")
        if self.dataset_name != "random" and not self.dataset_path:
            raise ValueError(f"dataset {self.dataset_name!r} needs --dataset-path")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, input_len and output_len must all be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")


@dataclass
class RequestSpec:
    """One prompt to send and the output length to force."""

    prompt: str
    prompt_len: int  # tokens; approximate when `approx_len`
    output_len: int
    approx_len: bool = False


def load_requests(cfg: DatasetConfig) -> list[RequestSpec]:
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    if cfg.dataset_name == "random":
        return random_requests(cfg, tokenizer)
    if cfg.dataset_name == "sharegpt":
        return sharegpt_requests(cfg, tokenizer)
    return jsonl_requests(cfg, tokenizer)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer  # only when asked: the import takes seconds

    return AutoTokenizer.from_pretrained(path)


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def random_requests(cfg: DatasetConfig, tokenizer=None) -> list[RequestSpec]:
    rng = np.random.default_rng(cfg.seed)
    in_lens = _lengths(rng, cfg.input_len, cfg.range_ratio, cfg.num_prompts)
    out_lens = _lengths(rng, cfg.output_len, cfg.range_ratio, cfg.num_prompts)
    specs = []
    for n_in, n_out in zip(in_lens, out_lens):
        if tokenizer is None:
            words = rng.choice(len(_WORDS), size=n_in)
            specs.append(RequestSpec(" ".join(_WORDS[i] for i in words), n_in, n_out, True))
        else:
            prompt, n_real = _random_token_prompt(tokenizer, rng, n_in)
            specs.append(RequestSpec(prompt, n_real, n_out))
    return specs


def _random_token_prompt(tokenizer, rng: np.random.Generator, n: int) -> tuple[str, int]:
    """Decode random ids, then re-encode and trim: decode/encode does not round-trip exactly."""
    special = set(tokenizer.all_special_ids)
    vocab = tokenizer.vocab_size
    ids: list[int] = []
    for _ in range(4):
        extra = [int(i) for i in rng.integers(0, vocab, size=n - len(ids)) if int(i) not in special]
        ids = tokenizer.encode(tokenizer.decode(ids + extra), add_special_tokens=False)[:n]
        if len(ids) >= n:
            break
    text = tokenizer.decode(ids)
    n_real = len(tokenizer.encode(text, add_special_tokens=False))
    if n_real == 0:
        raise ValueError(
            f"--tokenizer: random token ids do not decode to text that encodes again with "
            f"{getattr(tokenizer, 'name_or_path', 'this tokenizer')!r}; use the served model's "
            "tokenizer, or none (word prompts with approximate lengths)"
        )
    return text, n_real


def _count(text: str, tokenizer) -> tuple[int, bool]:
    if tokenizer is not None:
        return len(tokenizer.encode(text, add_special_tokens=False)), False
    return max(1, round(len(text) / 4)), True  # ~4 characters a token in English


def sharegpt_requests(cfg: DatasetConfig, tokenizer=None) -> list[RequestSpec]:
    """First human turn as the prompt, the reply's length as the output length; vLLM's filter
    (both >= 4 tokens, prompt <= 1024, prompt + reply <= 2048) unless the length is fixed."""
    data = json.loads(Path(cfg.dataset_path).read_text())
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(data)).tolist()
    specs: list[RequestSpec] = []
    for i in order:
        turns = data[i].get("conversations") or data[i].get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        n_in, approx = _count(prompt, tokenizer)
        n_out = cfg.sharegpt_output_len or _count(reply, tokenizer)[0]
        if cfg.sharegpt_output_len is None and (
            n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > 2048
        ):
            continue
        specs.append(RequestSpec(prompt, n_in, n_out, approx))
        if len(specs) == cfg.num_prompts:
            break
    return _fill_to(specs, cfg.num_prompts, cfg.dataset_path)


def jsonl_requests(cfg: DatasetConfig, tokenizer=None) -> list[RequestSpec]:
    """Each line: a JSON string, or an object with `prompt` (or `text`) and optional
    `output_len` (or `max_tokens`); lines without an output length use `--output-len`."""
    specs = []
    for line in Path(cfg.dataset_path).read_text().splitlines():
        if not line.strip():
            continue
        obj = json.loads(line)
        item = {"prompt": obj} if isinstance(obj, str) else obj
        prompt = item.get("prompt", item.get("text"))
        if not isinstance(prompt, str):
            raise ValueError(f"{cfg.dataset_path}: each line needs a 'prompt' string: {line[:80]}")
        n_out = int(item.get("output_len") or item.get("max_tokens") or cfg.output_len)
        n_in, approx = _count(prompt, tokenizer)
        specs.append(RequestSpec(prompt, n_in, n_out, approx))
    return _fill_to(specs[: cfg.num_prompts], cfg.num_prompts, cfg.dataset_path)


def _fill_to(specs: list[RequestSpec], n: int, path: str | None) -> list[RequestSpec]:
    """Cycle through the prompts when the file has fewer than asked for."""
    if not specs:
        raise ValueError(f"{path}: no usable prompts")
    return [specs[i % len(specs)] for i in range(n)]
