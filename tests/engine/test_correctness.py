"""Invariant 1: greedy tokens equal HF transformers'; sampled-token logprobs equal HF's forward."""

import pytest
import torch
from model_fixtures import assert_no_leak, make_tiny_model

from tandem import LLM, SamplingParams

PROMPTS = [[5, 17, 33, 8, 91, 4, 60], [12, 3], list(range(40, 79)), [200, 201, 202, 203, 204, 205, 206, 207]]


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
        do_sample=False, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("llama", {"attention_bias": True, "tie_word_embeddings": True}),
        ("qwen2", {}),  # q/k/v bias
        ("qwen2", {"tie_word_embeddings": True}),
        ("qwen3", {}),  # q/k norm
    ],
)
def test_greedy_matches_hf(arch, overrides):
    model = make_tiny_model(arch, **overrides)
    # small blocks and a small token budget: multi-block tables and chunked prefill
    llm = LLM(model, block_size=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 16)
        assert out.outputs[0].finish_reason == "length"
    assert_no_leak(llm)


def test_output_does_not_depend_on_batch():
    model = make_tiny_model("qwen2")
    llm = LLM(model, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def test_sampled_logprobs_match_hf_forward():
    model = make_tiny_model("llama")
    llm = LLM(model, block_size=4)
    params = SamplingParams(temperature=1.0, max_tokens=12, logprobs=0, seed=3, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        c = out.outputs[0]
        full = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            logits = model(full).logits[0].float()
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(c.token_ids)[:, None])
        got = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
        torch.testing.assert_close(got, ref[:, 0], atol=1e-4, rtol=0)
        assert c.cumulative_logprob == pytest.approx(got.sum().item(), abs=1e-3)


def test_processed_logprobs_follow_temperature():
    model = make_tiny_model("llama")
    llm = LLM(model, logprobs_mode="processed_logprobs")
    prompt = PROMPTS[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.7, max_tokens=4, logprobs=0, seed=1,
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    full = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(full).logits[0].float() / 0.7
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    got = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_smollm2_greedy_matches_hf(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    llm = LLM(smollm2_dir, dtype="float32", max_model_len=512)
    questions = ["What is the capital of France?", "Name three colors.", "Write a haiku about rain."]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids],
                        SamplingParams(temperature=0, max_tokens=20, min_tokens=20), use_tqdm=False)
    for i, out in zip(ids, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, i, 20)
    chat = llm.chat([{"role": "user", "content": questions[0]}], SamplingParams(temperature=0, max_tokens=20),
                    use_tqdm=False)
    assert "Paris" in chat[0].outputs[0].text
    assert chat[0].outputs[0].finish_reason == "stop"
    assert_no_leak(llm)
