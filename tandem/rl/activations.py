"""What the training forward pass keeps for backward, measured rather than guessed, and switching
recompute (activation checkpointing) on the model.

A probe forward pass at two sequence lengths, under the trainer's own precision, counts the bytes
autograd saves for backward (`saved_tensors_hooks`). The difference between the two lengths is the
cost of a token; what stays is the per-forward cost that does not grow with tokens (autocast's bf16
weight copies). Whatever the model, attention implementation or dtype, the count is what backward
will hold. `model_sizes.ModelSizes.activations` is the same count by formula, from the config alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ActivationCost:
    """Bytes autograd keeps for backward, per forward pass of `rows` rows of `row_len` tokens:
    `fixed` + `per_token` x tokens + `per_row_sq` x rows x row_len^2 (the attention masks, kept
    by every layer's SDPA)."""

    per_token: float
    fixed: float
    per_row_sq: float = 0.0

    def bytes_for(self, tokens: int, row_len: int = 0) -> float:
        rows = tokens / row_len if row_len else 0
        return self.fixed + self.per_token * tokens + self.per_row_sq * rows * row_len**2


def measure_activations(
    model: torch.nn.Module,
    precision=contextlib.nullcontext,
    lengths: tuple[int, int, int] = (32, 48, 64),
) -> ActivationCost:
    """Saved-for-backward bytes of one forward pass of `model` (a HF causal LM, in its current
    gradient-checkpointing state) under the `precision` context, as a quadratic in the row length
    (exact through three lengths). The probe's row ends in one padding token, as the trainer's
    padded rows do, so attention runs with a mask as it will. Parameters are not counted (they are
    resident anyway); a tensor saved twice counts once.
    """
    params = {p.data_ptr() for p in model.parameters()}
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    sizes = []
    was_training = model.training
    model.train()
    try:
        for n in lengths:
            seen: dict[
                tuple[int, int], int
            ] = {}  # storage -> bytes: a tensor saved twice counts once

            kept: list[torch.Tensor] = []  # alive until the pass ends, so no storage is reused

            def pack(t: torch.Tensor, seen=seen, kept=kept) -> None:
                if t.device == device and t.data_ptr() not in params:
                    storage = t.untyped_storage()
                    seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
                    kept.append(t)
                # the graph itself keeps nothing: the probe never runs backward, and a graph that
                # outlives the probe must not hold what it saved (three forwards' bf16 weight
                # casts: ~9 GiB of a 1.5B model stayed allocated)

            ids = torch.randint(0, vocab, (1, n), device=device)
            mask = torch.ones_like(ids)
            mask[0, -1] = 0
            with (
                torch.enable_grad(),
                precision(),
                torch.autograd.graph.saved_tensors_hooks(pack, _no_backward),
            ):
                hidden = model.get_decoder()(
                    input_ids=ids, attention_mask=mask, use_cache=False
                ).last_hidden_state
            del hidden
            kept.clear()
            sizes.append(sum(seen.values()))
    finally:
        model.train(was_training)
    (n0, n1, n2), (b0, b1, b2) = lengths, sizes
    d01, d12 = (b1 - b0) / (n1 - n0), (b2 - b1) / (n2 - n1)
    sq = (d12 - d01) / (n2 - n0)  # divided differences: b = fixed + per_token n + sq n^2
    per_token = d01 - sq * (n0 + n1)
    return ActivationCost(
        per_token=per_token,
        fixed=max(0.0, b0 - per_token * n0 - sq * n0**2),
        per_row_sq=max(0.0, sq),
    )


def _no_backward(_) -> torch.Tensor:
    raise RuntimeError("the activation probe's graph keeps nothing for backward")


def set_recompute(model: torch.nn.Module, on: bool) -> None:
    """Non-reentrant activation checkpointing of every decoder layer on or off, by transformers'
    current name where it has one (5.2x) and its older one before."""
    if on:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        model.config.use_cache = False
    elif is_recomputing(model):
        disable = (
            getattr(model, "activation_checkpointing_disable", None)
            or model.gradient_checkpointing_disable
        )
        disable()


def is_recomputing(model: torch.nn.Module) -> bool:
    flag = (
        "is_activation_checkpointing"
        if hasattr(type(model), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    return bool(getattr(model, flag, False))
