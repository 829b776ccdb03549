"""How the trainer's model is laid over the ranks, chosen once at construction
(`GRPOConfig.fsdp`): every rank a full replica with all-reduced gradients, or FSDP2 shards.

The trainer asks the strategy, never `args.fsdp`: how to prepare the model, reduce and clip
gradients, hand the engine full weights, and write and read checkpoints.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from tandem.rl import checkpoint as ckpt
from tandem.rl.distributed import DistributedContext


class Replicate:
    """Each rank trains a full replica; gradients are summed over ranks after backward."""

    sharded = False

    def __init__(self, dist: DistributedContext):
        self.dist = dist

    def prepare(self, models: Iterable[torch.nn.Module | None], device: torch.device, bf16: bool) -> None:
        pass

    def reduce_grads(self, model: torch.nn.Module) -> None:
        self.dist.all_reduce_grads(model)

    def clip_grad_norm(self, params, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def engine_weights(self, model: torch.nn.Module) -> Callable[[], Iterable[tuple[str, torch.Tensor]]] | None:
        return None  # the engine reads the (unsharded) model itself

    def full_state_dicts(self, model, optimizer) -> tuple[dict | None, dict | None]:
        return None, None  # rank 0 saves its own replica

    def load_checkpoint(self, path, model, optimizer, scheduler) -> dict:
        return ckpt.load_checkpoint(path, model, optimizer, scheduler)


class Shard:
    """FSDP2: parameters, gradients and optimizer state sharded over the ranks (`tandem.rl.fsdp`)."""

    sharded = True

    def __init__(self, dist: DistributedContext):
        from tandem.rl import fsdp  # torch.distributed.fsdp: a second's import, only when used

        self.dist, self.fsdp = dist, fsdp

    def prepare(self, models: Iterable[torch.nn.Module | None], device: torch.device, bf16: bool) -> None:
        for m in models:
            if m is not None:
                self.fsdp.apply_fsdp(m, device, bf16)

    def reduce_grads(self, model: torch.nn.Module) -> None:
        pass  # reduce-scattered during backward

    def clip_grad_norm(self, params, max_norm: float) -> float:
        return self.fsdp.clip_grad_norm_(params, max_norm)

    def engine_weights(self, model: torch.nn.Module):
        return functools.partial(self.fsdp.full_weights, model)  # one unit gathered at a time

    def full_state_dicts(self, model, optimizer) -> tuple[dict | None, dict | None]:
        return self.fsdp.gather_state_dicts(model, optimizer)  # to rank 0

    def load_checkpoint(self, path, model, optimizer, scheduler) -> dict:
        state = ckpt.load_checkpoint(path, scheduler=scheduler)
        # Rank 0 reads the full weights and optimizer state; each rank keeps its shards.
        main = self.dist.is_main
        weights = ckpt.read_model_weights(path) if main else {}
        optim = torch.load(Path(path) / ckpt.OPTIMIZER, map_location="cpu", weights_only=True) if main else {}
        self.fsdp.scatter_state_dicts(model, optimizer, weights, optim)
        return state


def make_strategy(fsdp: bool, dist: DistributedContext) -> Replicate | Shard:
    return Shard(dist) if fsdp else Replicate(dist)
