"""Prompt datasets for GRPO: loading, a built-in arithmetic task, chat rendering, a sampler.

A dataset has a `prompt` column (a string, or a conversational list of message dicts); every other
column is handed to the reward functions, repeated once per generation.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

BUILTIN_DATASETS = ("arithmetic",)
_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

ARITHMETIC_INSTRUCTION = "Answer with just the number."


# ---- the built-in task ------------------------------------------------------------------------


def _is_test_problem(a: int, op: str, b: int, test_fraction: float) -> bool:
    # A fixed function of the problem, so the splits stay disjoint whatever n and seed are.
    h = (a * 1_000_003 + b * 7_919 + ord(op) * 104_729) % 10_007
    return h < test_fraction * 10_007


def arithmetic_dataset(
    n: int,
    seed: int = 0,
    split: str = "train",
    max_operand: int = 50,
    ops: Sequence[str] = ("+", "-"),
    test_fraction: float = 0.1,
    conversational: bool = True,
    instruction: str = ARITHMETIC_INSTRUCTION,
):
    """n problems like "What is 37 + 45?" with an `answer` column; needs nothing downloaded.

    "train" and "test" never share a problem. conversational=True makes each prompt a one-message
    chat, for instruct models; otherwise the prompt is the plain question.
    """
    from datasets import Dataset

    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    bad_ops = [op for op in ops if op not in ("+", "-", "*")]
    if bad_ops or not ops:
        raise ValueError(f"ops must be a non-empty subset of '+', '-', '*', got {list(ops)}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    want_test = split == "test"
    pool = [
        (a, op, b)
        for op in ops
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
        if _is_test_problem(a, op, b, test_fraction) == want_test
    ]
    if n > len(pool):
        raise ValueError(
            f"the {split} split has only {len(pool)} distinct problems with max_operand="
            f"{max_operand} and ops={list(ops)}; ask for fewer or raise max_operand"
        )
    problems = random.Random(seed).sample(pool, n)
    results = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    prompts, answers = [], []
    for a, op, b in problems:
        question = f"What is {a} {op} {b}? {instruction}".strip()
        prompts.append([{"role": "user", "content": question}] if conversational else question)
        answers.append(str(results[op](a, b)))
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


# ---- loading ----------------------------------------------------------------------------------


def load_prompt_dataset(source: Any, split: str = "train", prompt_column: str = "prompt"):
    """A `datasets.Dataset` with a `prompt` column, from a Dataset, a local file or directory
    (JSONL / JSON / Parquet / CSV), or a built-in name ("arithmetic")."""
    from datasets import Dataset, DatasetDict, load_dataset

    if isinstance(source, DatasetDict):
        if split not in source:
            raise ValueError(f"dataset has splits {list(source)}, not {split!r}")
        source = source[split]
    if isinstance(source, Dataset):
        dataset = source
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path) and path in BUILTIN_DATASETS:
            dataset = arithmetic_dataset(2000 if split == "train" else 200, split=split)
        elif os.path.isfile(path):
            ext = os.path.splitext(path)[1].lower()
            if ext not in _FILE_FORMATS:
                raise ValueError(
                    f"{path}: unsupported file type {ext!r}; use one of {list(_FILE_FORMATS)}"
                )
            dataset = load_dataset(_FILE_FORMATS[ext], data_files=path, split="train")
        elif os.path.isdir(path):
            dataset = load_dataset(path, split=split)
        else:
            raise FileNotFoundError(
                f"{path}: no such file or directory "
                f"(built-in datasets: {', '.join(BUILTIN_DATASETS)})"
            )
    else:
        raise TypeError(f"source must be a datasets.Dataset or a path, got {type(source).__name__}")
    if prompt_column != "prompt" and prompt_column in dataset.column_names:
        if "prompt" in dataset.column_names:
            dataset = dataset.remove_columns("prompt")
        dataset = dataset.rename_column(prompt_column, "prompt")
    if "prompt" not in dataset.column_names:
        raise ValueError(
            f"the dataset has no {prompt_column!r} column (it has {dataset.column_names}); "
            "rename the "
            "column holding the prompts to 'prompt' or pass prompt_column=<its name>"
        )
    if len(dataset) == 0:
        raise ValueError("the dataset is empty")
    return dataset


# ---- rendering --------------------------------------------------------------------------------


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)


def render_prompt(
    prompt: Any, tokenizer: Any = None, chat_template_kwargs: dict | None = None
) -> str:
    """The text the engine continues: a plain prompt as is, a conversation through the chat
    template (with the generation prompt)."""
    if isinstance(prompt, str):
        return prompt
    if not is_conversational(prompt) or not prompt:
        raise TypeError(
            "a prompt must be a string or a non-empty list of {'role': ..., 'content': ...} dicts, "
            f"got {prompt!r:.100}"
        )
    for i, message in enumerate(prompt):
        if "role" not in message or "content" not in message:
            raise ValueError(f"message {i} of a prompt lacks 'role' or 'content': {message!r:.100}")
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("conversational prompts need a tokenizer with a chat template")
    return tokenizer.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
    )


def tokenize_prompts(
    texts: Sequence[str], tokenizer: Any, max_prompt_length: int | None
) -> list[list[int]]:
    """Token ids of rendered prompts (the template carries any special tokens); longer ones keep
    their last max_prompt_length tokens, as TRL truncates from the left."""
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    if max_prompt_length is not None:
        ids = [x[-max_prompt_length:] for x in ids]
    return [list(x) for x in ids]


@dataclass
class PromptBatch:
    """One generation batch of distinct prompts, ready for the engine and the reward functions."""

    indices: list[int]
    prompts: list[Any]  # as in the dataset: str or list of messages
    texts: list[str]  # rendered
    prompt_ids: list[list[int]]
    columns: dict[str, list[Any]]  # every other dataset column

    def reward_columns(self, num_generations: int) -> dict[str, list[Any]]:
        """Columns repeated per completion, in the engine's order (prompt 0's G outputs first)."""
        return {
            k: [v for v in vals for _ in range(num_generations)] for k, vals in self.columns.items()
        }

    def repeated_prompts(self, num_generations: int) -> list[Any]:
        return [p for p in self.prompts for _ in range(num_generations)]


def build_prompt_batch(
    dataset: Any,
    indices: Sequence[int],
    tokenizer: Any,
    max_prompt_length: int | None = None,
    chat_template_kwargs: dict | None = None,
) -> PromptBatch:
    rows = dataset[list(indices)]  # dict of column -> list
    prompts = rows["prompt"]
    texts = [render_prompt(p, tokenizer, chat_template_kwargs) for p in prompts]
    columns = {k: v for k, v in rows.items() if k != "prompt"}
    return PromptBatch(
        list(indices),
        prompts,
        texts,
        tokenize_prompts(texts, tokenizer, max_prompt_length),
        columns,
    )


# ---- sampling ---------------------------------------------------------------------------------


class RepeatSampler:
    """Dataset indices in a seeded shuffled order, in batches of `batch_size` distinct prompts,
    resumable from `state_dict()`.

    Iterating yields each index `mini_repeat_count` times in a row (num_generations, as TRL's
    RepeatSampler), each batch `repeat_count` times; `next_batch()` gives the distinct indices of
    the next batch. Epoch e's order is a function of (seed, e) only, so a restored sampler
    continues exactly. An incomplete last batch of an epoch is dropped.
    """

    def __init__(
        self,
        num_samples: int,
        mini_repeat_count: int = 1,
        batch_size: int = 1,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if batch_size > num_samples:
            raise ValueError(
                f"a batch needs {batch_size} distinct prompts but the dataset has {num_samples}; "
                "use a larger dataset or fewer prompts per generation batch"
            )
        self.num_samples, self.mini_repeat_count = num_samples, mini_repeat_count
        self.batch_size, self.repeat_count = batch_size, repeat_count
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.position = 0, 0  # position: batches of this epoch handed out
        self._cached: tuple[int, list[int]] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.batch_size

    def _order(self, epoch: int) -> list[int]:
        if self._cached is None or self._cached[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.num_samples, generator=g).tolist()
            else:
                order = list(range(self.num_samples))
            self._cached = (epoch, order)
        return self._cached[1]

    def next_batch(self) -> list[int]:
        """The distinct indices of the next batch, moving to the next epoch when one runs out."""
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        self.position += 1
        return self._order(self.epoch)[start : start + self.batch_size]

    def __iter__(self) -> Iterator[int]:
        """The rest of the current epoch, repeated as TRL's RepeatSampler repeats it."""
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        epoch = self.epoch
        while self.epoch == epoch and self.position < self.batches_per_epoch:
            chunk = self.next_batch()
            for _ in range(self.repeat_count):
                for index in chunk:
                    for _ in range(self.mini_repeat_count):
                        yield index

    def __len__(self) -> int:
        return self.batches_per_epoch * self.batch_size * self.mini_repeat_count * self.repeat_count

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("num_samples", "batch_size", "seed"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"the saved sampler had {key}={state[key]} but this one has "
                    f"{getattr(self, key)}; resume with the same dataset and batch settings"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
