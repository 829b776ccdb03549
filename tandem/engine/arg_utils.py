"""Engine flags for every command line, generated from EngineConfig so defaults live in one place."""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing

from tandem.config import EngineConfig

_HELP = {
    "model": "local HF model dir, .gguf file, or architecture name with --load-format dummy "
    "(default: the embedded SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer dir (default: the model's)",
    "dtype": "auto (the checkpoint's half dtype on a GPU, float32 on a CPU) | float32 | float16 | "
    "bfloat16",
    "max_model_len": "context length (default: the model's)",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "most tokens in one step",
    "gpu_memory_utilization": "fraction of GPU memory this engine may use",
    "block_size": "tokens per KV-cache block",
    "enable_prefix_caching": "reuse the KV blocks of shared prompt prefixes",
    "enable_chunked_prefill": "split long prompts over several steps",
    "load_format": "auto | dummy (random weights) | safetensors | pt | gguf",
    "seed": "the engine's random seed (requests without their own seed)",
    "device": "auto (cuda when there is a GPU) | cuda | cpu",
    "tensor_parallel_size": "GPUs to shard the model over",
    "enable_sleep_mode": "allow sleep()/wake_up() (releases weights and KV cache)",
    "sleep_mode_backend": "auto | cumem (stable addresses) | recapture (reallocate, capture graphs "
    "again)",
    "num_gpu_blocks_override": "KV-cache blocks to allocate, instead of sizing them from memory",
    "kv_cache_memory_bytes": "the KV cache's size in bytes, instead of sizing it from "
    "gpu_memory_utilization",
    "cpu_kv_cache_space_gib": "KV-cache size on a CPU, at most (it never exceeds what max_num_seqs "
    "sequences of max_model_len tokens need)",
    "logprobs_mode": "raw_logprobs (the model's) | processed_logprobs (after temperature, top-k/p)",
    "trust_remote_code": "allow a model dir's own Python code",
    "revision": "model revision (accepted for vLLM compatibility; local files only)",
    "enforce_eager": "no CUDA graphs",
    "max_cudagraph_capture_size": "steps of up to this many tokens (prefill and decode mixed) replay "
    "CUDA graphs; 0: decode graphs only",
    "attention_backend": "auto | torch | triton",
    "async_scheduling": "launch each step before the previous one's tokens are read back "
    "(default: on for CUDA)",
    "stream_interval": "streamed outputs: the first token at once, then every this many tokens",
    "max_admission_delay_steps": "new prompts wait up to this many CUDA-graph decode steps to join "
    "the running batch together (0: at once)",
    "num_scheduler_steps": "decode steps run back to back per scheduling round (the host books "
    "and reads back once per window; 1: every step; None: 4 on CUDA, else 1)",
    "decode_window_min_seqs": "decode windows run only while at least this many sequences decode "
    "(None: 1 offline; max_num_seqs in `tandem serve`: windows only with the batch full)",
    "decode_gemm": "auto (the Triton GEMM where this GPU's measured table says it beats cuBLAS; "
    "cuBLAS alone on a GPU with no table) | cublas | triton (as auto; the table must exist) | a "
    "table (.json) from `python -m tandem.bench.gemm --table-out`",
    "structured_outputs_backend": "auto (regexes, choices, closed JSON schemas as token automata on the "
    "device; the rest through llguidance) | guidance (llguidance only) | fsm (token automata only)",
    "host_only": "benchmarks only: no forward or sampling, a fixed token a row; the rest of the "
    "engine as usual (its host work a token)",
    "batch_invariant": "batch-invariant kernels: a token's logits never depend on the rest of the "
    "batch (exact trainer/engine logprob parity for RL; slower)",
}
_SKIP_POSITIONAL = {"model"}


def _base_type(tp):
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_engine_args(parser: argparse.ArgumentParser, include_model: bool = True) -> None:
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP_POSITIONAL and not include_model:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = _base_type(hints[f.name])
        help_ = _HELP.get(f.name, f.name.replace("_", " "))  # the CLI's formatter adds the default
        if tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        else:
            group.add_argument(flag, type=tp, default=f.default, help=help_)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}


def check_model_arg(model: str | None, load_format: str = "auto", flag: str = "--model") -> None:
    """Refuse a model that cannot load, before anything loads: a clear line naming the flag.
    A hub id ("org/name") is left to the loader, which looks in the HF cache (or downloads)."""
    if model is None:
        return
    from tandem.models.hub import looks_like_repo_id
    from tandem.models.presets import ALIASES, PRESETS

    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ValueError(f"{flag}: GGUF file {model!r} does not exist")
        return
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"{flag}: directory {model!r} has no config.json (not an HF model dir)")
        return
    if os.path.exists(model):
        raise ValueError(f"{flag}: {model!r} is a file; give a model directory or a .gguf file")
    preset = model.lower() in PRESETS or model.lower() in ALIASES
    if preset and load_format == "dummy":
        return
    if looks_like_repo_id(model):
        return
    if preset:
        raise ValueError(
            f"{flag}: {model!r} names an architecture, not weights on disk; add "
            "--load-format dummy for random weights, or give a local model directory"
        )
    raise ValueError(
        f"{flag}: {model!r} is not a local model directory, a .gguf file, a hub id (org/name) or "
        f"an architecture name ({', '.join(PRESETS)}); e.g. `hf download "
        "HuggingFaceTB/SmolLM2-135M-Instruct --local-dir DIR`, then pass DIR"
    )
