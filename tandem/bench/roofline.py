"""The decode ceiling of docs/benchmarks.md: weights + KV read per step against HBM bandwidth and FLOPs."""

from __future__ import annotations

from dataclasses import dataclass

# Measured on one H200 here (docs/benchmarks.md): device copy 4.2 TB/s, bf16 matmul 791 TFLOP/s.
H200_HBM_BYTES_PER_S = 4.2e12
H200_BF16_FLOPS = 791e12
KNOWN_DEVICES = {"H200": (H200_HBM_BYTES_PER_S, H200_BF16_FLOPS)}  # name substring -> ceilings


def device_ceilings(hbm: float | None = None, flops: float | None = None) -> tuple:
    """(bytes/s, FLOP/s, where they came from): given values win, else the GPU's where known,
    else None (a CPU, or a GPU measured nowhere here): no roofline is better than a wrong one."""
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    known = next((v for k, v in KNOWN_DEVICES.items() if name and k in name), (None, None))
    hbm = hbm if hbm is not None else known[0]
    flops = flops if flops is not None else known[1]
    source = name if (hbm, flops) == known else "the given ceilings"
    return hbm, flops, source


@dataclass
class ModelShape:
    params: int  # counted once when embeddings are tied
    weight_bytes: int
    kv_bytes_per_token: int  # all layers, K and V
    embedding_params: int = 0  # the embedding and (untied) LM head: a prompt token runs neither as a GEMM
    # An untied model's input embedding: a decode step gathers a row of it a sequence, so neither
    # its FLOPs nor its bytes bound the step (a tied table is the LM head's GEMM, and counts).
    input_embedding_params: int = 0

    @property
    def decode_params(self) -> int:
        """The parameters a decode step reads whole and multiplies by every row."""
        return self.params - self.input_embedding_params

    @property
    def decode_weight_bytes(self) -> int:
        return self.weight_bytes * self.decode_params // self.params if self.params else 0

    @classmethod
    def from_hf_config(cls, cfg, dtype_bytes: int = 2) -> "ModelShape":
        h, layers, inter, vocab = (
            cfg.hidden_size,
            cfg.num_hidden_layers,
            cfg.intermediate_size,
            cfg.vocab_size,
        )
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        hd = getattr(cfg, "head_dim", None) or h // heads
        attn = h * hd * (heads + 2 * kv) + heads * hd * h
        mlp = 3 * h * inter
        per_layer = attn + mlp + 2 * h
        tied = getattr(cfg, "tie_word_embeddings", False)
        params = layers * per_layer + vocab * h * (1 if tied else 2) + h
        return cls(params, params * dtype_bytes, 2 * layers * kv * hd * dtype_bytes,
                   vocab * h * (1 if tied else 2), 0 if tied else vocab * h)


def decode_step_seconds(
    shape: ModelShape,
    batch: int,
    context_tokens: int,
    hbm: float = H200_HBM_BYTES_PER_S,
    flops: float = H200_BF16_FLOPS,
) -> float:
    """Lower bound of one decode step: `batch` sequences holding `context_tokens` tokens in all.
    Every weight it multiplies is read once and does 2 FLOPs a row (an untied input embedding is a
    gather of `batch` rows: left out of both)."""
    memory = (shape.decode_weight_bytes + shape.kv_bytes_per_token * context_tokens) / hbm
    compute = 2 * shape.decode_params * batch / flops
    return max(memory, compute)


def prefill_floor_seconds(shape: ModelShape, prompt_tokens: int, flops: float = H200_BF16_FLOPS) -> float:
    """Lower bound of computing `prompt_tokens` prompt tokens: their GEMMs' FLOPs at peak (the
    causal attention's and the LM head's on a prompt's last token left out, so a true floor)."""
    return 2 * (shape.params - shape.embedding_params) * prompt_tokens / flops


def ceiling_tokens_per_s(
    shape: ModelShape,
    input_lens: list[int],
    output_lens: list[int],
    max_num_seqs: int,
    hbm: float = H200_HBM_BYTES_PER_S,
    flops: float = H200_BF16_FLOPS,
) -> float:
    """Output tokens/s if every decode step ran at the ceiling (prefill ignored: it only lowers it).

    Requests run in waves of `max_num_seqs`; each step's KV read is the context of the live ones.
    """
    total_time = 0.0
    reqs = sorted(zip(input_lens, output_lens), key=lambda r: r[1])
    for w in range(0, len(reqs), max_num_seqs):
        wave = reqs[w : w + max_num_seqs]
        longest = max(o for _, o in wave)
        for step in range(longest):
            live = [(i, o) for i, o in wave if o > step]
            context = sum(i + step for i, _ in live)
            total_time += decode_step_seconds(shape, len(live), context, hbm, flops)
    return sum(output_lens) / total_time if total_time else 0.0
