"""Maps a HF `architectures` name to tandem's model class."""

from __future__ import annotations

from torch import nn

from tandem.models.llama import LlamaForCausalLM
from tandem.models.qwen2 import Qwen2ForCausalLM
from tandem.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # without sliding window, Mistral is Llama
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(hf_config) -> type[nn.Module]:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            if arch == "MistralForCausalLM" and getattr(hf_config, "sliding_window", None):
                raise ValueError("MistralForCausalLM with sliding_window is not supported")
            return MODEL_REGISTRY[arch]
    model_type = getattr(hf_config, "model_type", None)
    by_type = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}
    if not archs and model_type in by_type:
        return by_type[model_type]
    raise ValueError(
        f"model architecture {archs or model_type!r} is not supported; "
        f"supported architectures: {sorted(MODEL_REGISTRY)}"
    )
