"""The graph runner's padding and static buffers, on a CPU: each "graph" re-runs the forward it
would have captured (through the Triton kernels, interpreted), so a step padded up to a ladder size
must give the tokens of an eager step."""

import os

import pytest
import torch
from model_fixtures import assert_no_leak, make_tiny_model

from tandem import LLM, SamplingParams
from tandem.engine.cuda_graph import CUDAGraphRunner, capture_sizes, mixed_capture_sizes
from tandem.layers.sampler import Sampler

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton interpreter (tests/conftest.py) runs on CPUs only")


class ReplayByRerun:
    """Stands in for a captured graph: replay runs the same forward into the same output."""

    def __init__(self, forward, size):
        self.forward, self.size = forward, size
        self.out = forward(size)

    def replay(self):
        self.out.copy_(self.forward(self.size))

    def reset(self):
        pass


@pytest.fixture
def rerun_graphs(monkeypatch):
    def capture_one(self, forward, size):
        graph = ReplayByRerun(forward, size)
        return graph, graph.out

    monkeypatch.setattr(CUDAGraphRunner, "_capture_one", capture_one)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)


def test_ladders():
    assert capture_sizes(256)[:4] == [1, 2, 4, 8] and capture_sizes(256)[-1] == 256
    assert capture_sizes(20)[-1] == 20
    assert mixed_capture_sizes(0) == []
    assert mixed_capture_sizes(4096)[-1] == 4096 and mixed_capture_sizes(300)[-1] == 256
    sizes = mixed_capture_sizes(8192)
    assert all(b / a <= 1.5 for a, b in zip(sizes[3:], sizes[4:]))  # bounded padding waste


def generate(model, prompts, params, max_num_seqs, max_num_batched_tokens, graph_tokens=None,
             arrivals_per_step=None):
    """Greedy tokens of every prompt, and the graph runner (None: eager). `graph_tokens`: capture
    (re-run) graphs with mixed steps up to that many tokens; `arrivals_per_step`: step after every
    that many new requests, so later prompts join a running batch (None: all arrive first)."""
    llm = LLM(model, block_size=8, attention_backend="triton", device="cpu", max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens)
    engine = llm.llm_engine
    runner = None
    if graph_tokens is not None:
        runner = CUDAGraphRunner(engine.model, max_num_seqs, -(-engine.max_model_len // 8), engine.device,
                                 graph_tokens)
        runner.capture()
        engine.worker.model_runner.graph_runner = runner
    done = {}

    def step():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})

    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        if arrivals_per_step and (i + 1) % arrivals_per_step == 0:
            step()
    while engine.has_unfinished_requests():
        step()
    assert_no_leak(llm)
    return [done[str(i)] for i in range(len(prompts))], runner


def test_padded_graph_steps_equal_eager_steps(rerun_graphs):
    model = make_tiny_model("qwen2")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [list(range(3 + i, 3 + i + 2 + 9 * (i % 4))) for i in range(7)]
    # two arrivals per step: steps mix prefill and decode
    got, runner = generate(model, prompts, params, 4, 40, graph_tokens=32, arrivals_per_step=2)
    assert runner.num_replays["mixed"] > 0 and runner.num_replays["decode"] > 0
    expected, _ = generate(model, prompts, params, 4, 40, arrivals_per_step=2)
    assert got == expected


def test_decode_shaped_step_with_a_prefill_chunk_samples_the_right_rows(rerun_graphs, monkeypatch):
    """A step of one token per sequence where one of them is a 1-token chunk of a longer prompt
    has the decode shape (and replays a decode graph) but samples fewer rows than it computes:
    the sampler gets the logits of the sampling rows only."""
    forward = Sampler.forward

    def checked(self, logits, meta):
        assert logits.shape[0] == meta.temperature.shape[0], "a logits row per sampled row"
        return forward(self, logits, meta)

    monkeypatch.setattr(Sampler, "forward", checked)
    model = make_tiny_model("qwen2")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 11], [7, 3], list(range(20, 29))]
    got, runner = generate(model, prompts, params, 3, 3, graph_tokens=0)
    assert runner.num_replays["decode"] > 0
    expected, _ = generate(model, prompts, params, 3, 3)
    assert got == expected
