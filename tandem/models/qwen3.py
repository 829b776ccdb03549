"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before rotary."""

from __future__ import annotations

from tandem.models.llama import DecoderAttention, DecoderLayer, DecoderModel, LlamaForCausalLM


class Qwen3Attention(DecoderAttention):
    qk_norm = True


class Qwen3DecoderLayer(DecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(DecoderModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
