"""How the training phase will use device memory, measured rather than guessed, and the choice it
leads to: recompute activations (gradient checkpointing) only when keeping them does not fit.

Activation memory is measured, not modelled: a probe forward pass at two sequence lengths, under
the trainer's own precision, counts the bytes autograd saves for backward (`saved_tensors_hooks`),
once with recompute and once without. The difference between the two lengths is the cost of a
token; what stays is the per-forward cost that does not grow with tokens (autocast's bf16 weight
copies). Whatever the model, attention implementation or dtype, the count is what backward will
hold.

Shapes: P = parameters, T = tokens of one micro-batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from tandem.rl.logprobs import head_chunk_rows

GIB = 1 << 30


@dataclass(frozen=True)
class ActivationCost:
    """Bytes autograd keeps for backward: `per_token` x tokens + `fixed`, per forward pass."""

    per_token: float
    fixed: float

    def bytes_for(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens


def measure_activations(model: torch.nn.Module, precision=contextlib.nullcontext,
                        lengths: tuple[int, int] = (32, 64)) -> ActivationCost:
    """Saved-for-backward bytes of one forward pass of `model` (a HF causal LM, in its current
    gradient-checkpointing state) under the `precision` context, as a line in the token count.
    Parameters themselves are not counted (they are resident anyway); tensors saved twice count once.
    """
    params = {p.data_ptr() for p in model.parameters()}
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    sizes = []
    was_training = model.training
    model.train()
    try:
        for n in lengths:
            seen: dict[tuple[int, int], int] = {}  # storage -> bytes: a tensor saved twice counts once

            def pack(t: torch.Tensor, seen=seen) -> torch.Tensor:
                if t.device == device and t.data_ptr() not in params:
                    storage = t.untyped_storage()
                    seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
                return t

            ids = torch.randint(0, vocab, (1, n), device=device)
            with torch.enable_grad(), precision(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
            del hidden
            sizes.append(sum(seen.values()))
    finally:
        model.train(was_training)
    (n0, n1), (b0, b1) = lengths, sizes
    per_token = (b1 - b0) / (n1 - n0)
    return ActivationCost(per_token=per_token, fixed=max(0.0, b0 - per_token * n0))


@dataclass
class TrainMemoryPlan:
    """The training phase's memory, in bytes, and whether it fits with or without recompute.

    `resident` is what the device holds when the phase starts (the trainer's weights, the engine
    asleep: `trainer_weights` of it are the trainer's); `gradients` and `optimizer_state` come at
    the first backward and the first optimizer step; the activations and the head's workspace
    come and go with each micro-batch. All of it must fit in `free` (what the device can still
    hand out when the phase starts) times `margin`."""

    tokens_per_micro_batch: int
    keep: ActivationCost  # activations kept (no recompute)
    recompute: ActivationCost  # with gradient checkpointing
    num_layers: int  # backward rematerialises one layer's activations at a time
    head_workspace: int  # the fused log-prob head's fp32 logits chunk, forward and backward
    free: int
    resident: int = 0
    trainer_weights: int = 0
    gradients: int = 0
    optimizer_state: int = 0  # still to be allocated (0 once the optimizer has state)
    margin: float = 0.9  # fragmentation and the allocator's rounding

    def need(self, recompute: bool) -> int:
        T = self.tokens_per_micro_batch
        act = self.keep.bytes_for(T)
        if recompute:
            act = self.recompute.bytes_for(T) + (act - self.recompute.bytes_for(T)) / self.num_layers
        return int(act + self.head_workspace)

    @property
    def budget(self) -> float:
        """What the activations may take: the free memory, less what the first step allocates."""
        return self.margin * self.free - self.gradients - self.optimizer_state

    def peak(self, recompute: bool) -> int:
        """The phase's predicted peak allocation, the resident memory included."""
        return self.resident + self.gradients + self.optimizer_state + self.need(recompute)

    def choose_recompute(self) -> tuple[bool, str]:
        """(recompute?, why) — recompute only when keeping the activations does not fit."""
        keep, redo = self.need(False), self.need(True)
        budget = self.budget
        if keep <= budget:
            return False, (f"activations {keep / GIB:.1f} GiB fit in {budget / GIB:.1f} GiB free: "
                           "no recompute")
        if redo <= budget:
            return True, (f"activations {keep / GIB:.1f} GiB exceed {budget / GIB:.1f} GiB free; "
                          f"with recompute {redo / GIB:.1f} GiB")
        raise ValueError(
            f"the training phase needs {redo / GIB:.1f} GiB even with gradient checkpointing "
            f"({self.tokens_per_micro_batch} tokens a micro-batch) but {budget / GIB:.1f} GiB are "
            "free; lower per_device_train_batch_size or max_completion_length, or lower "
            "vllm_gpu_memory_utilization so the engine holds less")

    def format(self) -> str:
        def g(b: float) -> str:
            return f"{b / GIB:7.2f} GiB"

        rows = [("resident at the phase's start", g(self.resident)),
                ("  of which the trainer's weights", g(self.trainer_weights)),
                ("gradients", g(self.gradients)),
                ("optimizer state, still to come", g(self.optimizer_state)),
                (f"activations, kept ({self.tokens_per_micro_batch:,} tokens)", g(self.need(False))),
                ("activations, recomputed", g(self.need(True))),
                ("  of either, the log-prob head", g(self.head_workspace)),
                ("free at the phase's start", g(self.free)),
                ("predicted peak, kept / recomputed", f"{g(self.peak(False))} / {g(self.peak(True)).strip()}")]
        return "\n".join(f"  {k:<42s} {v}" for k, v in rows)


def free_memory(device: torch.device) -> int:
    """Bytes the device can still hand out: CUDA's free memory plus what torch's caching allocator
    holds unused; on a CPU, the host's available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    import os

    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def set_recompute(model: torch.nn.Module, on: bool) -> None:
    """Non-reentrant activation checkpointing of every decoder layer on or off, by transformers'
    current name where it has one (5.2x) and its older one before."""
    if on:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    elif is_recomputing(model):
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()


def is_recomputing(model: torch.nn.Module) -> bool:
    flag = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(getattr(model, flag, False))


def head_workspace_bytes(vocab: int, chunk_rows: int) -> int:
    """The fused head keeps about three fp32 [chunk, V] buffers alive at once (logits, the
    filter's or softmax's output, the gradient)."""
    return 3 * 4 * vocab * chunk_rows


def plan_training_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, args, device: torch.device,
                         bf16: bool, sharded: bool) -> tuple[TrainMemoryPlan | None, bool, str]:
    """(plan, recompute?, why) for a GRPOConfig's micro-batches, probed now: at the first training
    phase, the engine asleep and the weights resident, with the gradients and the optimizer state
    still to come. Recompute is switched on the model as chosen. FSDP shards cannot run the
    probe (their root is gathered only inside the model's own forward): they recompute."""
    if sharded:
        set_recompute(model, True)
        return None, True, "FSDP shards are not probed: gradient checkpointing on"
    trainable = [p for p in model.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable if p.grad is None)
    states = 2 if isinstance(optimizer, torch.optim.AdamW | torch.optim.Adam) else 1
    optim_bytes = 0 if optimizer.state else states * sum(p.numel() * 4 for p in trainable)
    precision = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    set_recompute(model, False)
    keep = measure_activations(model, precision)
    set_recompute(model, True)
    redo = measure_activations(model, precision)
    vocab = model.get_output_embeddings().weight.shape[0]
    plan = TrainMemoryPlan(
        tokens_per_micro_batch=args.per_device_train_batch_size
        * ((args.max_prompt_length or 512) + args.max_completion_length),
        keep=keep, recompute=redo, num_layers=model.config.num_hidden_layers,
        head_workspace=head_workspace_bytes(vocab, head_chunk_rows(vocab)), free=free_memory(device),
        resident=torch.cuda.memory_allocated(device) if device.type == "cuda" else 0,
        trainer_weights=sum(p.numel() * p.element_size() for p in model.parameters()),
        gradients=grad_bytes, optimizer_state=optim_bytes)
    recompute, why = plan.choose_recompute()
    set_recompute(model, recompute)
    return plan, recompute, why
