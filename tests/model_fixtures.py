"""Tiny random models with a real tokenizer, built in-process, and the KV-leak check."""

from __future__ import annotations

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello, my name is tandem and I generate text quickly on the same GPU as the trainer.",
    "What is 2 + 3? The answer is 5. What is 10 - 4? The answer is 6.",
    "Once upon a time there was a small model that learned to count: one two three four five.",
]


def make_tokenizer():
    """A small byte-level BPE tokenizer with chat tokens, trained in-process (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# A decoder sequence that turns "Ċ" into a newline itself, which llguidance (reading any decoder
# sequence as byte fallback, token names as their text) does not: its bytes for the newline token
# are neither the text encoded nor the text decoded (structured outputs refuse such a tokenizer).
MISREAD_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "\u010a"}, "content": "\n"},
    {"type": "ByteFallback"}, {"type": "Fuse"}]}


def tokenizer_with_decoder(src_dir: str, dst_dir, decoder: dict, byte_fallback: bool) -> str:
    """The tokenizer of `src_dir` saved in `dst_dir` with another decoder (and its BPE model's
    byte_fallback flag), e.g. as transformers 5.17 converts a GGUF's; returns `dst_dir`."""
    import json
    import shutil

    with open(f"{src_dir}/tokenizer.json") as f:
        spec = json.load(f)
    spec["decoder"] = decoder
    spec["model"]["byte_fallback"] = byte_fallback
    with open(f"{dst_dir}/tokenizer.json", "w") as f:
        json.dump(spec, f)
    shutil.copy(f"{src_dir}/tokenizer_config.json", dst_dir)
    return str(dst_dir)


def make_tiny_model(arch: str = "llama", vocab_size: int = 320, seed: int = 0, **overrides):
    """A tiny random HF causal LM (fp32, eval mode)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=2, pad_token_id=0,
    )
    common.update(overrides)
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    if arch == "qwen3":
        common.setdefault("head_dim", 16)
    model = model_cls(cfg_cls(**common)).eval()
    # HF's default init is tiny; widen it so greedy paths are not all ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    return model


def record_schedules(llm) -> list:
    """Every SchedulerOutput the engine's scheduler gives from now on, in order (the decode
    windows it chose: `.num_steps`)."""
    sched = getattr(llm, "llm_engine", llm).scheduler
    schedule, outs = sched.schedule, []

    def recording():
        outs.append(schedule())
        return outs[-1]

    sched.schedule = recording
    return outs


def assert_no_leak(llm) -> None:
    engine = getattr(llm, "llm_engine", llm)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
    assert not engine.scheduler.has_unfinished()
