"""Tensor-parallel process groups: which ranks shard one engine, and the collectives they run.

Ranks are grouped consecutively: with world size 4 and tensor_parallel_size 2, ranks {0, 1} run one
engine and {2, 3} another. Every engine builds fresh groups, so two engines never share one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch >= 2.13 renamed all_gather_into_tensor; the old name still works, with a warning.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class TPGroup:
    """This rank's place in its tensor-parallel group, and the group's device collectives.

    The collectives never synchronise with the host, so CUDA graphs capture them.
    """

    group: dist.ProcessGroup  # NCCL on CUDA, gloo on CPU
    rank: int  # within the group
    size: int
    ranks: list[int]  # global ranks of the group, in group-rank order
    device: torch.device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[R, ...] on each rank -> [size * R, ...], rank 0's rows first."""
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x, group=self.group)
        return out

    def all_equal(self, value: int) -> bool:
        """Whether every rank passed the same `value` (host sync: for setup only)."""
        t = torch.tensor([value, -value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t[0]) == -int(t[1])

    def agree_min(self, value: int) -> int:
        """The smallest `value` over the group (host sync: for setup only, e.g. KV-cache blocks)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


def tp_group_ranks(world_size: int, tp_size: int, rank: int) -> list[int]:
    """The consecutive block of `tp_size` global ranks that `rank` belongs to."""
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(
            f"the world size ({world_size}) must be a multiple of tensor_parallel_size "
            f"({tp_size}); launch {tp_size}, {2 * tp_size}, ... processes"
        )
    start = rank // tp_size * tp_size
    return list(range(start, start + tp_size))


def init_tp_group(tp_size: int, device: torch.device) -> TPGroup:
    """Build the tensor-parallel groups of the initialised world and return this rank's.

    Every rank of the world must call this together (torch.distributed's `new_group` rule), as
    every rank does when each one builds its engine.
    """
    if not dist.is_initialized():
        raise ValueError(
            f"tensor_parallel_size={tp_size} inside a process that runs one rank needs "
            "torch.distributed initialised first (torchrun); LLM(...) alone spawns its own ranks"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = tp_group_ranks(world, tp_size, rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    own = None
    for start in range(0, world, tp_size):
        ranks = list(range(start, start + tp_size))
        group = dist.new_group(ranks, backend=backend)
        if ranks == mine:
            own = group
    return TPGroup(own, mine.index(rank), tp_size, mine, device)
