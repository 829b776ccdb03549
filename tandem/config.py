"""EngineConfig: every engine knob in one dataclass; the CLI reads its defaults from here."""

from __future__ import annotations

from dataclasses import dataclass, fields

_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
_LOAD_FORMATS = ("auto", "dummy", "safetensors", "pt", "gguf")
_LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass
class EngineConfig:
    """Engine settings, named as vLLM names them. Checked in `__post_init__`."""

    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct)
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    load_format: str = "auto"
    seed: int = 0
    device: str = "auto"
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    enable_sleep_mode: bool = False
    sleep_mode_backend: str = "auto"  # auto | cumem (stable addresses) | recapture (realloc + graphs)
    num_gpu_blocks_override: int | None = None
    cpu_kv_cache_space_gib: float = 4.0  # KV cache size when running on a CPU (vLLM's default)
    # Steps of up to this many tokens (prefill chunks and decode rows mixed) replay CUDA graphs,
    # one per size of a token ladder; larger steps run eagerly. Decode steps have their own
    # graphs up to max_num_seqs. 0 captures decode graphs only.
    max_cudagraph_capture_size: int = 4096
    logprobs_mode: str = "raw_logprobs"
    trust_remote_code: bool = False
    revision: str | None = None  # a hub id's branch, tag or commit (tandem.models.hub)
    attention_backend: str = "auto"  # auto | torch | triton
    # Launch each step before reading back the previous one's tokens (vLLM's async scheduling):
    # None turns it on where the device runs asynchronously to the host (CUDA).
    async_scheduling: bool | None = None
    # Streamed (delta / cumulative) outputs of an unfinished request: the first token at once, then
    # every this many tokens: fewer, larger chunks cost the server less per token (vLLM's
    # stream_interval).
    stream_interval: int = 1
    # While the running batch decodes in a CUDA graph, new prompts may wait up to this many steps
    # to join it together (they join at once in a burst or when half a step's token budget
    # waits). A step that carries a prefill costs more than a decode step (more tokens, and an
    # eager launch of ~20 ms above max_cudagraph_capture_size), so under a steady stream of
    # requests admitting each on arrival makes most steps mixed. TGI's max_waiting_tokens does the
    # same. 0 (the default) admits at once; without graphs (CPU, enforce_eager) nothing waits.
    max_admission_delay_steps: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}")
        if self.logprobs_mode not in _LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {_LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}"
            )
        if self.sleep_mode_backend not in ("auto", "cumem", "recapture"):
            raise ValueError(
                f"sleep_mode_backend must be 'auto', 'cumem' or 'recapture', got {self.sleep_mode_backend!r}"
            )
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.max_cudagraph_capture_size < 0:
            raise ValueError(f"max_cudagraph_capture_size must be >= 0, got {self.max_cudagraph_capture_size}")
        if self.max_admission_delay_steps < 0:
            raise ValueError(f"max_admission_delay_steps must be >= 0, got {self.max_admission_delay_steps}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}"
            )
        if self.cpu_kv_cache_space_gib <= 0:
            raise ValueError(f"cpu_kv_cache_space_gib must be > 0, got {self.cpu_kv_cache_space_gib}")

    def check_model_len(self, max_model_len: int) -> None:
        """Called once the model's context length is known."""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({max_model_len}) unless chunked prefill is on"
            )

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; valid ones: {sorted(names)}")
        return cls(**kwargs)
