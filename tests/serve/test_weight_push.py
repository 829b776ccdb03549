"""Server mode: the trainer pushes weights to a `tandem serve` process over a collective group
(gloo on CPU here; NCCL between GPUs), and the next generation uses them."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem import LLM, SamplingParams
from tandem.rl.server_client import ServerClient, ServerError
from tandem.weights.communicator import (
    TRAINER_RANK,
    Communicator,
    open_store,
    steps_entered,
    wait_ready,
)

from .helpers import ADMIN_KEY as KEY

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital"  # > 1 block
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture
def client(admin):
    c = ServerClient(admin.url, api_key=KEY, timeout_s=60)
    yield c
    c.close()
    admin.wait_idle()


def _perturbed(model_dir: str, seed: int = 1):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _norm_weight(engine) -> torch.Tensor:
    return engine.model.model.norm.weight.detach().clone()


def _offline(model, tokenizer, prompt_ids: list[int]):
    llm = LLM(model, tokenizer=tokenizer, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0)
    return llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0].outputs[0]


def test_pushed_weights_are_used_by_the_next_generation(admin, client, tiny_llama_dir):
    ids = admin.llm.tokenizer.encode(PROMPT)
    before = client.generate([ids], GREEDY)[0]  # also leaves PROMPT's blocks in the prefix cache
    model = _perturbed(tiny_llama_dir)
    want = _offline(model, admin.llm.tokenizer, ids)

    assert client.init_communicator("gloo", timeout_s=30)["status"] == "ok"
    version = admin.llm.weights_version
    answer = client.push_weights(model, batch_size=4)  # several announces
    assert answer["num_tensors"] > 4 and answer["weights_version"] > version

    got = client.generate([ids], GREEDY)[0]
    assert got.token_ids == list(want.token_ids) and got.token_ids != before.token_ids
    want_lp = [lp[t].logprob for lp, t in zip(want.logprobs, want.token_ids)]
    assert got.logprobs == pytest.approx(want_lp, abs=1e-3)

    # a second group after the first one closes: the original weights go back
    client.close_communicator()
    client.init_communicator("gloo", timeout_s=30)
    client.push_weights(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), batch_size=0)
    assert client.generate([ids], GREEDY)[0].token_ids == before.token_ids


def test_generate_returns_n_samples_per_prompt_with_logprobs(admin, client):
    prompts = [[5, 6, 7], [9, 10]]
    out = client.generate(prompts, {"n": 3, "max_tokens": 4, "seed": 0, "ignore_eos": True})
    assert [c.prompt_index for c in out] == [0, 0, 0, 1, 1, 1]
    assert all(len(c.token_ids) == len(c.logprobs) == 4 for c in out)
    assert all(lp <= 0 for c in out for lp in c.logprobs)


def test_the_handlers_leave_the_event_loop_free(admin, tiny_llama_dir):
    """The server waits for the trainer in a worker thread (join) and in the engine thread
    (receive); meanwhile it answers other requests."""
    store = open_store("127.0.0.1", 0, True, 30)
    body = {"host": "127.0.0.1", "port": store.port, "backend": "gloo", "timeout_s": 30}
    init = _post_in_thread(admin, "/init_communicator", body)
    assert admin.get("/health")[0] == 200 and admin.get("/v1/models")[0] == 200
    assert not init.done.is_set()  # it cannot finish before we join
    comm = Communicator(store, TRAINER_RANK, 2, "gloo", 30)
    comm.warmup()
    assert init.result()[0] == 200

    norm = torch.full_like(admin.call(_norm_weight), 0.5)
    spec = {"name": "model.norm.weight", "dtype": "float32", "shape": list(norm.shape)}
    entered = steps_entered(store)
    update = _post_in_thread(admin, "/update_named_param", spec)
    assert admin.get("/health")[0] == 200
    # until the server is inside the receive (a request that has not got there yet would race)
    assert wait_ready(store, entered + 1, update.done.is_set, 30), update.result()
    status, _, resp = admin.post("/update_named_params", [spec])  # one at a time
    assert status == 409 and resp["error"]["code"] == "busy"
    comm.broadcast(norm)
    status, _, resp = update.result()
    assert status == 200 and resp["num_tensors"] == 1, resp
    assert torch.equal(admin.call(_norm_weight), norm)

    status, _, resp = admin.post("/init_communicator", body)  # one group at a time
    assert status == 409 and resp["error"]["code"] == "communicator_open"
    assert admin.post("/close_communicator", b"")[2]["closed"] is True
    assert admin.post("/close_communicator", b"")[2]["closed"] is False
    comm.close()
    status, _, resp = admin.post("/update_weights", {"path": tiny_llama_dir})
    assert status == 200, resp  # the norm back


def test_a_trainer_that_never_sends_costs_the_server_its_group_not_its_engine(admin, client):
    store = open_store("127.0.0.1", 0, True, 2)
    body = {"host": "127.0.0.1", "port": store.port, "backend": "gloo", "timeout_s": 2}
    init = _post_in_thread(admin, "/init_communicator", body)
    comm = Communicator(store, TRAINER_RANK, 2, "gloo", 2)
    comm.warmup()
    assert init.result()[0] == 200
    spec = {"name": "model.norm.weight", "dtype": "float32", "shape": [64]}
    status, _, resp = admin.post("/update_named_param", spec)  # and we send nothing
    assert status == 500 and resp["error"]["code"] == "communicator_failed", resp
    comm.close()
    assert admin.post("/close_communicator", b"")[2]["closed"] is False  # closed already
    assert client.generate([[5, 6, 7]], GREEDY)[0].token_ids  # the engine lives on
    client.init_communicator("gloo", timeout_s=30)  # and joins a new group


def test_push_without_a_communicator_is_a_clear_error(admin, client):
    spec = {"name": "model.norm.weight", "dtype": "float32", "shape": [64]}
    status, _, resp = admin.post("/update_named_params", [spec])
    assert status == 409 and resp["error"]["code"] == "no_communicator", resp
    assert "init_communicator" in resp["error"]["message"]
    with pytest.raises(RuntimeError, match="init_communicator"):
        client.push_weights(torch.nn.Linear(2, 2))


def test_a_refused_update_raises_at_once_and_a_failed_load_keeps_the_group(admin, client):
    client.init_communicator("gloo", timeout_s=30)
    bogus = [("model.no_such.weight", torch.zeros(3))]
    with pytest.raises(ServerError, match="no_such") as e:  # refused before the broadcast
        client.update_named_params(bogus)
    assert e.value.status == 400
    norm = admin.call(_norm_weight)
    assert client.update_named_params([("model.norm.weight", norm)])["num_tensors"] == 1

    assert admin.post("/close_communicator", b"")[2]["closed"] is True  # behind our back
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="init_communicator") as e:
        client.update_named_params([("model.norm.weight", norm)])
    assert e.value.status == 409 and time.monotonic() - t0 < 5  # not the group's timeout


@pytest.mark.parametrize(
    "path, body, needle",
    [
        ("/update_named_params", [{"name": "x", "dtype": "floaty", "shape": [2]}], "floaty"),
        ("/update_named_params", [{"name": "x", "dtype": "float32", "shape": [-1]}], "negative"),
        ("/update_named_params", [], "at least one"),
        ("/init_communicator", {"host": "127.0.0.1", "port": 1, "world_size": 3}, "world_size"),
        ("/init_communicator", {"host": "127.0.0.1", "port": 1, "backend": "nccl"}, "gloo"),
        ("/init_communicator", {"host": "127.0.0.1", "port": 0}, "port"),
    ],
)
def test_bad_requests_are_refused_before_any_collective(admin, path, body, needle):
    status, _, resp = admin.post(path, body, timeout=10)
    assert status == 400 and needle in resp["error"]["message"], resp


def test_the_routes_need_the_api_key_and_the_admin_flag(admin, server):
    body = {"host": "127.0.0.1", "port": 1, "backend": "gloo"}
    for headers in ({"Content-Type": "application/json"}, {"Authorization": "Bearer nope"}):
        for path in ("/init_communicator", "/update_named_params", "/close_communicator"):
            assert admin.post(path, body, headers=headers)[0] == 401
    with pytest.raises(ServerError) as e:
        ServerClient(admin.url, api_key="nope").init_communicator("gloo", timeout_s=5)
    assert e.value.status == 401
    assert server.post("/init_communicator", body)[0] == 404  # no --enable-admin-api


class _Pending:
    def __init__(self, fn):
        self.done = threading.Event()
        self._result = None

        def run():
            self._result = fn()
            self.done.set()

        threading.Thread(target=run, daemon=True).start()

    def result(self, timeout: float = 30.0):
        assert self.done.wait(timeout), "the request did not finish"
        return self._result


def _post_in_thread(srv, path: str, body) -> _Pending:
    return _Pending(lambda: srv.post(path, body))


@pytest.mark.gpu
@pytest.mark.slow
def test_nccl_push_between_two_gpus_equals_an_http_push(tiny_llama_dir, monkeypatch):
    """The real server mode: `tandem serve` on GPU 1 in its own process, the trainer on GPU 0."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    from safetensors.torch import save

    from .test_cli import _Proc

    torch.cuda.init()  # this process keeps every GPU; the server sees only GPU 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    argv = [tiny_llama_dir, "--port", "0", "--device", "cuda", "--api-key", KEY]
    proc = _Proc([*argv, "--enable-admin-api"])
    monkeypatch.undo()
    try:
        client = ServerClient(proc.url(), api_key=KEY, timeout_s=120)
        ids = [5, 6, 7, 8, 9, 10, 11]
        before = client.generate([ids], GREEDY)[0].token_ids
        model = _perturbed(tiny_llama_dir).to("cuda:0")
        client.init_communicator("nccl", device="cuda:0", timeout_s=60)
        client.push_weights(model, batch_size=4, dtype=torch.bfloat16)
        pushed = client.generate([ids], GREEDY)[0].token_ids
        client.close()
        body = save(
            {k: v.to(torch.bfloat16).cpu().contiguous() for k, v in model.state_dict().items()}
        )
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/octet-stream"}
        req = urllib.request.Request(client.base_url + "/update_weights", body, headers)
        assert urllib.request.urlopen(req, timeout=60).status == 200
        assert client.generate([ids], GREEDY)[0].token_ids == pushed != before
    finally:
        proc.p.kill()
        proc.p.wait(30)


def test_an_update_with_one_bad_tensor_loads_none_of_it(admin, client):
    """All or nothing: the good tensor before the bad one is not loaded either."""
    client.init_communicator("gloo", timeout_s=30)
    norm = admin.call(_norm_weight)
    version = admin.llm.weights_version
    bad = [("model.norm.weight", norm * 2),
           ("model.layers.0.mlp.down_proj.weight", torch.zeros(3, 3))]
    with pytest.raises(ServerError, match="down_proj") as e:
        client.update_named_params(bad)
    assert e.value.status == 400
    assert torch.equal(admin.call(_norm_weight), norm)
    assert admin.llm.weights_version == version
