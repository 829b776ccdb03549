"""Reward models as reward functions, as TRL takes them: a sequence-classification model (or its
name) scores prompt + completion; its first logit is the reward."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch


class RewardModel:
    """`f(prompts, completions, **kwargs) -> [float]` over a sequence-classification model."""

    def __init__(self, model, tokenizer, device: torch.device, batch_size: int = 32):
        if tokenizer is None:
            raise ValueError(
                f"reward model {_name(model)!r} has no tokenizer: pass it in "
                "reward_processing_classes (one entry per reward function, None for functions)"
            )
        if tokenizer.pad_token_id is None:  # as TRL: pad with EOS
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
        self.model = model.to(device).eval().requires_grad_(False)
        self.tokenizer, self.device, self.batch_size = tokenizer, device, batch_size
        self.__name__ = _name(model)

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        texts = [self._text(p, c) for p, c in zip(prompts, completions)]
        out: list[float] = []
        for s in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[s : s + self.batch_size], return_tensors="pt", padding=True,
                                 padding_side="right", add_special_tokens=False).to(self.device)
            out += self.model(**enc).logits[:, 0].float().tolist()
        return out

    def _text(self, prompt, completion) -> str:
        if isinstance(prompt, list):  # conversational: the whole conversation, templated
            return self.tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        return prompt + completion


def _name(model) -> str:
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    return str(path).rstrip("/").split("/")[-1]


def prepare_reward_funcs(reward_funcs, reward_processing_classes, device: torch.device,
                         trust_remote_code: bool = False) -> list:
    """Reward functions as RewardComputer takes them: model names and models become RewardModels."""
    funcs = [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs)
    classes = reward_processing_classes
    if classes is None:
        classes = [None] * len(funcs)
    elif not isinstance(classes, (list, tuple)):
        classes = [classes]
    if len(classes) != len(funcs):
        raise ValueError(f"reward_processing_classes has {len(classes)} entries for {len(funcs)} "
                         "reward functions; give one per function (None for plain functions)")
    out = []
    for f, tok in zip(funcs, classes):
        if isinstance(f, str):
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            from tandem.models.hub import looks_like_repo_id, snapshot_dir

            path = f if os.path.isdir(f) or not looks_like_repo_id(f) else snapshot_dir(f)
            f = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, trust_remote_code=trust_remote_code)
            tok = tok if tok is not None else AutoTokenizer.from_pretrained(path)
        if isinstance(f, torch.nn.Module):
            if tok is None:
                from transformers import AutoTokenizer

                path = getattr(f.config, "_name_or_path", None)
                tok = AutoTokenizer.from_pretrained(path) if path else None
            f = RewardModel(f, tok, device)
        out.append(f)
    return out
