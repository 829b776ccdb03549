"""Architectures by name, for random-weight benchmarks with nothing to download (docs/benchmarks.md)."""

from __future__ import annotations

_QWEN25 = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, rope_theta=1e6,
    max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu", torch_dtype="bfloat16",
    bos_token_id=151643, eos_token_id=151645,
)

PRESETS: dict[str, dict] = {
    "qwen2.5-0.5b": dict(_QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(_QWEN25, vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    # The largest that train colocated on one GPU (docs/rl.md, "Memory"): the 7B fits in full
    # fine-tune with AdamW; the 14B and 32B need a lighter optimizer or LoRA.
    "qwen2.5-14b": dict(_QWEN25, vocab_size=152064, hidden_size=5120, intermediate_size=13824,
                        num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                        rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2.5-32b": dict(_QWEN25, vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        rms_norm_eps=1e-5, tie_word_embeddings=False),
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=True, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
    ),
}
# Hub-style aliases, so `--model Qwen/Qwen2.5-1.5B --load-format dummy` works offline.
ALIASES = {
    "qwen/qwen2.5-0.5b": "qwen2.5-0.5b", "qwen/qwen2.5-0.5b-instruct": "qwen2.5-0.5b",
    "qwen/qwen2.5-1.5b": "qwen2.5-1.5b", "qwen/qwen2.5-1.5b-instruct": "qwen2.5-1.5b",
    "qwen/qwen2.5-7b": "qwen2.5-7b", "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen/qwen2.5-14b": "qwen2.5-14b", "qwen/qwen2.5-14b-instruct": "qwen2.5-14b",
    "qwen/qwen2.5-32b": "qwen2.5-32b", "qwen/qwen2.5-32b-instruct": "qwen2.5-32b",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m",
}


def preset_config(name: str):
    """A transformers config for a named architecture, or None if the name is not a preset."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PRESETS:
        return None
    from transformers import AutoConfig

    kwargs = dict(PRESETS[key])
    model_type = kwargs.pop("model_type")
    return AutoConfig.for_model(model_type, **kwargs)
