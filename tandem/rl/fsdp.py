"""FSDP2 for the data-parallel colocated trainer (`GRPOConfig.fsdp`).

Every decoder layer is one FSDP unit and the root (embeddings, final norm, lm_head) another, as
torchtitan and accelerate's transformer-based wrap do. Parameters, gradients and AdamW state are
sharded over the ranks; forward and backward gather one unit at a time. Gradients are SUMMED in
the reduce-scatter, as the all-reduce path sums them: the loss is normalised over the global
batch before backward (distributed.py), so a sum is the single-process gradient.

Each rank's own engine needs the full weights: `full_weights` gathers them one unit at a time,
so beside its shards a rank holds at most one unit in full. Checkpoints are full (HF-format)
state dicts gathered to rank 0 and broadcast back from it on resume, so a run may resume on a
different number of ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def apply_fsdp(model: torch.nn.Module, device: torch.device, bf16: bool) -> torch.nn.Module:
    """Shard `model` in place over every rank of the default process group: one FSDP unit per
    decoder layer (the classes HF names in `_no_split_modules`), then the root."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("fsdp=True needs torch.distributed initialised: launch with torchrun "
                         "and call dist.init_process_group() before building the trainer")
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(f"fsdp=True: {type(model).__name__} names no decoder layer class in "
                         "_no_split_modules, so there is nothing to shard layer by layer")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # bf16 compute and all-gathers, fp32 master weights and gradient reduction.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for unit in fsdp_units(model):
        # Sum, never average: the loss is already normalised globally. Only SUM reductions also
        # keep gloo (CPU) working: it has neither AVG nor PREMUL_SUM.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return model


def fsdp_units(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def full_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of every parameter, gathering one FSDP unit at a time.

    Every rank must consume it to the end (each unit is one all-gather). A unit is resharded as
    soon as the consumer asks for the next unit's first tensor, so a consumer that copies each
    tensor away (the engine's load_weights) holds at most one unit in full.
    """
    names = {id(m): name for name, m in model.named_modules()}
    for unit in fsdp_units(model):
        prefix = names[id(unit)] + "." if names[id(unit)] else ""
        owned = _owned_parameter_names(unit)
        unit.unshard()
        try:
            for name in owned:
                yield prefix + name, unit.get_parameter(name).detach()
        finally:
            unit.reshard()
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for name, buf in model.state_dict().items():  # persistent buffers are not sharded
        if name not in params:
            yield name, buf.detach()


def _owned_parameter_names(unit: torch.nn.Module) -> list[str]:
    """Parameters of `unit` that no nested FSDP unit manages (names relative to `unit`)."""
    nested = [n + "." for n, m in unit.named_modules() if m is not unit and isinstance(m, FSDPModule)]
    return [n for n, _ in unit.named_parameters() if not n.startswith(tuple(nested))]


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> float:
    """torch's clip_grad_norm_, for sharded (DTensor) gradients too: the total norm is over the
    full gradients of every rank."""
    params = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


# ---- checkpoints --------------------------------------------------------------------------------


def gather_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full model and optimizer state dicts (keyed by parameter name), on rank 0's host memory;
    other ranks get empty dicts. Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import (  # a slow import: only when checkpointing
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    gather = StateDictOptions(full_state_dict=True, cpu_offload=True)  # to rank 0, on the host
    return (get_model_state_dict(model, options=gather),
            get_optimizer_state_dict(model, optimizer, options=gather))


def scatter_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                        model_state: dict, optimizer_state: dict | None) -> None:
    """Load full state dicts that only rank 0 holds (others pass empty dicts) into the shards of
    every rank. Every rank must call it; a checkpoint that does not fit raises on every rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    scatter = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    problem = [None]
    if dist.get_rank() == 0:
        expected = set(model.state_dict()) - _tied_names(model)  # save_pretrained drops tied copies
        missing, unexpected = sorted(expected - set(model_state)), sorted(set(model_state) - set(model.state_dict()))
        if missing or unexpected:
            problem[0] = f"checkpoint does not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]})"
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise RuntimeError(problem[0])
    set_model_state_dict(model, model_state, options=scatter)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state or {}, options=scatter)


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters that share storage with an earlier one (save_pretrained leaves them out)."""
    seen, tied = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.add(id(p))
    return tied
