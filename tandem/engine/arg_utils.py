"""Engine flags for every command line, generated from EngineConfig so defaults live in one place."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from tandem.config import EngineConfig

_HELP = {
    "model": "local HF model dir, .gguf file, or architecture name with --load-format dummy "
    "(default: the embedded SmolLM2-135M-Instruct)",
    "dtype": "auto | float32 | float16 | bfloat16",
    "max_model_len": "context length (default: the model's)",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "most tokens in one step",
    "gpu_memory_utilization": "fraction of GPU memory this engine may use",
    "block_size": "tokens per KV-cache block",
    "load_format": "auto | dummy (random weights) | safetensors | pt | gguf",
    "enforce_eager": "no CUDA graphs",
    "max_cudagraph_capture_size": "steps of up to this many tokens (prefill and decode mixed) replay "
    "CUDA graphs; 0: decode graphs only",
    "attention_backend": "auto | torch | triton",
    "async_scheduling": "launch each step before the previous one's tokens are read back "
    "(default: on for CUDA)",
    "stream_interval": "streamed outputs: the first token at once, then every this many tokens",
    "max_admission_delay_steps": "new prompts wait up to this many CUDA-graph decode steps to join "
    "the running batch together (0: at once)",
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
        help_ = _HELP.get(f.name, "") + f" (default: {f.default})"
        if tp is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        else:
            group.add_argument(flag, type=tp, default=f.default, help=help_)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
