"""tandem: fast LLM generation colocated with RL training on the same GPUs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.config import EngineConfig
    from tandem.engine.llm import LLM
    from tandem.outputs import CompletionOutput, FlatLogprobs, Logprob, RequestOutput
    from tandem.sampling_params import SamplingParams, StructuredOutputsParams

# Imported on first use (PEP 562), so that a process needing none of them (a `bench serve`
# client process, the CLI's help) does not import torch for `import tandem.<anything>`.
_EXPORTS = {
    "LLM": "tandem.engine.llm",
    "SamplingParams": "tandem.sampling_params",
    "StructuredOutputsParams": "tandem.sampling_params",
    "RequestOutput": "tandem.outputs",
    "CompletionOutput": "tandem.outputs",
    "Logprob": "tandem.outputs",
    "FlatLogprobs": "tandem.outputs",
    "EngineConfig": "tandem.config",
}
__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "FlatLogprobs",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
