"""The memory plan as people read it (a table, printed before the first step) and the measured
memory per phase beside it."""

from __future__ import annotations

from tandem.rl.memory_plan import GIB, MemoryPlan, size

PHASES = ("generate", "train", "optimizer step")


def _count(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f}"


def _labels(plan: MemoryPlan) -> dict[str, str]:
    s, w = plan.sizes, plan.work
    P, Pt = _count(s.num_params), _count(s.num_trainable)
    shard = f" / {w.shards} shards" if w.shards > 1 else ""
    ref = " + reference model" if w.reference else ""
    if plan.offload:
        state = f"optimizer state ({plan.optim}: in host memory)"
    else:
        state = f"optimizer state ({plan.optim})"
    engine = "bf16" if w.bf16 else "fp32"
    act = "recomputed" if plan.recompute else "kept"
    src = "measured" if plan.measured else "formula"
    return {
        "trainer weights": f"trainer weights (fp32, {P} params{ref}{shard})",
        "optimizer state": state,
        "gradients": f"gradients (fp32, {Pt} trainable{shard})",
        "optimizer step temporaries": "optimizer step temporaries",
        "activations": f"activations, {act} ({src}, {w.rows} x {w.row_len} tok)",
        "backward workspace": "backward workspace ("
        + " / ".join(f"{k} {size(v)}" for k, v in plan.backward_parts.items())
        + ")",
        "engine weights": f"engine weights ({engine})",
        "KV cache": f"KV cache ({plan.kv_cache_bytes // max(1, plan.kv_block_bytes):,} blocks)",
        "engine activations": "engine activations (profile pass)",
        "CUDA graphs": "CUDA graphs (kept while asleep)",
    }


def format_plan(plan: MemoryPlan, title: str = "") -> str:
    """The plan as a table: a row per holder, a column per phase (GiB), then what sleep frees and
    the choices made."""
    w, d = plan.work, plan.device
    labels = _labels(plan)
    scale, unit = (GIB, "GiB") if plan.peak >= GIB else (1 << 20, "MiB")

    def cell(b: int | None) -> str:
        return f"{'-':>9}" if b is None else f"{b / scale:9.2f}"

    src = "TANDEM_MEMORY_BUDGET_GIB" if d.budget_from_env else "free"
    precision = "bf16 autocast" if w.bf16 else "fp32"
    lines = [
        (
            f"{title or 'memory plan'}: {d.type} device {d.capacity / GIB:.2f} GiB ({src}), "
            f"{d.usable / GIB:.2f} usable; {precision}, fp32 master weights"
        ),
        f"  {unit:<56s}" + "".join(f"{p:>9s}" for p in ("generate", "train", "opt.step")),
    ]
    for name, values in plan.rows.items():
        if all(v in (None, 0) for v in values):
            continue
        lines.append(f"  {labels.get(name, name):<56s}" + "".join(cell(v) for v in values))
    lines.append(f"  {'total':<56s}" + "".join(cell(v) for v in plan.totals()))
    lines.append(
        f"  activations kept / recomputed: {plan.activations_kept / scale:.2f} / "
        f"{plan.activations_recomputed / scale:.2f} {unit}"
    )
    if w.colocated:
        freed = plan.rows["engine weights"][0] + plan.kv_cache_bytes
        if plan.sleep_level is None:
            lines.append(
                f"  the engine stays awake: its weights and KV cache, {freed / scale:.2f} {unit}, "
                "stay through training"
            )
        else:
            copy = (
                " (level 1 keeps the weights in pinned host memory)" if plan.sleep_level == 1 else ""
            )
            lines.append(
                f"  sleep level {plan.sleep_level} frees the engine's weights and KV cache, "
                f"{freed / scale:.2f} {unit}, before training{copy}"
            )
    for name, b in plan.host_rows.items():
        lines.append(f"  host: {name} {size(b)}")
    if plan.host_rows:
        lines.append(f"  host: {size(plan.host_total)} of {size(d.host)} available")
    lines += [f"  -> {why}" for why in plan.why]
    return "\n".join(lines)


def format_measured(metrics: dict) -> str:
    """Measured peaks per phase (`memory/<phase>_peak_gib`, `_reserved_gib`) beside the plan's
    totals (`memory/plan_<phase>_gib`), in GiB."""
    lines = [f"  {'GiB':<16s}{'plan':>9s}{'peak':>9s}{'reserved':>9s}{'peak/plan':>10s}"]
    for key, name in zip(("generate", "train", "optimizer_step"), PHASES):
        peak, reserved = (
            metrics.get(f"memory/{key}_peak_gib"),
            metrics.get(f"memory/{key}_reserved_gib"),
        )
        want = metrics.get(f"memory/plan_{key}_gib")
        if peak is None and want is None:
            continue

        def cell(v, width=9):
            return f"{v:{width}.2f}" if v is not None else f"{'-':>{width}s}"

        ratio = peak / want if peak is not None and want else None
        lines.append(f"  {name:<16s}{cell(want)}{cell(peak)}{cell(reserved)}{cell(ratio, 10)}")
    return "\n".join(lines)
