"""The engine on the GPU: Triton backend and CUDA graphs give the torch reference's tokens."""

import pytest
import torch
from model_fixtures import assert_no_leak, make_tiny_model

from tandem import LLM, SamplingParams
from tandem.layers.linear import linear_fp32_out

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
    # the start-up warm-up's dummy steps write no cache slot and leave the outputs alone
    tri.llm_engine.worker.model_runner.warmup_kernels(tri.llm_engine.max_model_len)
    tri.llm_engine.worker.model_runner.warmup_kernels(4)  # a short context: no query longer than it
    again = tri.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ref]
    assert_no_leak(tri)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter is off where CUDA exists")
def test_balanced_order_and_merge_in_kernel_keep_the_tokens_on_cpu(monkeypatch):
    """With `TANDEM_BALANCED_DECODE` and `TANDEM_FUSED_SPLIT_MERGE` on, eager decode steps launch
    attention in `launch_order` (made once a step) and merge their splits in the kernel: the
    same tokens as the torch reference."""
    from tandem.kernels import decode_attention as decode_kernels
    from tandem.layers import triton_attention

    made = []

    def spy(seq_lens, batch, *args):
        made.append(list(seq_lens))
        return decode_kernels.launch_order(seq_lens, batch, *args)

    monkeypatch.setattr(decode_kernels, "BALANCED_ORDER", True)
    monkeypatch.setattr(decode_kernels, "FUSED_MERGE", True)
    monkeypatch.setattr(triton_attention, "launch_order", spy)
    model = make_tiny_model("qwen2")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2][:33]]
    ref = LLM(model, block_size=16, attention_backend="torch").generate(prompts, params, use_tqdm=False)
    tri = LLM(model, block_size=16, attention_backend="triton", device="cpu")
    made.clear()
    got = tri.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert made and all(len(lens) == 3 for lens in made), made  # once a decode step, not a layer
    assert len(made) == 3  # 4 tokens: the first from the prompt step, then 3 decode steps
    assert_no_leak(tri)


@pytest.mark.gpu
def test_gpu_balanced_order_keeps_the_tokens_bit_for_bit(monkeypatch):
    """Graphs captured to take an order (`TANDEM_BALANCED_DECODE`), replayed with each step's
    order, in windows and alone: the default engine's tokens, greedy, bf16, lengths 2 to 200
    (an order moves programs, not a bit of the output)."""
    from tandem.kernels import decode_attention as decode_kernels

    model = make_tiny_model("qwen2", max_position_embeddings=1024).to(device="cuda", dtype=torch.bfloat16)
    prompts = [list(range(3 + i, 3 + i + 2 + (i * 37) % 199)) for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def tokens(**kwargs):
        llm = LLM(model, block_size=16, gpu_memory_utilization=0.2, max_num_seqs=24, **kwargs)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_no_leak(llm)
        return out, llm.llm_engine.worker.model_runner.graph_runner

    want, plain = tokens()
    assert not plain.ordered
    monkeypatch.setattr(decode_kernels, "BALANCED_ORDER", True)
    got, graphs = tokens()
    assert graphs.ordered and graphs.num_replays["decode"] > 0
    assert got == want
    one_step, _ = tokens(num_scheduler_steps=1)
    assert one_step == want


@pytest.mark.gpu
def test_gpu_fused_split_merge_greedy_equals_torch_reference_fp32(monkeypatch):
    """Splits merged in the attention kernel (`TANDEM_FUSED_SPLIT_MERGE`; its sums in another
    order than the merge kernel's): in fp32, the torch reference's greedy tokens."""
    from tandem.kernels import decode_attention as decode_kernels

    monkeypatch.setattr(decode_kernels, "FUSED_MERGE", True)
    model = make_tiny_model("qwen2", max_position_embeddings=1024)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = LLM(model, block_size=16, attention_backend="torch", device="cpu")
    expected = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM(make_tiny_model("qwen2", max_position_embeddings=1024).cuda(), block_size=16,
              gpu_memory_utilization=0.2, max_num_seqs=8)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected
    assert_no_leak(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gpu_greedy_equals_torch_reference_fp32(arch):
    model = make_tiny_model(arch, max_position_embeddings=1024)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = LLM(model, block_size=16, attention_backend="torch", device="cpu")
    expected = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]
    gpu_model = make_tiny_model(arch, max_position_embeddings=1024).cuda()
    llm = LLM(gpu_model, block_size=16, gpu_memory_utilization=0.2, max_num_seqs=8)
    assert llm.llm_engine.worker.attention_backend == "triton"
    assert llm.llm_engine.worker.model_runner.graph_runner is not None
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected
    eager = LLM(gpu_model, block_size=16, gpu_memory_utilization=0.2, enforce_eager=True)
    assert [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params, use_tqdm=False)] == expected
    assert_no_leak(llm)


@pytest.mark.gpu
def test_gpu_mixed_step_graphs_equal_eager_steps():
    """Requests arriving while others decode make mixed steps (prefill chunks beside decode rows)
    of many sizes: replayed from the token-count graphs, their tokens equal an eager engine's, and
    a step larger than the ladder runs eagerly."""
    model = make_tiny_model("qwen2", max_position_embeddings=1024).cuda()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [list(range(3 + i, 3 + i + 5 + 37 * (i % 7))) for i in range(24)]

    def run(**kwargs):
        llm = LLM(model, block_size=16, gpu_memory_utilization=0.2, max_num_seqs=16,
                  max_num_batched_tokens=300, **kwargs)
        engine, done = llm.llm_engine, {}
        for i, prompt in enumerate(prompts):  # three arrivals per step
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
            if i % 3 == 2:
                done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        assert_no_leak(llm)
        return [done[str(i)] for i in range(len(prompts))], engine.worker.model_runner.graph_runner

    got, graphs = run(max_cudagraph_capture_size=256)
    assert graphs.num_replays["mixed"] > 0 and graphs.num_replays["decode"] > 0
    assert max(graphs.mixed_graphs) == 256  # steps of 257-300 tokens ran eagerly
    expected, no_graphs = run(enforce_eager=True)
    assert no_graphs is None
    assert got == expected


@pytest.mark.gpu
@pytest.mark.parametrize("hidden_size,num_heads,num_layers,init_scale", [(256, 8, 4, 1.0), (512, 4, 2, 0.5)])
def test_gpu_bf16_agrees_with_hf_bf16(hidden_size, num_heads, num_layers, init_scale):
    """bf16 kernels differ from HF's in rounding only. HF, fed the engine's own greedy tokens, rates
    each one within 0.1 nats of its own best at >= 95% of positions (vLLM's check_logprobs_close
    idea: a mismatch is fine where the two were near a tie); a wrong kernel fails by far.
    Heads of 32 and of 128 dims: two 128-dim kv heads take the batch-sized decode attention
    configs (`decode_config`).
    The 128-dim model's weights are scaled down so that bf16 itself is not chaotic there (HF bf16
    rated by HF fp32: 128/128 within 0.1 nats; at full scale and 1,024 wide only 98/128)."""
    model = make_tiny_model("llama", vocab_size=512, hidden_size=hidden_size, intermediate_size=512,
                            num_hidden_layers=num_layers, num_attention_heads=num_heads,
                            num_key_value_heads=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(init_scale)
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


def _compiled_triton_variants() -> dict[str, int]:
    """Compiled variants of every Triton kernel of tandem (`JITFunction.device_caches`)."""
    import importlib

    import triton

    counts = {}
    for name in ("activation", "decode_attention", "decode_gemm", "kv_cache", "prefill_attention",
                 "rmsnorm", "rotary", "sampling"):
        module = importlib.import_module(f"tandem.kernels.{name}")
        for attr, fn in vars(module).items():
            if isinstance(fn, triton.runtime.JITFunction):
                counts[f"{name}.{attr}"] = sum(len(entry[0]) for entry in fn.device_caches.values())
    return counts


def _decode_gemm_table(model, path) -> str:
    """A decode GEMM table sending every linear layer of `model` through the Triton kernel up to
    64 rows, as the shipped tables do for the presets' shapes (two configs, one with split-K)."""
    import json

    from tandem.bench.gemm import decode_shapes

    shapes = [(s["N"], s["K"]) for s in decode_shapes(model)]
    small = {"block_m": 16, "block_n": 32, "block_k": 64, "split_k": 2, "num_warps": 4, "num_stages": 3}
    wide = {"block_m": 64, "block_n": 64, "block_k": 64, "split_k": 1, "num_warps": 4, "num_stages": 3}
    path.write_text(json.dumps({"device": "test", "dtype": "bfloat16", "shapes": {
        f"{n},{k}": [{"max_m": 4, "backend": "triton", "config": small},
                     {"max_m": 64, "backend": "triton", "config": wide}] for n, k in shapes}}))
    return str(path)


@pytest.mark.gpu
def test_no_kernel_compiles_after_start_up(tmp_path):
    """Once the engine is built, batches of every shape run compiled kernels: nothing compiles
    between tokens (a compile stalls every request in flight for about a second). The decode
    GEMM runs every linear layer up to 64 rows here, as `decode_gemm="auto"` does on an H200."""
    model = make_tiny_model("qwen2", max_position_embeddings=1024).to(device="cuda", dtype=torch.bfloat16)
    table = _decode_gemm_table(model, tmp_path / "table.json")
    llm = LLM(model, block_size=16, gpu_memory_utilization=0.2, max_num_seqs=64, decode_gemm=table)
    assert llm.llm_engine.worker.decode_gemm_layers > 0
    assert llm.llm_engine.worker.kernel_warmup_s is not None
    before = _compiled_triton_variants()
    assert sum(before.values()) > 0
    prompts = [[(7 * i + j) % 300 + 3 for j in range(1 + (i * 37) % 150)] for i in range(64)]
    for n, temperature, logprobs in [(1, 0, None), (3, 1.0, 0), (17, 0.7, None), (64, 1.0, 0), (50, 0, 0)]:
        params = SamplingParams(temperature=temperature, max_tokens=1 + n % 9, ignore_eos=True,
                                logprobs=logprobs, seed=n)
        llm.generate(prompts[:n], params, use_tqdm=False)
    # requests joining a running batch: mixed prefill + decode steps of many sizes
    eng = llm.llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(None, p, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), "final_only")
        eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    assert _compiled_triton_variants() == before
    assert_no_leak(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("switched_on", [False, True])
def test_gpu_smollm2_bf16_greedy_agrees_with_hf_bf16(smollm2_dir, switched_on, monkeypatch):
    """The embedded default in bf16 on the GPU (Triton kernels, CUDA graphs) against HF's bf16
    forward, its logits taken from the fp32 accumulator as the engine's lm_head returns them: fed
    the engine's own greedy tokens, HF picks the same token, or one within a near-tie of it, at
    >= 95% of the first 32 positions of every prompt taken together (a divergence after a
    near-tie does not cascade). 2026-12-01, H200: 182/192 exact. Six rows split their keys: with
    the thirteenth session's switches off and on (`TANDEM_FUSED_SPLIT_MERGE`,
    `TANDEM_BALANCED_DECODE`, `TANDEM_FUSED_SILU_DOWN`)."""
    from tandem.kernels import decode_attention
    from tandem.layers import linear as linear_layers

    monkeypatch.setattr(decode_attention, "FUSED_MERGE", switched_on)
    monkeypatch.setattr(decode_attention, "BALANCED_ORDER", switched_on)
    monkeypatch.setattr(linear_layers, "FUSED_SILU_DOWN", switched_on)  # the H200 table: 1-32 rows
    _smollm2_greedy_against_hf(smollm2_dir)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize("fused_activation", [False, True])
def test_gpu_smollm2_on_the_cluster_gemm_agrees_with_hf_bf16(smollm2_dir, tmp_path, fused_activation):
    """The same with every linear layer of the decode steps on Hopper's cluster GEMM
    (`kernels/sm90_gemm`, a table naming it up to 256 rows: 64-row tiles up to 64 rows, then
    two 128-row tiles sharing each weight tile, K split where the default splits it); and with
    the MLP's gate/up GEMM computing SiLU-and-mul in its epilogue (`sm90-glu`)."""
    import json
    from dataclasses import asdict

    from tandem.bench.gemm import decode_shapes
    from tandem.kernels.sm90_gemm import default_config

    def entry(m, op, n, k):
        glu = fused_activation and op == "gate_up"
        return {"max_m": m, "backend": "sm90-glu" if glu else "sm90",
                "config": asdict(default_config(m, n // 2 if glu else n, k, glu=glu))}

    table = tmp_path / "sm90.json"
    table.write_text(json.dumps({"device": "test", "dtype": "bfloat16", "shapes": {
        f"{s['N']},{s['K']}": [entry(m, s["op"], s["N"], s["K"]) for m in (64, 256)]
        for s in decode_shapes(smollm2_dir)}}))
    _smollm2_greedy_against_hf(smollm2_dir, decode_gemm=str(table), min_gemm_layers=4 * 30)


def _smollm2_greedy_against_hf(smollm2_dir, min_gemm_layers=0, **engine_kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).cuda().eval()
    llm = LLM(smollm2_dir, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.2,
              **engine_kwargs)
    assert llm.llm_engine.worker.decode_gemm_layers >= min_gemm_layers
    questions = ["What is the capital of France?", "Name three colors.", "Write a haiku about rain.",
                 "What is 17 + 25?", "Explain photosynthesis in one sentence.", "List two prime numbers."]
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                              tokenize=False), add_special_tokens=False) for q in questions]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids],
                        SamplingParams(temperature=0, max_tokens=32, min_tokens=32), use_tqdm=False)
    same = near = total = 0
    for prompt, out in zip(ids, outs):
        got = torch.tensor(out.outputs[0].token_ids)
        with torch.no_grad():  # HF's bf16 hidden states, scored in fp32 as the engine's lm_head does
            hidden = hf.model(torch.tensor([prompt + got.tolist()], device="cuda")).last_hidden_state
            logits = linear_fp32_out(hidden[0, len(prompt) - 1 : -1], hf.lm_head.weight).cpu()
        exact = logits.argmax(-1) == got
        # vLLM's check_logprobs_close: a different pick counts when it is a near-tie for HF too
        # (within 0.1 of HF's best logit, under a bf16 step at these logits' size)
        gap = logits.max(-1).values - logits.gather(1, got[:, None]).squeeze(1)
        same += exact.sum().item()
        near += (~exact & (gap < 0.1)).sum().item()
        total += len(got)
    print(f"SmolLM2 bf16 vs HF bf16: {same}/{total} greedy tokens agree, {near} more are near-ties")
    assert (same + near) / total >= 0.95 and same / total >= 0.9, f"{same}+{near}/{total}"
    assert_no_leak(llm)
