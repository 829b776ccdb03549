"""Single-device model code (Llama, Qwen2, Qwen3) and loading from HF dirs, modules, GGUF, presets."""
