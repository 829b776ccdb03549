"""Worker: owns one engine's device state (model, weights, KV cache, CUDA graphs) and its memory
lifecycle, sleep and wake included. Nothing else builds or frees device memory.

`__init__` reads as the lifecycle, in order: build and shard the model, load its weights,
profile a forward pass to size the KV cache, allocate it, capture graphs, warm the kernels up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import torch

from tandem import batch_invariant
from tandem.checks import check_triton_device
from tandem.config import EngineConfig
from tandem.engine.cumem import vmm_available
from tandem.engine.memory import determine_num_blocks, resolve_device, resolve_dtype
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import SchedulerOutput
from tandem.engine.sleep_mode import WeightStore
from tandem.layers.sampler import SamplerOutput
from tandem.models.loader import (
    ModelSource,
    build_model,
    check_all_loaded,
    init_dummy_weights,
    load_weights,
)
from tandem.parallel.tensor_parallel import init_tensor_parallel
from tandem.weights.check import TensorSpec, check_weights, specs_of

SLEEP_TAGS = ("weights", "kv_cache")


class Worker:
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.device = resolve_device(config.device, source.hf_model)
        if config.batch_invariant:  # before the model runs anything
            batch_invariant.check_supported(self.device.type)
            batch_invariant.enable()
        self.dtype = resolve_dtype(config.dtype, source.hf_config, self.device, source.hf_model)
        self.model = build_model(source.hf_config, max_model_len, self.dtype, self.device)
        self.tp_group = init_tensor_parallel(self.model, config, self.device)  # None unless TP > 1
        self._load_initial_weights(source)
        # stable addresses (CUDA VMM): sleep unmaps and wake maps again, captured graphs stay valid
        self.use_cumem = self._use_cumem()
        self.weight_store = WeightStore(self.model, self.device, self.use_cumem)
        self.model_runner = ModelRunner(config, self.model, self.device, self.dtype)
        self.decode_gemm_layers = self._apply_decode_gemm()  # before any graph captures a GEMM
        self.attention_backend = self.model_runner.set_attention_backend(config.attention_backend)
        # what the profiling pass measured (None where nothing was profiled: CPU, fixed block count)
        self.num_blocks, self.memory_profile = determine_num_blocks(
            config, self.model, self.model_runner.kv_cache_block_bytes(), self.device, max_model_len)
        if self.tp_group is not None:  # tensor parallel: ranks schedule alike, smallest cache wins
            self.num_blocks = self.tp_group.agree_min(self.num_blocks)
        self.model_runner.allocate_kv_cache(self.num_blocks, self.use_cumem)
        triton_on_gpu = self.device.type == "cuda" and self.attention_backend == "triton"
        self.cudagraph_capture_s = None
        if triton_on_gpu and not config.enforce_eager:
            self.cudagraph_capture_s = self.model_runner.capture_cudagraphs(max_model_len)
        self.kernel_warmup_s = self.model_runner.warmup_kernels(max_model_len) if triton_on_gpu else None
        self.sleep_level = 0  # 0: awake
        self.weights_version = 0  # bumped by every weight update; a trainer can assert it moved
        self.weights_valid = True  # False after sleep(level=2) until new weights are loaded

    def _apply_decode_gemm(self) -> int:
        """Layers that run the Triton decode GEMM for some M (`EngineConfig.decode_gemm`)."""
        spec = self.config.decode_gemm
        if spec == "cublas" or (spec == "auto" and self.device.type != "cuda"):
            return 0
        check_triton_device(f"decode_gemm={spec!r}", self.device.type)
        from tandem.layers.decode_gemm import apply_decode_gemm, load_table

        return apply_decode_gemm(self.model, load_table(spec, self.device))

    def _use_cumem(self) -> bool:
        cfg = self.config
        if not cfg.enable_sleep_mode or self.device.type != "cuda" or cfg.sleep_mode_backend == "recapture":
            return False
        if not vmm_available():
            if cfg.sleep_mode_backend == "cumem":
                raise ValueError("sleep_mode_backend='cumem' needs cuda.bindings (pip install cuda-python)")
            return False
        return True

    def _load_initial_weights(self, source: ModelSource) -> None:
        if self.config.load_format == "dummy":
            init_dummy_weights(self.model, self.config.seed)
            return
        check_all_loaded(self.model, load_weights(self.model, source.weights()))

    @property
    def has_graphs(self) -> bool:
        return self.model_runner.graph_runner is not None

    # -- running ---------------------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput, prev_token_ids: torch.Tensor | None,
                      before_sampling: Callable[[], None] | None = None,
                      while_masking: Callable[[], None] | None = None) -> SamplerOutput | None:
        """Launch one step on the device; returns its sampled tokens as device tensors.
        `before_sampling` runs on the host once the forward is launched, before sampling;
        `while_masking` while the step's grammar masks are filled (if it has any)."""
        return self.model_runner.run(sched, prev_token_ids, before_sampling, while_masking)

    def check_awake(self) -> None:
        if self.sleep_level:
            raise ValueError("the engine is asleep; call wake_up() before generating")
        if not self.weights_valid:
            raise ValueError(
                "the engine's weights were released by sleep(level=2) and not loaded since; call "
                "update_weights_from_model() or load_weights() before generating"
            )

    # -- sleep and wake --------------------------------------------------------------------------
    def sleep(self, level: int) -> dict:
        """Level 1: weights to pinned host memory, KV cache freed. Level 2: both freed. The caller
        has made sure no step is still running."""
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

    def wake_up(self, tags: list[str] | None = None, on_kv_cache: Callable[[], None] | None = None) -> dict:
        """Bring back the weights and/or the KV cache. `on_kv_cache` runs once the KV cache is back
        (the engine forgets its prefix cache: the blocks' contents are gone)."""
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        bad = [t for t in tags if t not in SLEEP_TAGS]
        if bad:
            raise ValueError(f"tags must be a subset of {list(SLEEP_TAGS)}, got {bad}")
        t0 = time.perf_counter()
        timings = {}
        kv_store = self.model_runner.kv_store
        if self.device.type == "cuda" and not (self.weight_store.resident and kv_store.resident):
            # A colocated trainer's caching allocator still holds what its training phase freed;
            # the engine maps its memory outside that cache (CUDA VMM), so hand it back first.
            torch.cuda.empty_cache()
        if "weights" in tags and not self.weight_store.resident:
            # the weights' host-to-device copy runs while the host maps the KV cache below
            if not self.weight_store.restore(sync=False):
                self.weights_valid = False
            timings["weights_s"] = time.perf_counter() - t0  # to map and queue the copy
        if "kv_cache" in tags and not kv_store.resident:
            t1 = time.perf_counter()
            self.model_runner.restore_kv_cache()
            t2 = time.perf_counter()
            if on_kv_cache is not None:
                on_kv_cache()
            timings["kv_cache_s"] = time.perf_counter() - t1
            timings["kv_cache_map_s"] = t2 - t1  # the rest: forgetting the prefix cache
            if kv_store.buffer is not None:  # the driver calls inside the mapping
                timings.update({f"kv_cache_{k}_s": v for k, v in kv_store.buffer.last_map_s.items()})
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the weights are in place when wake_up returns
        recaptured = False
        if self.weight_store.resident and kv_store.resident:
            self.sleep_level = 0
            if self.has_graphs and not self.use_cumem:  # graphs point at the freed storage
                self.cudagraph_capture_s = self.model_runner.capture_cudagraphs(self.max_model_len)
                recaptured = True
        return {"seconds": time.perf_counter() - t0, "recaptured_graphs": recaptured, **timings}

    # -- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     specs: list[TensorSpec] | None = None) -> int:
        """Copy HF-named tensors into the model in place (merging q/k/v and gate/up); wakes the
        weights first when they sleep. Returns how many tensors were loaded.

        All or nothing for a collection, or an iterator with its `specs` (name, shape, dtype):
        every tensor is checked before anything is copied. A bare iterator (an FSDP trainer's
        gathered units, each valid only until the next is asked for) is checked tensor by tensor.
        """
        if not self.weight_store.resident:  # first: asleep, the parameters have no shapes
            self.wake_up(["weights"])
        if specs is None and not isinstance(weights, Iterator):  # a collection: held already
            weights = list(weights)
            specs = specs_of(weights)
        if specs is None:
            weights = _checked_one_by_one(self.model, weights)
        else:
            targets = check_weights(self.model, specs)
            missing = {n for n, _ in self.model.named_parameters()} - targets
            if not self.weights_valid and missing:
                raise ValueError(f"after sleep(level=2) every weight must be loaded; missing {sorted(missing)[:5]}")
        try:
            loaded = load_weights(self.model, weights)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        finally:  # even a copy that failed part-way has changed the weights
            self.weights_version += 1
        if not self.weights_valid:
            missing = {n for n, _ in self.model.named_parameters()} - loaded
            if missing:
                raise ValueError(f"after sleep(level=2) every weight must be loaded; missing {sorted(missing)[:5]}")
            self.weights_valid = True
        return len(loaded)

    def memory_report(self) -> dict:
        """Where the engine's memory is: weights, KV cache, CUDA graphs, other, and what is free."""
        kv_store = self.model_runner.kv_store
        weights = self.weight_store.nbytes if self.weight_store.resident else 0
        kv = kv_store.nbytes if kv_store.resident else 0
        # CUDA virtual memory (cumem) is mapped outside torch's allocator: its statistics miss it
        vmm = weights + kv if self.use_cumem else 0
        vmm_awake = self.weight_store.nbytes + kv_store.nbytes if self.use_cumem else 0
        report = {"weights_bytes": weights, "kv_cache_bytes": kv, "cuda_graphs_bytes": 0,
                  "other_bytes": None, "free_bytes": None, "sleep_level": self.sleep_level,
                  "vmm_bytes": vmm, "vmm_awake_bytes": vmm_awake}
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            allocated = torch.cuda.memory_allocated(self.device)
            in_torch = 0 if self.use_cumem else weights + kv  # VMM memory is outside torch's allocator
            graphs = self.model_runner.graph_bytes
            report.update(cuda_graphs_bytes=graphs, other_bytes=max(0, allocated - in_torch - graphs),
                          free_bytes=free, total_bytes=total)
        return report


def _checked_one_by_one(model: torch.nn.Module, weights):
    for name, t in weights:
        check_weights(model, [(name, tuple(t.shape), t.dtype)])
        yield name, t


def _free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]
