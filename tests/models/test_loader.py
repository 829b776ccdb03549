"""Loading from a HF directory, an in-memory model, a preset with dummy weights, and GGUF."""

import torch
from model_fixtures import make_tiny_model

from tandem import LLM, SamplingParams
from tandem.models.loader import load_weights


def test_hf_dir_equals_in_memory(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = LLM(tiny_llama_dir).generate(["The capital of France is"], p, use_tqdm=False)[0]
    b = LLM(hf, tokenizer=tiny_llama_dir).generate(["The capital of France is"], p, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].text == b.outputs[0].text


def test_dummy_preset_runs_without_files():
    llm = LLM("qwen2.5-0.5b", load_format="dummy", max_model_len=64, max_num_seqs=2,
              cpu_kv_cache_space_gib=0.1)
    engine = llm.llm_engine
    assert engine.hf_config.hidden_size == 896 and engine.tokenizer is None
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_load_weights_merges_qkv_and_gate_up():
    model = make_tiny_model("qwen2")
    llm = LLM(model)
    engine_model = llm.llm_engine.model
    attn = engine_model.model.layers[0].self_attn
    new_k = torch.randn_like(model.model.layers[0].self_attn.k_proj.weight)
    load_weights(engine_model, [("model.layers.0.self_attn.k_proj.weight", new_k)])
    start, size = attn.qkv_proj.shard_range("k")
    torch.testing.assert_close(attn.qkv_proj.weight[start : start + size], new_k)


def test_smollm2_default_answers(smollm2_dir):
    llm = LLM(None, max_model_len=256)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert out[0].outputs[0].text.strip() == "The capital of France is Paris."


def test_load_weights_fills_every_shard_of_the_merged_projections():
    """q, k and v land in their own rows of qkv_proj (weights and biases), gate and up in theirs
    of gate_up_proj, and no shard overwrites another."""
    model = make_tiny_model("qwen2")
    llm = LLM(model)
    layer = llm.llm_engine.model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    src_attn, src_mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    new = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        for kind in ("weight", "bias"):
            new[f"model.layers.0.self_attn.{name}.{kind}"] = torch.randn_like(getattr(getattr(src_attn, name), kind))
    for name in ("gate_proj", "up_proj"):
        new[f"model.layers.0.mlp.{name}.weight"] = torch.randn_like(getattr(src_mlp, name).weight)
    load_weights(llm.llm_engine.model, list(new.items()))
    for shard in ("q", "k", "v"):
        start, size = attn.qkv_proj.shard_range(shard)
        torch.testing.assert_close(attn.qkv_proj.weight[start : start + size],
                                   new[f"model.layers.0.self_attn.{shard}_proj.weight"])
        torch.testing.assert_close(attn.qkv_proj.bias[start : start + size],
                                   new[f"model.layers.0.self_attn.{shard}_proj.bias"])
    for shard, name in ((0, "gate_proj"), (1, "up_proj")):
        start, size = mlp.gate_up_proj.shard_range(shard)
        torch.testing.assert_close(mlp.gate_up_proj.weight[start : start + size],
                                   new[f"model.layers.0.mlp.{name}.weight"])
    assert attn.qkv_proj.weight.shape[0] == sum(attn.qkv_proj.shard_range(s)[1] for s in "qkv")
