"""tandem: fast LLM generation colocated with RL training on the same GPUs."""

from tandem.config import EngineConfig
from tandem.engine.llm import LLM
from tandem.outputs import CompletionOutput, FlatLogprobs, Logprob, RequestOutput
from tandem.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "Logprob", "FlatLogprobs", "EngineConfig"]
__version__ = "0.1.0"
