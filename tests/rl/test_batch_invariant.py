"""batch_invariant: the engine's sampling logprobs and the trainer's scorer agree bit for bit
(CPU: the Triton kernels in the interpreter, which tests/conftest.py turns on)."""

import pytest
import torch
from model_fixtures import make_tiny_model, make_tokenizer

from tandem import LLM, SamplingParams, batch_invariant
from tandem.rl import GRPOConfig
from tandem.rl.data import PromptBatch
from tandem.rl.rollout import generate_rollout, pack
from tandem.rl.scorer import BatchInvariantScorer
from tests.rl.test_trainer import make_trainer


@pytest.fixture(autouse=True)
def _restore_mode():
    with batch_invariant.enabled(False):  # the engine turns it on process-wide; undo after each test
        yield


def _engine_and_scorer(model, llm, prompts, params, device, dtype):
    """The engine's rollout (packed), a scorer on the same weights, and its logprobs of it."""
    batch = PromptBatch(list(range(len(prompts))), prompts, [""] * len(prompts), prompts, {})
    data = pack(generate_rollout(llm, batch, params.n, params, seed=params.seed), 0, torch.device(device))
    scorer = BatchInvariantScorer(model.config, llm.llm_engine.max_model_len, torch.device(device),
                                  lambda: model.state_dict().items(), dtype)
    got = scorer.logps(data["input_ids"], data["attention_mask"], data["prompt_lengths"],
                       data["completion_mask"].shape[1], params.temperature)
    return data, scorer, got


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases in the q/k/v GEMM's epilogue
def test_scorer_equals_engine_logprobs_exactly(arch, tmp_path):
    model = make_tiny_model(arch, seed=1)
    # Chunked prefill (8-token budget), prefix-cache hits (n=3 of one prompt) and batches of
    # changing size: none of it may move a token's logprob.
    llm = LLM(model, tokenizer=make_tokenizer(), dtype="float32", device="cpu", batch_invariant=True,
              max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64, logprobs_mode="processed_logprobs")
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36]]
    params = SamplingParams(n=3, max_tokens=7, temperature=0.8, logprobs=0, seed=4, ignore_eos=True)
    data, scorer, got = _engine_and_scorer(model, llm, prompts, params, "cpu", torch.float32)
    mask = data["completion_mask"].bool()
    assert mask.sum() == 9 * 7
    assert torch.equal(got[mask], data["engine_logp"][mask])
    # one row alone, or the rows in another order: the same values
    alone = scorer.logps(data["input_ids"][4:5], data["attention_mask"][4:5], data["prompt_lengths"][4:5],
                         data["completion_mask"].shape[1], 0.8)
    assert torch.equal(alone, got[4:5])


def test_trainer_with_batch_invariant_agrees_exactly(tmp_path):
    """On-policy steps: the trainer's values are the engine's, to the bit, at the first step and
    after an update (the scorer reloads the weights the engine was synced with)."""
    trainer = make_trainer(tmp_path, max_steps=2, bf16=False, batch_invariant=True, num_generations=4,
                           per_device_train_batch_size=16, gradient_accumulation_steps=1, max_completion_length=4)
    for step in range(2):
        m = trainer.step()
        assert m["sampling/sampling_logp_difference/max"] == 0.0, (step, m)
        assert m["sampling/importance_sampling_ratio/mean"] == 1.0
        assert trainer.update.scorer.stale  # the optimizer step changed the weights: reload next time
    assert trainer.llm.llm_engine.weights_version == 2


@pytest.mark.parametrize("field,value", [("top_p", 0.9), ("top_k", 5), ("min_p", 0.1),
                                         ("repetition_penalty", 1.1), ("vllm_mode", "server")])
def test_what_the_scorer_cannot_follow_is_refused(field, value, tmp_path):
    extra = {"vllm_server_base_url": "http://127.0.0.1:1"} if field == "vllm_mode" else {}
    with pytest.raises(ValueError, match=field):
        GRPOConfig(output_dir=str(tmp_path), batch_invariant=True, **{field: value}, **extra)


def test_engine_refuses_what_it_cannot_make_invariant(monkeypatch):
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        LLM(make_tiny_model("llama"), device="cpu", batch_invariant=True, tensor_parallel_size=2)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        batch_invariant.check_supported("cpu")


@pytest.mark.gpu
def test_smollm2_bf16_engine_and_scorer_agree_on_the_gpu(smollm2_dir):
    """The real model in bf16 with CUDA graphs, prefix caching and 64 rows of changing lengths:
    every sampled token's logprob equals the scorer's to the bit."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).cuda()
    llm = LLM(smollm2_dir, dtype="bfloat16", batch_invariant=True, gpu_memory_utilization=0.3,
              logprobs_mode="processed_logprobs", max_model_len=512)
    tok = llm.get_tokenizer()
    prompts = [tok(f"What is {a} + {b}? Answer with the number.")["input_ids"] for a, b in
               [(3, 4), (12, 30), (7, 7), (41, 2), (19, 23), (5, 0), (33, 11), (8, 27)]]
    params = SamplingParams(n=8, max_tokens=48, temperature=1.0, logprobs=0, seed=0)
    data, _, got = _engine_and_scorer(model, llm, prompts, params, "cuda", torch.bfloat16)
    mask = data["completion_mask"].bool()
    diff = (got - data["engine_logp"]).abs()[mask]
    print(f"batch_invariant bf16: {int(mask.sum())} tokens, max |dlogp| {diff.max().item():.3g}")
    assert torch.equal(got[mask], data["engine_logp"][mask])
