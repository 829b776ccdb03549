"""Sleep, wake and in-place weight updates: what lets the engine share a GPU with a trainer.

A mixin of LLMEngine, kept apart because it is one concept: the engine's memory lifecycle.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from tandem.models.loader import load_weights

_TAGS = ("weights", "kv_cache")


class ColocationMixin:
    sleep_level: int = 0  # 0: awake
    weights_version: int = 0  # bumped by every weight update; a trainer can assert it moved
    weights_valid: bool = True  # False after sleep(level=2) until new weights are loaded

    def _check_awake(self) -> None:
        if self.sleep_level:
            raise ValueError("the engine is asleep; call wake_up() before generating")
        if not self.weights_valid:
            raise ValueError(
                "the engine's weights were released by sleep(level=2) and not loaded since; call "
                "update_weights_from_model() or load_weights() before generating"
            )

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def sleep(self, level: int = 1) -> dict:
        """Level 1: weights to pinned host memory, KV cache freed. Level 2: both freed."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep() needs the engine built with enable_sleep_mode=True")
        if self.sleep_level:
            return {"already_sleeping": True}
        if self.has_unfinished_requests():
            raise ValueError(f"cannot sleep with {len(self.requests)} requests in flight; abort them first")
        self.drain()  # nothing may still be running on the memory about to go
        t0 = time.perf_counter()
        free_before = _free_bytes(self.device)  # synchronises: no kernel touches the KV cache now
        if level == 1:
            self.weight_store.start_copy_out()  # the copy engine copies while the KV cache goes
        self.model_runner.release_kv_cache(sync=False)
        self.weight_store.release(keep_copy=level == 1)
        if level == 2:
            self.weights_valid = False  # generation refuses until new weights are loaded
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.sleep_level = level
        freed = _free_bytes(self.device) - free_before if free_before is not None else None
        return {"seconds": time.perf_counter() - t0, "freed_bytes": freed}

    def wake_up(self, tags: list[str] | None = None) -> dict:
        """Bring back the weights and/or the KV cache; the prefix cache starts empty."""
        tags = list(_TAGS) if tags is None else list(tags)
        bad = [t for t in tags if t not in _TAGS]
        if bad:
            raise ValueError(f"tags must be a subset of {list(_TAGS)}, got {bad}")
        t0 = time.perf_counter()
        timings = {}
        if "weights" in tags and not self.weight_store.resident:
            # the weights' host-to-device copy runs while the host maps the KV cache below
            if not self.weight_store.restore(sync=False):
                self.weights_valid = False
            timings["weights_s"] = time.perf_counter() - t0  # to map and queue the copy
        if "kv_cache" in tags and not self.model_runner.kv_store.resident:
            t1 = time.perf_counter()
            self.model_runner.restore_kv_cache()
            t2 = time.perf_counter()
            self.block_manager.reset_prefix_cache()
            timings["kv_cache_s"] = time.perf_counter() - t1
            timings["kv_cache_map_s"] = t2 - t1  # the rest: forgetting the prefix cache
            buffer = self.model_runner.kv_store.buffer
            if buffer is not None:  # the driver calls inside the mapping
                timings.update({f"kv_cache_{k}_s": v for k, v in buffer.last_map_s.items()})
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the weights are in place when wake_up returns
        recaptured = False
        if self.weight_store.resident and self.model_runner.kv_store.resident:
            self.sleep_level = 0
            if self._graphs_need_recapture():
                self.cudagraph_capture_s = self.model_runner.capture_cudagraphs(self.max_model_len)
                recaptured = True
        return {"seconds": time.perf_counter() - t0, "recaptured_graphs": recaptured, **timings}

    def _graphs_need_recapture(self) -> bool:
        stable = self.weight_store.buffer is not None and self.model_runner.kv_store.stable_address
        return self.model_runner.graph_runner is not None and not stable

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the engine in place (merging q/k/v and gate/up).

        Works while asleep: the weights are woken first. Returns how many tensors were loaded.
        """
        if not self.weight_store.resident:
            self.wake_up(["weights"])
        loaded = load_weights(self.model, weights)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.weights_version += 1
        if not self.weights_valid:
            missing = set(n for n, _ in self.model.named_parameters()) - loaded
            if missing:
                raise ValueError(f"after sleep(level=2) every weight must be loaded; missing {sorted(missing)[:5]}")
            self.weights_valid = True
        self.block_manager.reset_prefix_cache()  # cached KV came from the old weights
        return len(loaded)

    def update_weights_from_model(self, model: torch.nn.Module) -> int:
        """Copy a trainer's HF model into the engine, device to device, never through disk."""
        def tensors():
            for name, t in model.state_dict().items():
                if hasattr(t, "full_tensor"):  # FSDP2 / DTensor shards: gather this one tensor
                    t = t.full_tensor()
                yield name, t.detach()

        return self.load_weights(tensors())

    def memory_report(self) -> dict:
        """Where the engine's memory is: weights, KV cache, CUDA graphs, other, and what is free."""
        weights = self.weight_store.nbytes if self.weight_store.resident else 0
        kv = self.model_runner.kv_store.nbytes if self.model_runner.kv_store.resident else 0
        report = {"weights_bytes": weights, "kv_cache_bytes": kv, "cuda_graphs_bytes": 0,
                  "other_bytes": None, "free_bytes": None, "sleep_level": self.sleep_level}
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            allocated = torch.cuda.memory_allocated(self.device)
            in_torch = (0 if self.weight_store.buffer is not None else weights) + (
                0 if self.model_runner.kv_store.stable_address else kv)
            graphs = self.model_runner.graph_bytes
            report.update(cuda_graphs_bytes=graphs, other_bytes=max(0, allocated - in_torch - graphs),
                          free_bytes=free, total_bytes=total)
        return report


def _free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]
