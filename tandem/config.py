"""EngineConfig: every engine knob in one dataclass; the CLI reads its defaults from here."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields, replace

from tandem.checks import check_bool, check_choice, check_float, check_int, check_str

_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
_LOAD_FORMATS = ("auto", "dummy", "safetensors", "pt", "gguf")
_LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
_MAX_COUNT = 2**31 - 1  # counts of sequences and tokens: beyond this is a typo, not a setting
_BOOLS = ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "enable_sleep_mode",
          "trust_remote_code", "batch_invariant", "host_only")


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
    # The KV cache's size in bytes, instead of sizing it from gpu_memory_utilization (vLLM's name):
    # a colocated trainer's memory plan knows what the optimizer state will take later.
    kv_cache_memory_bytes: int | None = None
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
    # Decode steps run back to back per scheduling round (vLLM v0's --num-scheduler-steps): the
    # host schedules, books and reads back once per window of up to this many steps, each step's
    # sampled tokens feeding the next on the device. Its cost per token (Python, a few us a
    # sequence) then no longer outruns a decode step at large batches. A window runs when every
    # sequence decodes and nothing waits to join; a sample that stops inside it has computed up
    # to num_scheduler_steps - 1 tokens for nothing, and streamed outputs come a window at a time.
    # 1: every step is scheduled. None: 4 where the device runs asynchronously to the host (CUDA;
    # on an H200 gen-1.5b's 256-row decode went from host-bound 3.17 ms a step to device-bound
    # 2.92 ms), 1 elsewhere.
    num_scheduler_steps: int | None = None
    # A window runs only while at least this many sequences decode. None: 1 offline; max_num_seqs
    # in a server (`for_serving`), so that windows run only when the batch is full, when no
    # arriving prompt could join it anyway: below that a prompt joins at the next step and tokens
    # stream one step at a time, as without windows, and at saturation the host books once a
    # window (on an H200, `bench serve`'s saturated burst went from a median 84% of offline to 89%).
    decode_window_min_seqs: int | None = None
    # Every op with a fixed per-row arithmetic (tandem.batch_invariant): a token's logits depend on
    # its sequence alone, so a trainer scoring the rollout with the same kernels gets the engine's
    # logprobs exactly. Slower; for RL parity, not serving. Process-wide once an engine turns it on.
    batch_invariant: bool = False
    # GEMMs of few rows (decode): the Triton decode GEMM where a table measured on this GPU says it
    # beats cuBLAS, cuBLAS (F.linear) for every other shape and M. "auto": this GPU's table in
    # tandem/kernels/configs where there is one, else cuBLAS alone; "triton": that table, which
    # must exist; a path: a table `python -m tandem.bench.gemm --table-out` wrote; "cublas": never.
    decode_gemm: str = "auto"
    # How structured outputs are enforced (vLLM's structured_outputs_config.backend): "auto" runs a
    # regex, choice or closed JSON schema as a token automaton stepping on the device (its rows
    # decode in windows at the cost of a free row) where it compiles to a small enough table, and
    # everything else (other JSON schemas, Lark grammars, larger patterns) through llguidance,
    # whose masks the host computes each step; "guidance" always llguidance; "fsm" only token
    # automata (others refused).
    structured_outputs_backend: str = "auto"
    # Benchmarks only: no forward and no sampling on the device; every sampled row gets one fixed
    # token and everything else (scheduling, step inputs and their copy, the read-back, stop
    # checks, outputs, streaming) runs as usual. What a run then takes is the engine's host work a
    # token, the ceiling the host sets whatever the model (`tandem bench throughput --host-only`).
    # Requests that need logits (logprobs, prompt logprobs, structured outputs) are refused.
    host_only: bool = False

    def for_serving(self) -> EngineConfig:
        """This config for an online engine: decode windows only with the batch full
        (decode_window_min_seqs None means max_num_seqs there); the caller's config is left as is."""
        if self.decode_window_min_seqs is not None:
            return self
        return replace(self, decode_window_min_seqs=self.max_num_seqs)

    def __post_init__(self) -> None:
        """Every field's type and range, before anything is built (invariant 4)."""
        self.model = check_str("model", self.model, optional=True)
        self.tokenizer = check_str("tokenizer", self.tokenizer, optional=True)
        if self.tokenizer is not None and not os.path.exists(self.tokenizer):
            raise ValueError(
                f"tokenizer: {self.tokenizer!r} is not a local directory or file; tokenizers "
                "load from local files only (no hub access)"
            )
        check_choice("dtype", self.dtype, _DTYPES)
        check_choice("load_format", self.load_format, _LOAD_FORMATS)
        check_choice("logprobs_mode", self.logprobs_mode, _LOGPROBS_MODES)
        check_choice("attention_backend", self.attention_backend, ("auto", "torch", "triton"))
        check_choice("sleep_mode_backend", self.sleep_mode_backend, ("auto", "cumem", "recapture"))
        check_choice("structured_outputs_backend", self.structured_outputs_backend,
                     ("auto", "guidance", "fsm"))
        if not (isinstance(self.decode_gemm, str) and (
                self.decode_gemm in ("auto", "cublas", "triton") or (
                self.decode_gemm.endswith(".json") and os.path.isfile(self.decode_gemm)))):
            raise ValueError(
                f"decode_gemm must be 'auto', 'cublas', 'triton' or an existing .json table (from "
                f"`python -m tandem.bench.gemm --table-out`), got {self.decode_gemm!r}")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ValueError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        self.max_model_len = check_int("max_model_len", self.max_model_len, 1, optional=True)
        self.max_num_seqs = check_int("max_num_seqs", self.max_num_seqs, 1, _MAX_COUNT)
        self.num_scheduler_steps = check_int("num_scheduler_steps", self.num_scheduler_steps, 1, 64,
                                             optional=True)
        self.decode_window_min_seqs = check_int("decode_window_min_seqs", self.decode_window_min_seqs, 1,
                                                optional=True)
        if self.decode_window_min_seqs is not None and self.decode_window_min_seqs > self.max_num_seqs:
            raise ValueError(
                f"decode_window_min_seqs ({self.decode_window_min_seqs}) must be at most max_num_seqs "
                f"({self.max_num_seqs}): no batch could reach it, so no decode window would ever run")
        self.max_num_batched_tokens = check_int(
            "max_num_batched_tokens", self.max_num_batched_tokens, 1, _MAX_COUNT
        )
        self.gpu_memory_utilization = check_float(
            "gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, lo_open=True
        )
        self.block_size = check_int("block_size", self.block_size, 1, 1024)
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"block_size must be a power of two in [1, 1024], got {self.block_size}"
            )
        for name in _BOOLS:
            check_bool(name, getattr(self, name))
        check_bool("async_scheduling", self.async_scheduling, optional=True)
        self.seed = check_int("seed", self.seed, 0, 2**63 - 1)
        self.tensor_parallel_size = check_int(
            "tensor_parallel_size", self.tensor_parallel_size, 1, 1024
        )
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ValueError(
                f"batch_invariant=True needs tensor_parallel_size=1 (got {self.tensor_parallel_size}): "
                "a sharded layer's all-reduce sums in its own order")
        self.num_gpu_blocks_override = check_int(
            "num_gpu_blocks_override", self.num_gpu_blocks_override, 1, optional=True
        )
        self.kv_cache_memory_bytes = check_int(
            "kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, optional=True
        )
        self.cpu_kv_cache_space_gib = check_float(
            "cpu_kv_cache_space_gib", self.cpu_kv_cache_space_gib, 0.0, 1e6, lo_open=True
        )
        self.max_cudagraph_capture_size = check_int(
            "max_cudagraph_capture_size", self.max_cudagraph_capture_size, 0, _MAX_COUNT
        )
        self.revision = check_str("revision", self.revision, optional=True)
        self.stream_interval = check_int("stream_interval", self.stream_interval, 1, _MAX_COUNT)
        self.max_admission_delay_steps = check_int(
            "max_admission_delay_steps", self.max_admission_delay_steps, 0, _MAX_COUNT
        )

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
