"""The engine on the GPU: Triton backend and CUDA graphs give the torch reference's tokens."""

import pytest
import torch
from model_fixtures import assert_no_leak, make_tiny_model

from tandem import LLM, SamplingParams

PROMPTS = [[5, 17, 33, 8, 91, 4, 60], [12, 3], list(range(40, 100)), list(range(7, 30))]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter is off where CUDA exists")
def test_triton_backend_matches_torch_backend_on_cpu():
    """The whole engine through the Triton kernels (interpreted on a CPU) equals the reference."""
    model = make_tiny_model("qwen2")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ref = LLM(model, block_size=16, attention_backend="torch").generate(PROMPTS[:2], params, use_tqdm=False)
    tri = LLM(model, block_size=16, attention_backend="triton", device="cpu")
    got = tri.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert_no_leak(tri)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gpu_greedy_equals_torch_reference_fp32(arch):
    model = make_tiny_model(arch, max_position_embeddings=1024)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = LLM(model, block_size=16, attention_backend="torch", device="cpu")
    expected = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]
    gpu_model = make_tiny_model(arch, max_position_embeddings=1024).cuda()
    llm = LLM(gpu_model, block_size=16, gpu_memory_utilization=0.2, max_num_seqs=8)
    assert llm.llm_engine.attention_backend == "triton"
    assert llm.llm_engine.model_runner.graph_runner is not None
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected
    eager = LLM(gpu_model, block_size=16, gpu_memory_utilization=0.2, enforce_eager=True)
    assert [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params, use_tqdm=False)] == expected
    assert_no_leak(llm)


@pytest.mark.gpu
def test_gpu_bf16_agrees_with_hf_bf16():
    """bf16 kernels differ from HF's in rounding only. HF, fed the engine's own greedy tokens, rates
    each one within 0.1 nats of its own best at >= 95% of positions (vLLM's check_logprobs_close
    idea: a mismatch is fine where the two were near a tie); a wrong kernel fails by far."""
    model = make_tiny_model("llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
    model = model.to(device="cuda", dtype=torch.bfloat16)
    llm = LLM(model, gpu_memory_utilization=0.2)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    close = exact = total = 0
    for out, prompt in zip(llm.generate(PROMPTS, params, use_tqdm=False), PROMPTS):
        got = torch.tensor(out.outputs[0].token_ids, device="cuda")
        with torch.no_grad():
            ids = torch.tensor([prompt + got.tolist()], device="cuda")
            lp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
        best = lp.max(-1).values
        ours = lp.gather(1, got[:, None])[:, 0]
        close += (best - ours <= 0.1).sum().item()
        exact += (lp.argmax(-1) == got).sum().item()
        total += got.numel()
    print(f"bf16 vs HF: {exact}/{total} greedy tokens identical, {close}/{total} within 0.1 nats")
    assert close / total >= 0.95, f"{close}/{total}"


@pytest.mark.gpu
def test_gpu_preemption_and_sampling_leave_no_leak():
    model = make_tiny_model("llama").cuda()
    llm = LLM(model, block_size=16, num_gpu_blocks_override=8, max_model_len=128)
    prompts = [list(range(i, i + 40)) for i in range(10)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=60,
                                                ignore_eos=True, seed=1), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_no_leak(llm)
