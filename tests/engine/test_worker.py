"""Worker: owns the device lifecycle (build, load, size and allocate the KV cache, sleep, wake,
weight loading), usable without an engine around it."""

import pytest
import torch
from model_fixtures import make_tiny_model

from tandem.config import EngineConfig
from tandem.engine.worker import Worker
from tandem.models.loader import resolve_model


def make_worker(**kw):
    model = make_tiny_model("llama")
    config = EngineConfig(block_size=4, max_num_seqs=4, enable_sleep_mode=True, **kw)
    return model, Worker(config, resolve_model(model, config.load_format), max_model_len=64)


def test_lifecycle_on_a_cpu():
    _, worker = make_worker()
    assert worker.device.type == "cpu" and worker.attention_backend == "torch"
    # a CPU cache holds max_num_seqs full-length sequences, plus one block; nothing was profiled
    assert worker.num_blocks == 4 * (64 // 4) + 1 and worker.memory_profile is None
    assert worker.model_runner.kv_cache.shape[2] == worker.num_blocks
    assert not worker.has_graphs and worker.cudagraph_capture_s is None
    report = worker.memory_report()
    assert report["kv_cache_bytes"] == worker.model_runner.kv_store.nbytes and report["sleep_level"] == 0


def test_sleep_level_2_refuses_until_every_weight_is_loaded():
    model, worker = make_worker()
    worker.check_awake()
    worker.sleep(2)
    assert worker.sleep_level == 2 and not worker.weights_valid
    with pytest.raises(ValueError, match="asleep"):
        worker.check_awake()
    worker.wake_up(["kv_cache"])
    before = worker.weights_version
    with pytest.raises(ValueError, match="every weight must be loaded"):  # refused whole:
        worker.load_weights([("model.norm.weight", model.model.norm.weight)])  # no new version
    assert worker.weights_version == before
    assert worker.load_weights(model.state_dict().items()) > 0
    assert worker.weights_valid and worker.sleep_level == 0 and worker.weights_version == before + 1
    worker.check_awake()
    torch.testing.assert_close(worker.model.model.norm.weight, model.model.norm.weight)


def test_wake_up_tells_the_caller_when_the_kv_cache_is_back():
    _, worker = make_worker()
    worker.sleep(1)
    calls = []
    worker.wake_up(["weights"], on_kv_cache=lambda: calls.append("kv"))
    assert calls == [] and worker.sleep_level == 1
    worker.wake_up(["kv_cache"], on_kv_cache=lambda: calls.append("kv"))
    assert calls == ["kv"] and worker.sleep_level == 0
    with pytest.raises(ValueError, match="tags"):
        worker.wake_up(["everything"])
