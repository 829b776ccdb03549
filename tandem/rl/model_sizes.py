"""What the memory plan needs to know of an architecture, from its config alone: the model is built
on PyTorch's meta device (shapes, no storage), so a 32B architecture is sized in a second without
a byte of it in memory. The activation formula below is the decoder's saved-for-backward tensors,
counted one by one for HF's Llama-family layer (Llama, Qwen2, Qwen3, Mistral); tests check it
against `memory_plan.measure_activations`, which counts what autograd really saves.

Shapes: D = hidden, I = intermediate, H = attention heads, K = key/value heads, E = head dim,
L = decoder layers, V = vocabulary, P = parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.rl.activations import ActivationCost


@dataclass(frozen=True)
class ModelSizes:
    """An architecture's sizes: parameter counts (exact, from the meta-device model) and the
    dimensions the activation and KV-cache arithmetic reads."""

    num_params: int  # unique parameters (a tied head counted once)
    trainable_numels: tuple[int, ...]  # each trainable tensor: optimizer state is kept per tensor
    layer_linear_params: int  # decoder layers' linear weights: under autocast each gets a bf16 copy
    largest_linear: int  # elements of the largest linear weight in a decoder layer
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool = False  # Qwen3's per-head RMSNorm of q and k

    @property
    def num_trainable(self) -> int:
        return sum(self.trainable_numels)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer, as the engine's paged cache stores them."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def activations(self, bf16: bool, recompute: bool, masked: bool = True) -> ActivationCost:
        """Saved-for-backward bytes of one training forward pass, as `ActivationCost`. `masked`:
        padded rows, so SDPA runs with a mask (each layer keeps it, in the compute dtype) and K, V
        repeated to every head; padding-free rows run without one.

        Per token and layer, bf16 autocast (fp32 master weights): the two RMSNorms keep their fp32
        input, normalised output and rsqrt (16D + 8); q/k/v and gate/up each cast their input to
        bf16 (6D + 4D); SDPA keeps q, k, v, whose output is o_proj's input (8HE), and its fp32
        log-sum-exp (4H); silu, the product and down_proj keep four [I] tensors (8I); Qwen3's
        q/k norms their input and output ((H + K)E each). In fp32 the norms' output is one shared
        input of q/k/v and of gate/up (4D each) and every tensor is 4 bytes. Recompute keeps each
        layer's fp32 input only (4D). Either way the final norm (8D + 4); without recompute RoPE's
        cos and sin once (8E). Fixed: autocast's bf16 copies of the linear weights (2 bytes each),
        saved by the matmuls that use them (the fp32 weights themselves are resident anyway)."""
        D, I, H, K, E, L = (
            self.hidden,
            self.intermediate,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.num_layers,
        )
        final = 8 * D + 4
        if recompute:
            return ActivationCost(per_token=L * 4 * D + final, fixed=0.0)
        elem = 2 if bf16 else 4
        kv_heads = H if masked else K
        norms = 16 * D + 8
        inputs = 10 * D if bf16 else 8 * D
        attention = elem * (2 * H + 2 * kv_heads) * E + 4 * H
        mlp = 4 * elem * I
        qk_norm = (6 if bf16 else 8) * (H + K) * E + 4 * (H + K) if self.qk_norm else 0
        layer = norms + inputs + attention + mlp + qk_norm
        return ActivationCost(
            per_token=L * layer + final + 8 * E,
            fixed=2.0 * self.layer_linear_params if bf16 else 0.0,
            per_row_sq=float(L * elem) if masked else 0.0,
        )

    def one_layer(self, bf16: bool) -> ActivationCost:
        """One layer's share of the kept activations: what backward rematerialises at a time
        under recompute."""
        keep = self.activations(bf16, recompute=False)
        L = self.num_layers
        return ActivationCost(
            per_token=(keep.per_token - 8 * self.hidden - 4 - 8 * self.head_dim) / L,
            fixed=keep.fixed / L,
            per_row_sq=keep.per_row_sq / L,
        )

    def backward_workspace(self, bf16: bool) -> ActivationCost:
        """Backward's own buffers for one layer at a time: the MLP's [I] gradients (three live at
        once), two fp32 gradients of the residual stream, and the largest weight gradient before it
        is added into `.grad` (under autocast a bf16 one and its fp32 cast)."""
        elem = 2 if bf16 else 4
        weight_grad = (6 if bf16 else 4) * self.largest_linear
        return ActivationCost(
            per_token=3 * elem * self.intermediate + 8 * self.hidden, fixed=float(weight_grad)
        )


def model_sizes(hf_config, peft_config=None) -> ModelSizes:
    """Sizes of the architecture `hf_config` describes (with `peft_config`: its LoRA adapter is
    what trains), from a meta-device model: exact parameter counts, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    if peft_config is not None:
        import warnings

        import peft

        with warnings.catch_warnings():  # peft asks the model for transformers' deprecated names
            warnings.simplefilter("ignore", FutureWarning)
            model = peft.get_peft_model(model, peft_config)
    return sizes_of_model(model)


def sizes_of_model(model: torch.nn.Module) -> ModelSizes:
    """The same sizes read off a built model (meta or real)."""
    cfg = model.config
    seen: set[int] = set()
    unique = []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    linears = [
        m.weight
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}"
    ]
    H = cfg.num_attention_heads
    return ModelSizes(
        num_params=sum(p.numel() for p in unique),
        trainable_numels=tuple(p.numel() for p in unique if p.requires_grad),
        layer_linear_params=sum(w.numel() for w in linears),
        largest_linear=max((w.numel() for w in linears), default=0),
        num_layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        intermediate=cfg.intermediate_size,
        num_heads=H,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or H,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // H,
        vocab=cfg.vocab_size,
        tied=bool(tied),
        qk_norm=any(name.endswith("q_norm") for name, _ in model.named_modules()),
    )
