"""Maps a HF architecture (or, without one, a `model_type`) to the decoder's spec."""

from __future__ import annotations

from tandem.models.decoder import DecoderSpec

LLAMA = DecoderSpec()
QWEN2 = DecoderSpec(qkv_bias=True, o_bias_follows_qkv=False)  # biases on q/k/v, never on o
QWEN3 = DecoderSpec(qk_norm=True)

ARCHITECTURES: dict[str, DecoderSpec] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,  # without sliding window, Mistral is Llama
    "Qwen2ForCausalLM": QWEN2,
    "Qwen3ForCausalLM": QWEN3,
}
MODEL_TYPES: dict[str, DecoderSpec] = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3}


def get_decoder_spec(hf_config) -> DecoderSpec:
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in ARCHITECTURES:
            if arch == "MistralForCausalLM" and getattr(hf_config, "sliding_window", None):
                raise ValueError("MistralForCausalLM with sliding_window is not supported")
            return ARCHITECTURES[arch]
    model_type = getattr(hf_config, "model_type", None)
    if not archs and model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ValueError(
        f"model architecture {archs or model_type!r} is not supported; "
        f"supported architectures: {sorted(ARCHITECTURES)}"
    )
