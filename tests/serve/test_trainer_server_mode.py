"""GRPO with vllm_mode="server": rollouts from a `tandem serve` process, weights pushed to it."""

import re

import pytest
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem import LLM, SamplingParams
from tandem.rl import GRPOConfig, GRPOTrainer
from tandem.rl.data import PromptBatch
from tandem.sampling_params import StructuredOutputsParams

from .helpers import run_server

KEY = "sk-trainer-key"


def reward_len(completions, completion_ids, **kwargs):
    return [len(ids) / 8 for ids in completion_ids]


def test_server_mode_trains_and_the_server_generates_with_the_new_weights(tiny_llama_dir, tmp_path):
    app_kwargs = {"api_key": KEY, "enable_admin_api": True}
    with run_server(tiny_llama_dir, app_kwargs, block_size=4) as server:
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
        args = GRPOConfig(
            output_dir=str(tmp_path), vllm_mode="server", vllm_server_base_url=server.url,
            vllm_server_api_key=KEY, num_generations=4, per_device_train_batch_size=8, max_completion_length=8,
            max_prompt_length=32, learning_rate=5e-3, max_steps=2, report_to="none", gradient_checkpointing=False,
            lr_scheduler_type="constant", save_steps=10**6,
        )
        prompts = ["Hello, my name is", "The capital of France is", "one two three", "small model"]
        trainer = GRPOTrainer(model, reward_len, args, train_dataset=Dataset.from_dict({"prompt": prompts}),
                              processing_class=tok)
        assert trainer.llm is None  # no engine in the trainer's process
        for _ in range(2):
            metrics = trainer.step()
        assert metrics["engine/weights_version"] == 2  # one push before each rollout
        trainer.generator.sync()  # push the weights of the last optimizer step
        ids = tok.encode("The capital of France is")
        served = trainer.generator.client.generate([ids], {"temperature": 0, "max_tokens": 8})[0].token_ids
        offline = LLM(trainer.model, tokenizer=tok, device="cpu").generate(
            [{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert served == offline[0].outputs[0].token_ids
        # vllm_structured_outputs_regex's path in server mode: the regex rides on each request
        pytest.importorskip("llguidance")
        so = StructuredOutputsParams(regex="(yes|no|maybe)")
        texts, _ = trainer.generator.greedy([ids], 8, so)
        batch = PromptBatch([0, 1], prompts[:2], prompts[:2], [ids, tok.encode("one two three")], {})
        rollout = trainer.generator.rollout(batch, 3, SamplingParams(temperature=1.0, max_tokens=8,
                                                                     structured_outputs=so), seed=0, offset=0)
        assert all(re.fullmatch("(yes|no|maybe)", t) for t in texts + rollout.texts), texts + rollout.texts
        trainer.generator.client.close()
