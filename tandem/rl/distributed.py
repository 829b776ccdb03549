"""Data parallelism for the colocated trainer: one process per device, each with its own engine.

Every rank draws the same global prompt batch and keeps a contiguous slice of it (whole groups of
num_generations, so group advantages need no communication). Each rank holds a full replica of
the trainer's model; after the backward passes of an optimizer step the gradients are summed over
ranks. The loss is normalised globally before backward (dapo: by the global token count; the
other loss types: by the global micro-batch count), so a SUM gives exactly the single-process
gradient of the same global batch, and the replicas stay identical without broadcasting weights.

With one process every method is the identity, so the single-process trainer runs unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from tandem.rl.rewards import RewardResult

_BUCKET_NUMEL = 1 << 24  # gradients are all-reduced in flat buckets of at most 16M elements


class DistributedContext:
    """This process's rank in the data-parallel world, and the few collectives the trainer needs."""

    def __init__(self, rank: int = 0, world_size: int = 1, group=None,
                 comm_device: torch.device | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of {world_size} processes")
        self.rank, self.world_size, self.group = rank, world_size, group
        self.comm_device = comm_device or torch.device("cpu")  # where the backend takes tensors

    @classmethod
    def from_environment(cls) -> DistributedContext:
        """The initialised default process group (torchrun), or a world of one process."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            nccl = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
            return cls(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, device)
        return cls()

    @property
    def is_main(self) -> bool:
        """Rank 0 logs and writes checkpoints."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    # -- sharding ------------------------------------------------------------------------------------
    def shard(self, indices: Sequence[int]) -> list[int]:
        """This rank's contiguous slice of the global batch's prompt indices."""
        n = len(indices)
        if n % self.world_size:
            raise ValueError(
                f"a global batch of {n} prompts cannot be split evenly over {self.world_size} "
                "ranks; make the number of prompts per generation batch a multiple of the world size"
            )
        per = n // self.world_size
        return list(indices[self.rank * per : (self.rank + 1) * per])

    def shard_offset(self, num_local: int) -> int:
        """Global index of this rank's first prompt, when every rank holds num_local prompts."""
        return self.rank * num_local

    # -- collectives ---------------------------------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns the tensor."""
        if self.enabled:
            buf = tensor.to(self.comm_device)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
            if buf is not tensor:
                tensor.copy_(buf)
        return tensor

    def all_reduce_max(self, value: int) -> int:
        """The largest of every rank's value."""
        if not self.enabled:
            return value
        buf = torch.tensor([value], dtype=torch.long, device=self.comm_device)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        return int(buf.item())

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor (same shape on each) concatenated along dim 0 in rank order."""
        if not self.enabled:
            return tensor
        buf = tensor.to(self.comm_device).contiguous()
        parts = [torch.empty_like(buf) for _ in range(self.world_size)]
        dist.all_gather(parts, buf, group=self.group)
        return torch.cat(parts, dim=0).to(tensor.device)

    def sum_dicts(self, values: dict[str, float]) -> dict[str, float]:
        """Key-wise sums over ranks; a key missing on a rank counts as 0 there."""
        if not self.enabled:
            return dict(values)
        gathered: list[dict[str, float] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, dict(values), group=self.group)
        out: dict[str, float] = {}
        for d in gathered:
            for k, v in (d or {}).items():
                out[k] = out.get(k, 0.0) + v
        return out

    @torch.no_grad()
    def all_reduce_grads(self, model: torch.nn.Module) -> None:
        """Sum every parameter's gradient over ranks (in flat buckets, one per dtype and device).

        A parameter without a gradient on this rank takes part with zeros, so the ranks always
        issue the same collectives.
        """
        if not self.enabled:
            return
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for p in model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        for grads in buckets.values():
            for chunk in _chunks(grads, _BUCKET_NUMEL):
                flat = torch.cat([g.reshape(-1) for g in chunk])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
                offset = 0
                for g in chunk:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()

    @torch.no_grad()
    def broadcast_params(self, model: torch.nn.Module) -> None:
        """Make every rank's replica equal to rank 0's (parameters and buffers)."""
        if not self.enabled:
            return
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0, group=self.group)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)


def _chunks(tensors: list[torch.Tensor], max_numel: int) -> list[list[torch.Tensor]]:
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        if out[-1] and size + t.numel() > max_numel:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.numel()
    return [c for c in out if c]


def gather_rewards(ctx: DistributedContext, local: RewardResult) -> RewardResult:
    """The global batch's rewards in prompt order (rank 0's completions first)."""
    if not ctx.enabled:
        return local
    dropped = ctx.sum_dicts({k: float(v) for k, v in local.num_dropped.items()})
    return RewardResult(ctx.all_gather(local.rewards_per_func), ctx.all_gather(local.rewards),
                        list(local.names), {k: int(v) for k, v in dropped.items()},
                        local.logged, local.extra_columns)  # log_metric values: this rank's
