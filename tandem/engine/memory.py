"""Device, dtype and KV-cache sizing (a profiling forward pass on the GPU, a fixed space on CPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.config import EngineConfig

_DTYPE_NAMES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_device(device: str, hf_model=None) -> torch.device:
    if device == "auto":
        if hf_model is not None:
            return next(hf_model.parameters()).device
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} asked for, but no CUDA GPU is available; use 'cpu' or 'auto'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(dtype: str, hf_config, device: torch.device, hf_model=None) -> torch.dtype:
    """'auto': the in-memory model's dtype, else the checkpoint's half dtype on a GPU, fp32 on a CPU."""
    if dtype != "auto":
        return _DTYPE_NAMES[dtype]
    if hf_model is not None:
        return next(hf_model.parameters()).dtype
    if device.type == "cpu":
        return torch.float32
    cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(cfg, str):
        cfg = _DTYPE_NAMES.get(cfg)
    return cfg if cfg in (torch.float16, torch.bfloat16) else torch.bfloat16


def determine_num_blocks(
    config: "EngineConfig", model: torch.nn.Module, block_bytes: int, device: torch.device, max_model_len: int,
) -> tuple[int, dict | None]:
    """How many KV blocks to allocate, and what the profiling pass measured (None without one)."""
    blocks_per_seq = -(-max_model_len // config.block_size)
    profile = None
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
    elif config.kv_cache_memory_bytes is not None and device.type != "cuda":
        num_blocks = config.kv_cache_memory_bytes // block_bytes
    elif device.type == "cuda":
        num_blocks, profile = _profile_gpu_blocks(config, model, block_bytes, device, max_model_len)
    else:
        space = int(config.cpu_kv_cache_space_gib * (1 << 30))
        # No point holding more than max_num_seqs full-length sequences.
        num_blocks = min(space // block_bytes, config.max_num_seqs * blocks_per_seq + 1)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"the KV cache ({num_blocks} blocks of {config.block_size} tokens) cannot hold one "
            f"sequence of max_model_len={max_model_len} tokens; lower max_model_len to at most "
            f"{num_blocks * config.block_size} or give the cache more memory "
            "(gpu_memory_utilization / kv_cache_memory_bytes / cpu_kv_cache_space_gib / "
            "num_gpu_blocks_override)"
        )
    return num_blocks, profile


@torch.inference_mode()
def profile_run(config: "EngineConfig", model: torch.nn.Module, device: torch.device, max_model_len: int) -> None:
    """A forward pass at the largest batch the scheduler can form, plus sampling at max_num_seqs."""
    num_tokens = min(config.max_num_batched_tokens, max_model_len * config.max_num_seqs)
    chunk = min(num_tokens, max_model_len)
    hidden = None
    done = 0
    while done < num_tokens:  # sequences of up to max_model_len tokens, no cache yet
        n = min(chunk, num_tokens - done)
        ids = torch.zeros(n, dtype=torch.long, device=device)
        hidden = model(ids, torch.arange(n, device=device))
        done += n
    rows = min(config.max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[-1:].expand(rows, -1).contiguous()).float()
    torch.log_softmax(logits, dim=-1).topk(20, dim=-1)
    logits.sort(dim=-1)
    del logits, hidden


def _profile_gpu_blocks(
    config: "EngineConfig", model: torch.nn.Module, block_bytes: int, device: torch.device, max_model_len: int,
) -> tuple[int, dict]:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    profile_run(config, model, device, max_model_len)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # CUDA graphs keep the activations of their largest batch (max_num_seqs decode rows and its
    # logits) for good, beside the transient prefill peak: reserve the profiled peak for them too,
    # an upper bound that costs a percent or two of the cache.
    graphs = activation_peak if not config.enforce_eager else 0
    budget = total * config.gpu_memory_utilization - weights - activation_peak - graphs
    if config.kv_cache_memory_bytes is not None:  # sized by the caller (vLLM's kv_cache_memory_bytes)
        budget = config.kv_cache_memory_bytes
    # Never plan on more than is free now (a colocated trainer or a peer model holds the rest).
    kv_bytes = min(budget, free - activation_peak - graphs - (256 << 20))
    profile = {"weights_bytes": weights, "activation_peak_bytes": activation_peak,
               "cudagraph_reserve_bytes": graphs, "kv_cache_bytes": max(0, int(kv_bytes))}
    return max(0, int(kv_bytes // block_bytes)), profile
