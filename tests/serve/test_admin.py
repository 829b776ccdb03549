"""The API key, and the admin routes of the RL server mode: sleep, wake, weight updates."""

from __future__ import annotations

import threading
import time

import openai
import pytest
import torch
from safetensors.torch import save
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams
from tandem.serve.app import build_app

from .helpers import ADMIN_KEY as KEY
from .helpers import MODEL_NAME

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital"  # > 1 block


def _greedy(srv) -> list[int]:
    status, _, resp = srv.post(
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True},
    )
    assert status == 200, resp
    return resp["choices"][0]["token_ids"]


def test_api_key_is_enforced(admin):
    json_only = {"Content-Type": "application/json"}
    wrong = {**json_only, "Authorization": "Bearer nope"}
    for headers in (json_only, wrong):
        assert admin.get("/v1/models", headers=headers)[0] == 401
        assert admin.get("/is_sleeping", headers=headers)[0] == 401
        status, _, resp = admin.post("/v1/completions", b'{"prompt": ', headers=headers)
        assert status == 401 and resp["error"]["code"] == "invalid_api_key"
    assert admin.get("/health", headers=json_only)[0] == 200
    assert admin.get("/metrics", headers=json_only)[0] == 200
    assert admin.get("/v1/models")[0] == 200
    assert admin.stream("/v1/completions", {"prompt": "Hi", "max_tokens": 2})[-1]["choices"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=admin.url + "/v1", api_key="nope", max_retries=0).models.list()
    client = openai.OpenAI(base_url=admin.url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).choices


def test_admin_routes_need_the_flag_and_a_key(server, admin):
    assert server.post("/sleep", {})[0] == 404  # the default server has no admin routes
    with pytest.raises(ValueError, match="api_key"):
        build_app(admin.llm, MODEL_NAME, enable_admin_api=True)


def test_sleep_refused_while_busy_then_sleep_and_wake(admin):
    before = _greedy(admin)
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
    busy = threading.Thread(target=admin.stream, args=("/v1/completions", body))
    busy.start()
    while not admin.llm.stats.num_unfinished:
        time.sleep(0.002)
    status, _, resp = admin.post("/sleep?level=1", b"")
    assert status == 409 and resp["error"]["code"] == "engine_busy"
    busy.join()
    admin.wait_idle()

    status, _, resp = admin.post("/sleep?level=1", b"")
    assert status == 200 and resp["is_sleeping"] is True
    assert admin.get("/is_sleeping")[2] == {"is_sleeping": True}
    status, headers, resp = admin.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 503 and resp["error"]["code"] == "engine_asleep" and headers["Retry-After"]
    status, _, resp = admin.post("/wake_up", b"")
    assert status == 200 and resp["is_sleeping"] is False
    assert _greedy(admin) == before
    admin.wait_idle()


def test_weight_update_is_visible_in_the_next_generation(admin, tiny_llama_dir):
    before = _greedy(admin)  # also leaves PROMPT's blocks in the prefix cache
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    want = (
        LLM(model, tokenizer=admin.llm.tokenizer, device="cpu")
        .generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        .outputs[0]
    )
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/octet-stream"}
    body = save({k: v.contiguous() for k, v in model.state_dict().items()})
    status, _, resp = admin.post("/update_weights", body, headers=headers)
    assert status == 200 and resp["num_tensors"] > 0, resp
    after = _greedy(admin)
    assert after == want.token_ids and after != before
    status, _, resp = admin.post("/update_weights", {"path": tiny_llama_dir})  # back again
    assert status == 200, resp
    assert _greedy(admin) == before
    status, _, resp = admin.post("/update_weights", b"not safetensors", headers=headers)
    assert status == 400 and "error" in resp
    admin.wait_idle()


def _norm(engine) -> torch.Tensor:
    return engine.model.model.norm.weight.detach().clone()


def test_a_rejected_update_changes_nothing(admin):
    """A checkpoint whose second tensor has the wrong shape is refused whole: the first tensor is
    not copied, the version does not move (and the greedy answer stays the same)."""
    before, norm, version = _greedy(admin), admin.call(_norm), admin.llm.weights_version
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/octet-stream"}
    for bad in [
        {"model.norm.weight": norm * 3,
         "model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)},
        {"model.norm.weight": norm * 3, "model.embed_tokens.weight": torch.zeros(3, 5)},
        {"model.norm.weight": norm * 3, "model.no_such.weight": torch.zeros(2)},
        {"model.norm.weight": norm * 3, "model.layers.0.input_layernorm.weight":
            torch.ones(norm.shape, dtype=torch.int32)},
    ]:
        status, _, resp = admin.post("/update_weights", save(bad), headers=headers)
        assert status == 400, resp
        assert torch.equal(admin.call(_norm), norm), bad.keys()
    assert admin.llm.weights_version == version
    assert _greedy(admin) == before
    admin.wait_idle()


def test_offline_load_weights_is_all_or_nothing():
    from model_fixtures import make_tiny_model

    llm = LLM(make_tiny_model("llama"), block_size=4, max_model_len=64)
    engine = llm.llm_engine
    norm = engine.model.model.norm.weight.detach().clone()
    with pytest.raises(ValueError, match="gate_proj"):
        llm.load_weights([("model.norm.weight", norm + 1),
                          ("model.layers.0.mlp.gate_proj.weight", torch.zeros(1, 1))])
    assert torch.equal(engine.model.model.norm.weight, norm) and engine.weights_version == 0
    llm.load_weights([("model.norm.weight", norm + 1)])
    assert torch.equal(engine.model.model.norm.weight, norm + 1) and engine.weights_version == 1
