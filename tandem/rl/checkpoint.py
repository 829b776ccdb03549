"""Training checkpoints in HF format, written atomically, rotated, and loaded for resume.

A checkpoint `output_dir/checkpoint-<step>/` holds the model (`save_pretrained`), the tokenizer,
optimizer.pt, scheduler.pt, rng_state.pt and trainer_state.json. It is written into a hidden temp
directory beside the target, marked complete last, then renamed into place: a crash mid-write
leaves only a temp directory, which `latest_checkpoint` never returns and the next save removes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

PREFIX = "checkpoint-"
COMPLETE_MARKER = "checkpoint_complete.json"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
RNG_STATE = "rng_state.pt"
_TMP_PREFIX = ".tmp-" + PREFIX
_TRASH_PREFIX = ".trash-" + PREFIX
_NAME_RE = re.compile(re.escape(PREFIX) + r"(\d+)$")


# ---- finding ----------------------------------------------------------------------------------


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / COMPLETE_MARKER).is_file()


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in output_dir, oldest step first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME_RE.fullmatch(p.name)
        if m and p.is_dir() and is_complete(p):
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def previous_run(output_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint directories of an earlier run in output_dir, complete or not."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (
        _NAME_RE.fullmatch(p.name) or p.name.startswith((_TMP_PREFIX, _TRASH_PREFIX))))


def check_fresh_output_dir(output_dir: str | os.PathLike, overwrite: bool,
                           remove: bool = True) -> None:
    """Before a fresh (not resumed) run: refuse an output_dir holding another run's checkpoints
    (it would overwrite some, keep others, and a later resume would mix the two runs), or, with
    `overwrite`, remove them and the run's logged metrics."""
    old = previous_run(output_dir)
    if not old:
        return
    if not overwrite:
        names = ", ".join(p.name for p in old[:5]) + (" ..." if len(old) > 5 else "")
        raise ValueError(
            f"output_dir {str(output_dir)!r} holds checkpoints of another run ({names}); resume "
            "it (--resume, train(resume_from_checkpoint=True)), choose another --output-dir, or "
            "pass --overwrite-output-dir to remove them"
        )
    if not remove:  # another rank does
        return
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    for name in ("metrics.jsonl", "completions.jsonl"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(Path(output_dir) / name)
    shutil.rmtree(Path(output_dir) / "tensorboard", ignore_errors=True)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


# ---- saving -----------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.copy()), pos, has_gauss, gauss)
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuplify(state["python"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy(), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x: Any) -> Any:
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    model: Any,
    *,
    tokenizer: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    trainer_state: dict[str, Any] | None = None,
    save_total_limit: int | None = None,
    model_state_dict: dict[str, torch.Tensor] | None = None,
    optimizer_state_dict: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint-<step> atomically and return its path. trainer_state must be JSON-able
    (global step, sampler position, config, ...); the global step is stored as "global_step".

    Sharded (FSDP) training passes the gathered full state dicts: the model's weights are then
    `model_state_dict` (written by `model.save_pretrained`), the optimizer's `optimizer_state_dict`.
    """
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale(root)
    target = root / f"{PREFIX}{step}"
    tmp = root / f"{_TMP_PREFIX}{step}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        model.save_pretrained(tmp, state_dict=model_state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if optimizer_state_dict is None and optimizer is not None:
            optimizer_state_dict = optimizer.state_dict()
        if optimizer_state_dict is not None:
            torch.save(optimizer_state_dict, tmp / OPTIMIZER)
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / SCHEDULER)
        torch.save(rng_state(), tmp / RNG_STATE)
        state = dict(trainer_state or {}, global_step=step)
        _write_json(tmp / TRAINER_STATE, state)
        _fsync_tree(tmp)
        _write_json(tmp / COMPLETE_MARKER, {"step": step, "time": time.time()})
        _fsync_dir(tmp)
        if target.exists():  # re-saving a step (e.g. after resume): set the old one aside first
            target.rename(root / f"{_TRASH_PREFIX}{step}-{uuid.uuid4().hex[:8]}")
        os.replace(tmp, target)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remove_stale(root)
    if save_total_limit is not None:
        rotate_checkpoints(root, save_total_limit)
    return target


def rotate_checkpoints(output_dir: str | os.PathLike, save_total_limit: int) -> list[Path]:
    """Delete all but the newest save_total_limit complete checkpoints; returns those deleted."""
    if save_total_limit < 1:
        raise ValueError(f"save_total_limit must be >= 1, got {save_total_limit}")
    old = list_checkpoints(output_dir)[:-save_total_limit]
    for p in old:
        # Rename first so a crash mid-delete never leaves a half-deleted dir that looks complete.
        trash = p.with_name(f"{_TRASH_PREFIX}{p.name[len(PREFIX) :]}-{uuid.uuid4().hex[:8]}")
        p.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    return old


def _remove_stale(root: Path) -> None:
    """Temp dirs of saves that crashed, and trash of interrupted deletes (one trainer per dir)."""
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
            if p.name.startswith(_TMP_PREFIX) and f"-{os.getpid()}-" in p.name:
                continue  # ours, in progress in another thread: leave it
            shutil.rmtree(p, ignore_errors=True)


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- loading ----------------------------------------------------------------------------------


def read_model_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A checkpoint's safetensors (single or sharded) as one state dict, on the host."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(path / name)))
    return state


def load_model_weights(path: str | os.PathLike, model: torch.nn.Module) -> None:
    """Load a checkpoint's safetensors (single or sharded) into an existing model, in place."""
    state = read_model_weights(path)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise RuntimeError(f"{path}: checkpoint does not fit the model: {exc}") from exc
    # save_pretrained leaves out tied weights (lm_head tied to the embeddings): not an error.
    loaded_ptrs = {p.data_ptr() for n, p in model.state_dict().items() if n in state}
    params = model.state_dict()
    missing = [k for k in missing if params[k].data_ptr() not in loaded_ptrs]
    if missing or unexpected:
        raise RuntimeError(
            f"{path}: checkpoint does not fit the model (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]})"
        )


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    restore_rng: bool = True,
    map_location: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Restore what is given from a complete checkpoint; returns its trainer_state."""
    path = Path(path)
    if not is_complete(path):
        raise ValueError(
            f"{path} is not a complete checkpoint (no {COMPLETE_MARKER}); "
            "use latest_checkpoint(output_dir) to find one"
        )
    if model is not None:
        load_model_weights(path, model)
    if optimizer is not None:
        optimizer.load_state_dict(
            torch.load(path / OPTIMIZER, map_location=map_location, weights_only=True)
        )
    if scheduler is not None:
        scheduler.load_state_dict(
            torch.load(path / SCHEDULER, map_location=map_location, weights_only=True)
        )
    if restore_rng and (path / RNG_STATE).is_file():
        set_rng_state(torch.load(path / RNG_STATE, weights_only=True))
    return json.loads((path / TRAINER_STATE).read_text())
