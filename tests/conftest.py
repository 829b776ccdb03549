"""Shared fixtures: tiny random models with a real tokenizer, the embedded default, leak checks."""

from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated: set it before anything imports one,
# so kernel tests run on the CPU here and natively where CUDA exists.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A saved tiny Llama with a chat-capable tokenizer: what a user's local model dir looks like."""
    d = tmp_path_factory.mktemp("tiny-llama")
    model = make_tiny_model("llama")
    tok = make_tokenizer()
    assert len(tok) <= model.config.vocab_size
    model.generation_config.eos_token_id = tok.eos_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The embedded default model, converted from its GGUF once per cache."""
    from tandem.models import gguf

    try:
        path = gguf.default_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))
    return str(gguf.converted_dir(path))


def assert_no_leak(llm) -> None:
    engine = getattr(llm, "llm_engine", llm)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
    assert not engine.scheduler.has_unfinished()


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
