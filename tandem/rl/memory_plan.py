"""The memory plan: for a model (its config: `model_sizes.py`), a GRPOConfig and a device, the bytes
each phase of a colocated step holds, and the choices that make it fit, made before the model loads.

A step has three peaks. Generate: the trainer's weights and optimizer state stay resident while
the engine's weights, KV cache, activations and CUDA graphs are awake (the gradients were freed by
`zero_grad`). Train: the engine sleeps (level 1 and 2 both release its weights and KV cache on the
device; level 1 keeps a copy in pinned host memory) or stays awake, and the gradients, one micro-batch's
activations, backward's workspace and the log-prob head's come on top. Optimizer step: the
gradients and the step's own temporaries.

Choices, fastest first, where the config leaves them open: keep activations or recompute them
(`gradient_checkpointing=None`); the engine awake through training or asleep
(`vllm_enable_sleep_mode=None`: awake spares each step the release and re-mapping of its weights
and KV cache, where they fit beside the train phase); the optimizer state on the device or in host memory
(`optim_offload=None`); the KV cache sized to what one round needs and what the generate phase
leaves (`vllm_gpu_memory_utilization="auto"`). Choices that change the arithmetic (an 8-bit or
4-bit optimizer, a smaller micro-batch, LoRA) are the user's: a plan that does not fit is refused
with the smallest of them that would.

The device's capacity is what it can hand out when the trainer starts (`free_memory`), or
`TANDEM_MEMORY_BUDGET_GIB` where set (a smaller share of a GPU, or a what-if: `bench rl
--plan-only`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from tandem.rl import optim as optim_mod
from tandem.rl.model_sizes import ModelSizes
from tandem.rl.offload import staging_bytes

GIB = 1 << 30
BUDGET_ENV = "TANDEM_MEMORY_BUDGET_GIB"
# what a CUDA process holds beyond tensors (cuBLAS workspaces, kernels) and the allocator's rounding
CUDA_RESERVE, RESERVE_SHARE = 1 * GIB, 0.02


@dataclass(frozen=True)
class Workload:
    """What the plan reads of a GRPOConfig and the colocated engine's settings (`from_config`)."""

    rows: int  # completions a micro-batch
    row_len: int  # prompt + completion tokens of a row, at most
    completion_len: int
    round_seqs: int  # sequences the engine holds at once in a round
    bf16: bool
    reference: bool  # a reference model (beta > 0, full fine-tune)
    peft: bool
    padding_free: bool = False
    engine_len: int = 0  # the engine's max_model_len (0: row_len): its cache holds one at least
    colocated: bool = True
    sleep_level: int | None = 2  # the level it sleeps at while training; None: never asleep
    sleep_auto: bool = False  # vllm_enable_sleep_mode=None: the plan may keep it awake instead
    kv: float | str = "auto"  # vllm_gpu_memory_utilization
    kv_bytes: int | None = None  # the engine's KV cache fixed by the caller (engine kwargs) ...
    kv_blocks: int | None = None  # ... in bytes or in blocks
    kv_by_engine_args: bool = False
    gradient_checkpointing: bool | None = None
    optim: str = "adamw_torch_fused"
    optim_offload: bool | None = None
    weight_decay: float = 0.0
    shards: int = 1  # FSDP ranks (1: a full replica)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    cuda_graphs: bool = True
    cudagraph_tokens: int = 4096
    cpu_kv_cache_space: int = 4 * GIB

    @property
    def tokens(self) -> int:
        return self.rows * self.row_len

    @classmethod
    def from_config(
        cls, a, bf16: bool, peft: bool = False, engine: dict | None = None, shards: int = 1
    ) -> Workload:
        from tandem.config import EngineConfig

        e = {
            **{
                k: getattr(EngineConfig, k)
                for k in (
                    "max_num_seqs",
                    "max_num_batched_tokens",
                    "block_size",
                    "enforce_eager",
                    "max_cudagraph_capture_size",
                    "cpu_kv_cache_space_gib",
                )
            },
            **(engine or {}),
        }
        row_len = (a.max_prompt_length or 512) + a.max_completion_length
        given = engine or {}
        kv, kv_bytes = a.vllm_gpu_memory_utilization, given.get("kv_cache_memory_bytes")
        if (
            "gpu_memory_utilization" in given or "cpu_kv_cache_space_gib" in given
        ):  # the engine sizes it
            kv = given.get(
                "gpu_memory_utilization",
                kv if kv != "auto" else EngineConfig.gpu_memory_utilization,
            )
        rows = a.per_device_train_batch_size
        if a.max_tokens_per_micro_batch:  # a packed micro-batch of up to that many tokens: as many rows' worth
            rows = max(1, -(-a.max_tokens_per_micro_batch // row_len))
        return cls(
            rows=rows,
            row_len=row_len,
            engine_len=a.vllm_max_model_length or row_len,
            completion_len=a.max_completion_length,
            round_seqs=min(e["max_num_seqs"], a.generation_batch_size),
            bf16=bf16,
            reference=a.beta != 0.0 and not peft,
            peft=peft,
            padding_free=a.padding_free,
            colocated=a.vllm_mode == "colocate",
            sleep_level=a.engine_sleep_level if a.vllm_enable_sleep_mode is not False else None,
            sleep_auto=a.vllm_enable_sleep_mode is None and a.vllm_mode == "colocate",
            kv=kv,
            kv_bytes=kv_bytes,
            kv_blocks=given.get("num_gpu_blocks_override"),
            kv_by_engine_args=kv_bytes is not None or "num_gpu_blocks_override" in given,
            gradient_checkpointing=a.gradient_checkpointing,
            optim=a.optim,
            optim_offload=a.optim_offload,
            weight_decay=a.weight_decay,
            shards=shards,
            max_num_seqs=e["max_num_seqs"],
            max_num_batched_tokens=e["max_num_batched_tokens"],
            block_size=e["block_size"],
            cuda_graphs=not e["enforce_eager"],
            cudagraph_tokens=e["max_cudagraph_capture_size"],
            cpu_kv_cache_space=int(e["cpu_kv_cache_space_gib"] * GIB),
        )


@dataclass(frozen=True)
class Device:
    type: str  # "cuda" or "cpu"
    capacity: int  # bytes the process may use
    host: int  # host memory available (offload, sleep level 1's weight copy)
    total: int  # the device's size, as gpu_memory_utilization reads it
    budget_from_env: bool = False

    @property
    def usable(self) -> int:
        reserve = (CUDA_RESERVE if self.type == "cuda" else 0) + RESERVE_SHARE * self.capacity
        return int(self.capacity - reserve)


@dataclass
class MemoryPlan:
    """One configuration's bytes per phase (`rows`: name -> (generate, train, optimizer step),
    None where the phase does not hold it) and the choices behind them."""

    sizes: ModelSizes
    work: Workload
    device: Device
    recompute: bool
    offload: bool
    optim: str
    kv_cache_bytes: int
    sleep_level: int | None = None  # the engine's while training (None: awake)
    rows: dict[str, tuple[int | None, int | None, int | None]] = field(default_factory=dict)
    host_rows: dict[str, int] = field(default_factory=dict)
    activations_kept: int = 0  # saved for backward without recompute
    activations_recomputed: int = 0  # with: the layers' inputs
    backward_parts: dict[str, int] = field(default_factory=dict)  # the candidates for its peak
    measured: bool = False  # activations from the probe (`activations.measure_activations`) ...
    costs: tuple | None = None  # ... (kept, recomputed) ActivationCosts
    why: list[str] = field(default_factory=list)

    def totals(self) -> tuple[int, int, int]:
        return tuple(sum(r[i] or 0 for r in self.rows.values()) for i in range(3))  # type: ignore[return-value]

    @property
    def peak(self) -> int:
        return max(self.totals())

    @property
    def host_total(self) -> int:
        return sum(self.host_rows.values())

    @property
    def fits(self) -> bool:
        return (
            self.peak <= self.device.usable and self.host_total <= self.device.host and self.kv_ok
        )

    @property
    def kv_ok(self) -> bool:
        """The engine refuses a cache that cannot hold one sequence of max_model_len."""
        return (
            not self.work.colocated
            or self.kv_cache_bytes >= self.kv_block_bytes * self.engine_blocks_per_seq
        )

    @property
    def kv_block_bytes(self) -> int:
        return self.sizes.kv_bytes_per_token(2 if self.work.bf16 else 4) * self.work.block_size

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.work.row_len // self.work.block_size)

    @property
    def engine_blocks_per_seq(self) -> int:
        return -(-(self.work.engine_len or self.work.row_len) // self.work.block_size)

    def format(self, title: str = "") -> str:
        from tandem.rl.memory_table import format_plan

        return format_plan(self, title)


def device_of(device: torch.device, resident: int = 0) -> Device:
    """The capacity the plan assumes for `device`: TANDEM_MEMORY_BUDGET_GIB, else what it can hand
    out now plus `resident` (bytes of the model already on it)."""
    env = os.environ.get(BUDGET_ENV)
    if env:
        try:
            budget = int(float(env) * GIB)
        except ValueError:
            raise ValueError(
                f"{BUDGET_ENV}={env!r}: give the device's budget in GiB, e.g. 139.8"
            ) from None
        if budget <= 0:
            raise ValueError(f"{BUDGET_ENV}={env!r} must be > 0 GiB")
        return Device(device.type, budget, host_available(), budget, budget_from_env=True)
    total = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else free_memory(device)
    return Device(device.type, free_memory(device) + resident, host_available(), total)


def free_memory(device: torch.device) -> int:
    """Bytes the device can still hand out: CUDA's free memory plus what torch's caching allocator
    holds unused; on a CPU, the host's available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return host_available()


def host_available() -> int:
    """The host's available memory (MemAvailable: free plus reclaimable caches)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def plan_memory(
    sizes: ModelSizes, work: Workload, device: Device, activations: tuple | None = None
) -> MemoryPlan:
    """The first plan that fits, trying the open choices least intrusive first; where none fits,
    the plan of the most frugal of them (`fits` False). `activations`: measured (kept, recomputed)
    `ActivationCost`s replacing the formula's."""
    recompute = (
        [False, True] if work.gradient_checkpointing is None else [work.gradient_checkpointing]
    )
    can_offload = work.optim in optim_mod.ADAMW_32BIT and work.shards == 1 and not work.peft
    offload = (
        [False, True] if work.optim_offload is None and can_offload else [bool(work.optim_offload)]
    )
    auto = work.sleep_auto and work.sleep_level is not None
    plan = None
    for off in offload:
        for rc in recompute:
            plan = _plan(sizes, work, device, rc, off, activations, work.sleep_level)
            if auto:  # awake only where the KV cache need not shrink for it
                awake = _plan(sizes, work, device, rc, off, activations, None)
                if awake.fits and awake.kv_cache_bytes >= plan.kv_cache_bytes:
                    return awake
            if plan.fits:
                return plan
    return plan  # type: ignore[return-value]


def _plan(
    sizes: ModelSizes,
    w: Workload,
    dev: Device,
    recompute: bool,
    offload: bool,
    measured: tuple | None,
    sleep_level: int | None,
) -> MemoryPlan:
    from tandem.rl.logprobs import head_chunk_rows

    cuda = dev.type == "cuda"
    P, Pt, S = sizes.num_params, sizes.num_trainable, w.shards
    numels = list(sizes.trainable_numels)
    engine_elem = 2 if w.bf16 else 4
    plan = MemoryPlan(
        sizes, w, dev, recompute, offload, w.optim, 0, sleep_level,
        measured=measured is not None, costs=measured,
    )
    weights = 4 * P // S + (4 * P // S if w.reference else 0)
    state = 0 if offload else optim_mod.state_bytes(w.optim, numels) // S
    grads = 4 * Pt // S
    temps = 0 if offload else optim_mod.step_temporaries(w.optim, numels, cuda, w.weight_decay) // S
    keep_cost, redo_cost = measured or (
        sizes.activations(w.bf16, False, not w.padding_free),
        sizes.activations(w.bf16, True),
    )
    T, L = w.tokens, w.row_len
    one_layer = sizes.one_layer(w.bf16)
    if measured:  # the probe's kept line, less what is outside the layers, spread over them
        outside = (
            sizes.activations(w.bf16, False).per_token - sizes.num_layers * one_layer.per_token
        )
        one_layer = type(one_layer)(
            (keep_cost.per_token - outside) / sizes.num_layers,
            keep_cost.fixed / sizes.num_layers,
            keep_cost.per_row_sq / sizes.num_layers,
        )
    kept, redone = int(keep_cost.bytes_for(T, L)), int(redo_cost.bytes_for(T, L))
    plan.activations_kept, plan.activations_recomputed = kept, redone
    # Backward starts with the head (every saved activation still held), then walks the layers
    # down, freeing each one's activations as it goes: its peak is the larger of the two.
    layer = int(sizes.backward_workspace(w.bf16).bytes_for(T)) + (
        int(one_layer.bytes_for(T, L)) if recompute else 0
    )
    N = w.rows * w.completion_len  # tokens the head scores
    C, V, D = min(N, head_chunk_rows(sizes.vocab)), sizes.vocab, sizes.hidden
    # fp32 [C, V] chunks, the head's weight in the compute dtype, its fp32 gradient before it is
    # added into .grad, and the scored hidden states with their gradient
    head = 12 * V * C + (2 * V * D if w.bf16 else 0) + 4 * V * D + (engine_elem + 4) * N * D
    plan.backward_parts = {"the head's": head, "a layer's": layer}
    backward = max(head, layer)
    saved = redone if recompute else kept
    engine_weights = engine_elem * (P - (Pt if w.peft else 0)) if w.colocated else 0
    engine_act = (
        _engine_activations(sizes, w, engine_elem, w.max_num_batched_tokens) if w.colocated else 0
    )
    graphs = (
        _engine_activations(
            sizes, w, engine_elem, min(w.cudagraph_tokens, w.max_num_batched_tokens), logits=False
        )
        if w.colocated and cuda and w.cuda_graphs
        else 0
    )
    awake = sleep_level is None
    trainer = {
        "trainer weights": (weights, weights, weights),
        "optimizer state": (state, state, state),
        "gradients": (None, grads, grads),
        "optimizer step temporaries": (None, None, temps),
        "activations": (None, saved, None),
        "backward workspace": (None, backward, None),
    }
    rest_generate = weights + state + engine_weights + engine_act + graphs
    rest_train = weights + state + grads + graphs + max(saved + backward, temps)
    # awake while training, the KV cache shares the train phase: leave room for the probe's
    # correction of the formula's activations (measured once the model is loaded)
    slack = int(0.05 * (saved + backward)) if awake and measured is None else 0
    room = dev.usable - max(rest_generate, rest_train + engine_weights + slack if awake else 0)
    plan.kv_cache_bytes = (
        _kv_bytes(plan, w, dev, engine_weights, engine_act, graphs, room) if w.colocated else 0
    )
    kv = plan.kv_cache_bytes
    plan.rows = {
        **trainer,
        "engine weights": (
            engine_weights,
            engine_weights if awake else None,
            engine_weights if awake else None,
        ),
        "KV cache": (kv, kv if awake else None, kv if awake else None),
        "engine activations": (engine_act, None, None),
        "CUDA graphs": (graphs, graphs, graphs),
    }
    if offload:
        plan.host_rows["optimizer state (offloaded)"] = optim_mod.state_bytes("adamw_torch", numels)
        plan.host_rows["offload staging"] = staging_bytes(numels)
    if w.colocated and sleep_level == 1:
        plan.host_rows["engine weights (sleep level 1 copy)"] = engine_weights
    plan.why = _reasons(plan, kept, redone)
    return plan


def _engine_activations(
    sizes: ModelSizes, w: Workload, elem: int, tokens: int, logits: bool = True
) -> int:
    """The engine's largest forward (its profiling pass: `tandem.engine.memory.profile_run`):
    hidden and residual states, q/k/v, the MLP's gate/up and product, then (`logits`) the
    sampler's fp32 logits, log-softmax and sort (values and int64 indices) for its largest batch
    of rows. The CUDA graphs' pool holds the largest captured forward without the logits (the
    graphs end at the hidden states: `tandem.engine.cuda_graph`)."""
    N = min(tokens, (w.engine_len or w.row_len) * w.max_num_seqs)
    D, I, H, K, E = (
        sizes.hidden,
        sizes.intermediate,
        sizes.num_heads,
        sizes.num_kv_heads,
        sizes.head_dim,
    )
    forward = N * elem * (4 * D + (H + 2 * K) * E + 3 * I)
    rows = min(w.max_num_seqs, N)
    return int(forward + (20 * rows * sizes.vocab if logits else 0))


def _kv_bytes(
    plan: MemoryPlan,
    w: Workload,
    dev: Device,
    engine_weights: int,
    engine_act: int,
    graphs: int,
    room: int,
) -> int:
    """ "auto": one round's sequences at full length, or what the generate phase leaves if less.
    A share (vllm_gpu_memory_utilization): what the engine itself will size, `tandem.engine.memory`."""
    block = plan.kv_block_bytes
    need = (w.round_seqs * plan.blocks_per_seq + 1) * block
    if w.kv_blocks is not None:
        return w.kv_blocks * block
    if w.kv_bytes is not None:
        return w.kv_bytes // block * block
    if w.kv == "auto":
        return max(0, min(need, room) // block * block)
    if dev.type == "cpu":
        return (
            min(w.cpu_kv_cache_space // block, w.max_num_seqs * plan.engine_blocks_per_seq + 1)
            * block
        )
    share = float(w.kv) * dev.total - engine_weights - engine_act - graphs
    return max(0, int(share) // block * block)


def size(b: float) -> str:
    """Bytes for people: GiB, or MiB below one GiB."""
    return f"{b / GIB:.2f} GiB" if abs(b) >= GIB else f"{b / (1 << 20):.2f} MiB"


def _reasons(plan: MemoryPlan, kept: int, redone: int) -> list[str]:
    w, usable = plan.work, plan.device.usable
    out = []
    if w.gradient_checkpointing is None:
        out.append(
            f"recompute {'on' if plan.recompute else 'off'}: activations kept {size(kept)} "
            + ("do not fit" if plan.recompute else "fit")
            + f" (recomputed {size(redone)})"
        )
    else:
        out.append(
            f"recompute {'on' if plan.recompute else 'off'}: gradient_checkpointing={w.gradient_checkpointing}"
        )
    where = "in host memory" if plan.offload else "on the device"
    forced = (
        "optim_offload=" + str(w.optim_offload)
        if w.optim_offload is not None
        else ("the device's does not fit" if plan.offload else "it fits")
    )
    out.append(f"optimizer {plan.optim}, its state {where} ({forced})")
    if w.colocated:
        need = (w.round_seqs * plan.blocks_per_seq + 1) * plan.kv_block_bytes
        kv = f"{size(plan.kv_cache_bytes)} = {plan.kv_cache_bytes // plan.kv_block_bytes:,} blocks"
        if w.kv_blocks is not None or w.kv_by_engine_args:
            out.append(f"KV cache {kv} (set by the engine's arguments)")
        elif w.kv == "auto":
            short = (
                ""
                if plan.kv_cache_bytes >= need
                else (f", less than a full round's {size(need)}: sequences will wait their turn")
            )
            out.append(
                f"KV cache auto: {kv} ({w.round_seqs} sequences x {w.row_len} tokens{short})"
            )
        else:
            out.append(f"KV cache {kv} (vllm_gpu_memory_utilization={w.kv})")
    if w.colocated:
        if plan.sleep_level is None:
            why = "it fits beside the train phase" if w.sleep_auto else "vllm_enable_sleep_mode=False"
            out.append(f"engine awake through training ({why})")
        else:
            why = "awake it does not fit beside the train phase" if w.sleep_auto else "vllm_enable_sleep_mode=True"
            out.append(f"engine sleeps at level {plan.sleep_level} while training ({why})")
    name = ("generate", "train", "optimizer step")[plan.totals().index(plan.peak)]
    verdict = "fits" if plan.fits else "does NOT fit"
    out.append(f"predicted peak {size(plan.peak)} ({name}) of {size(usable)} usable: {verdict}")
    return out


class MemoryPlanError(ValueError):
    """The configuration does not fit the device; `plan` is the most frugal plan tried."""

    def __init__(self, message: str, plan: MemoryPlan):
        super().__init__(message)
        self.plan = plan
