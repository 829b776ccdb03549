"""The decoder of the Llama family (Llama, SmolLM2, Mistral, Qwen2/2.5, Qwen3), single-device.

One model class; an architecture differs from Llama only by its `DecoderSpec` (registry.py).
Shape suffixes: T = tokens in the step, D = hidden, N = heads, K = kv heads, H = head dim.
The model takes (input_ids [T], positions [T]) and reads paged-attention metadata from the
forward context; it knows nothing of batching, paging or parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.layers.activation import SiluAndMul
from tandem.layers.attention import Attention
from tandem.layers.linear import Linear, LMHead, MergedLinear, QKVLinear, apply_mlp
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class DecoderSpec:
    """What sets an architecture apart from Llama."""

    qkv_bias: bool = False  # biases on q/k/v when the config says nothing (`attention_bias`)
    o_bias_follows_qkv: bool = True  # o_proj has a bias when `attention_bias` is set (Qwen2: never)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (Qwen3)


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, cfg, max_position: int, spec: DecoderSpec):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(cfg)
        self.qk_norm = spec.qk_norm
        qkv_bias = getattr(cfg, "attention_bias", spec.qkv_bias)
        o_bias = getattr(cfg, "attention_bias", False) and spec.o_bias_follows_qkv
        self.qkv_proj = QKVLinear(cfg.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=o_bias)
        self.rotary_emb = RotaryEmbedding(cfg, self.head_dim, max_position)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        T = x_TD.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x_TD).split([q_size, kv_size, kv_size], dim=-1)
        q_TNH = q.view(T, self.num_heads, self.head_dim)
        k_TKH = k.view(T, self.num_kv_heads, self.head_dim)
        v_TKH = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q_TNH = self.q_norm(q_TNH)
            k_TKH = self.k_norm(k_TKH)
        o_TNH = self.attn(q_TNH, k_TKH, v_TKH, positions, self.rotary_emb)
        return self.o_proj(o_TNH.reshape(T, q_size))


class DecoderMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [inter, inter], [0, 1], bias)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return apply_mlp(self.gate_up_proj, self.act_fn, self.down_proj, x_TD)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, max_position: int, spec: DecoderSpec):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, max_position, spec)
        self.mlp = DecoderMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x_TD: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x_TD
            x_TD = self.input_layernorm(x_TD)
        else:
            x_TD, residual = self.input_layernorm(x_TD, residual)
        x_TD = self.self_attn(positions, x_TD)
        x_TD, residual = self.post_attention_layernorm(x_TD, residual)
        return self.mlp(x_TD), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg, max_position: int, spec: DecoderSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, max_position, spec) for _ in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x_TD = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x_TD, residual = layer(positions, x_TD, residual)
        x_TD, _ = self.norm(x_TD, residual)
        return x_TD


class DecoderForCausalLM(nn.Module):
    # checkpoint name -> (merged parameter name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg, max_position: int, spec: DecoderSpec = DecoderSpec()):
        super().__init__()
        self.config = cfg
        self.spec = spec
        self.model = DecoderModel(cfg, max_position, spec)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_BD: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_BD)
