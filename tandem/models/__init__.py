"""Single-device model code: one decoder configured by a spec per architecture (Llama, Mistral,
Qwen2, Qwen3), and loading from HF dirs, modules, GGUF, presets."""
