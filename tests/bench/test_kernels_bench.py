"""`python -m tandem.bench.kernels --baseline FILE`: another decode_attention.py loads beside the
current one (the GPU timing itself runs on the H200 only)."""

import inspect
import sys

from tandem.bench.kernels import load_module
from tandem.kernels import decode_attention


def test_a_baseline_decode_attention_file_loads_with_its_dataclasses(tmp_path):
    path = tmp_path / "old_decode_attention.py"
    path.write_text(inspect.getsource(decode_attention))
    module = load_module(str(path))
    try:
        assert module is not decode_attention
        cfg = module.decode_config(2, 128, __import__("torch").bfloat16)
        assert isinstance(cfg, module.DecodeConfig) and cfg.heads_kv == 2
        assert callable(module.rotary_store_decode_attention)
    finally:
        sys.modules.pop("decode_attention_baseline", None)
