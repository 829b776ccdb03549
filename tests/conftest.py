"""Shared fixtures: tiny random models with a real tokenizer, the embedded default, leak checks."""

from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated: set it before anything imports one,
# so kernel tests run on the CPU here and natively where CUDA exists.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from model_fixtures import make_tiny_model, make_tokenizer


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
