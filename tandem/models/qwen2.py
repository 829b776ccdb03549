"""Qwen2 / Qwen2.5: the Llama decoder with biases on q/k/v (not on o)."""

from __future__ import annotations

from tandem.models.llama import DecoderAttention, DecoderLayer, DecoderModel, LlamaForCausalLM


class Qwen2Attention(DecoderAttention):
    qkv_bias_default = True
    o_bias_follows_qkv = False


class Qwen2DecoderLayer(DecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2Model(DecoderModel):
    layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2Model
