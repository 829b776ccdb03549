"""Fuzzing EngineConfig and SamplingParams: every value of a wrong type or out of range is a
TypeError/ValueError naming its field, raised before a model is built; every good value is taken.

The oracle below states each field's accepted values independently of the code under test.
"""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_fixtures import make_tiny_model

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig


def _int(lo=None, hi=None, optional=False):
    def ok(v):
        if v is None:
            return optional
        return (isinstance(v, int) and not isinstance(v, bool)
                and (lo is None or v >= lo) and (hi is None or v <= hi))
    return ok


def _float(lo=None, hi=None, lo_open=False):
    def ok(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        return (lo is None or (v > lo if lo_open else v >= lo)) and (hi is None or v <= hi)
    return ok


def _bool(optional=False):
    return lambda v: isinstance(v, bool) or (optional and v is None)


def _choice(*choices):
    return lambda v: isinstance(v, str) and v in choices


def _pow2(v):
    return _int(1, 1024)(v) and v & (v - 1) == 0


_COUNT = 2**31 - 1
ENGINE = {
    "dtype": _choice("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16",
                     "fp32"),
    "max_model_len": _int(1, optional=True),
    "max_num_seqs": _int(1, _COUNT),
    "max_num_batched_tokens": _int(1, _COUNT),
    "gpu_memory_utilization": _float(0.0, 1.0, lo_open=True),
    "block_size": _pow2,
    "enable_prefix_caching": _bool(),
    "enable_chunked_prefill": _bool(),
    "load_format": _choice("auto", "dummy", "safetensors", "pt", "gguf"),
    "seed": _int(0, 2**63 - 1),
    "device": lambda v: isinstance(v, str) and (v in ("auto", "cpu", "cuda") or (
        v.startswith("cuda:") and v[5:].isascii() and v[5:].isdigit())),
    "tensor_parallel_size": _int(1, 1024),
    "enforce_eager": _bool(),
    "batch_invariant": _bool(),
    "host_only": _bool(),
    "enable_sleep_mode": _bool(),
    "sleep_mode_backend": _choice("auto", "cumem", "recapture"),
    "num_gpu_blocks_override": _int(1, optional=True),
    "kv_cache_memory_bytes": _int(1, optional=True),
    "cpu_kv_cache_space_gib": _float(0.0, 1e6, lo_open=True),
    "max_cudagraph_capture_size": _int(0, _COUNT),
    "logprobs_mode": _choice("raw_logprobs", "processed_logprobs"),
    "trust_remote_code": _bool(),
    "attention_backend": _choice("auto", "torch", "triton"),
    "structured_outputs_backend": _choice("auto", "guidance", "fsm"),
    "decode_gemm": lambda v: _choice("auto", "cublas", "triton")(v) or (  # or an existing .json table
        isinstance(v, str) and v.endswith(".json") and os.path.isfile(v)),
    "async_scheduling": _bool(optional=True),
    "stream_interval": _int(1, _COUNT),
    "max_admission_delay_steps": _int(0, _COUNT),
    "num_scheduler_steps": _int(1, 64, optional=True),
    "decode_window_min_seqs": _int(1, 256, optional=True),  # at most max_num_seqs (its default)
    # None, or a local directory or file (a drawn "/" or "." exists)
    "tokenizer": lambda v: v is None or (isinstance(v, str) and v != "" and os.path.exists(v)),
    "revision": lambda v: v is None or (isinstance(v, str) and v != ""),
}
SAMPLING = {
    "n": _int(1, 2**16),
    "temperature": _float(0.0, 1e6),
    "top_p": _float(0.0, 1.0, lo_open=True),
    "top_k": _int(-1, 2**31),
    "min_p": _float(0.0, 1.0),
    "max_tokens": _int(1, optional=True),
    "min_tokens": lambda v: _int(0, 16)(v),  # max_tokens stays at its default, 16
    "ignore_eos": _bool(),
    "seed": _int(0, 2**63 - 2**16 - 1, optional=True),
    "logprobs": _int(0, 2**20, optional=True),
    "prompt_logprobs": _int(0, 2**20, optional=True),  # (the engine's limit, 20, is its own)
    "logit_bias": lambda v: v is None or (isinstance(v, dict) and all(
        _int(0)(t) and _float()(b) for t, b in v.items())),
    "structured_outputs": lambda v: v is None,  # or a StructuredOutputsParams: never drawn
    "repetition_penalty": _float(0.0, 1e6, lo_open=True),
    "presence_penalty": _float(-2.0, 2.0),
    "frequency_penalty": _float(-2.0, 2.0),
    "skip_special_tokens": _bool(),
    "include_stop_str_in_output": _bool(),
    "detokenize": _bool(),
    "stop": lambda v: v is None or (isinstance(v, str) and v != "") or (
        isinstance(v, list) and all(isinstance(x, str) and x for x in v)),
    "stop_token_ids": lambda v: v is None or (isinstance(v, list) and all(_int(0)(t) for t in v)),
}
NORMAL = {("stop_token_ids", None): [], ("top_k", -1): 0}  # what construction makes of a value

# values of every kind: wrong types, edges, NaN and infinities, strings that look like flags
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, 1, -1, 2, 3, 16, 1024, 2048, 2**31, 2**63 - 2**16, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 0.5, 1.0, 1.5, -0.0, 1e-9, float("nan"), float("inf")]),
    st.sampled_from(["", "no", "yes", "true", "0", "1", "abc", "auto", "cpu", "cuda:0", "tpu",
                     "float16", "triton", "torch", "cublas", "cumem", "dummy", "raw_logprobs"]),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.just({}),
)


def test_the_oracle_covers_every_field():
    from dataclasses import fields

    assert set(ENGINE) == {f.name for f in fields(EngineConfig)} - {"model"}
    assert set(SAMPLING) == {f.name for f in fields(SamplingParams) if f.init}


def _check(cls, field: str, value, ok) -> None:
    if ok(value):
        obj = cls(**{field: value})
        got = getattr(obj, field)
        assert got == NORMAL.get((field, _key(value)), value), (field, value)
        return
    with pytest.raises((TypeError, ValueError)) as info:
        cls(**{field: value})
    assert str(info.value).startswith(field), (field, value, str(info.value))


FUZZ = settings(
    max_examples=1500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def _key(value):
    return value if value is None or isinstance(value, int) else id(value)


@FUZZ
@given(st.sampled_from(sorted(ENGINE)), VALUES)
def test_engine_config_fuzz(field, value):
    _check(EngineConfig, field, value, ENGINE[field])


FUZZ = settings(
    max_examples=1500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def _key(value):
    return value if value is None or isinstance(value, int) else id(value)


@FUZZ
@given(st.sampled_from(sorted(SAMPLING)), VALUES)
def test_sampling_params_fuzz(field, value):
    _check(SamplingParams, field, value, SAMPLING[field])


@pytest.mark.parametrize("kwargs", [
    {"max_num_seqs": "abc"}, {"max_num_seqs": 1.5}, {"enforce_eager": "no"},
    {"device": "tpu"}, {"tokenizer": "/nonexistent"}, {"seed": 1.5}, {"block_size": 3},
])
def test_bad_engine_values_fail_before_the_model_is_built(kwargs, monkeypatch):
    def no_build(*args, **kw):
        raise AssertionError("a model was built for a bad config")

    monkeypatch.setattr("tandem.engine.worker.build_model", no_build)
    field = next(iter(kwargs))
    with pytest.raises((TypeError, ValueError), match=f"^{field}"):
        LLM(make_tiny_model("llama"), **kwargs)


def test_a_field_changed_after_construction_is_refused_before_any_step():
    """A bad value set after construction used to crash the step and fail every request of the
    generate() call; now it is refused, naming the field, and the engine is untouched."""
    llm = LLM(make_tiny_model("llama"), block_size=4, max_model_len=64)
    good = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for field, value in [("seed", 1.5), ("logprobs", 1.5), ("skip_special_tokens", "no"),
                         ("repetition_penalty", float("nan")), ("top_p", None)]:
        bad = good.clone()
        setattr(bad, field, value)
        with pytest.raises((TypeError, ValueError), match=f"^{field}"):
            llm.generate([[1, 2, 3], [4, 5, 6]], [good, bad], use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], good, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
