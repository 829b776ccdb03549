"""LLM: vLLM's offline API (`generate`, `chat`) over one LLMEngine."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
from tqdm.auto import tqdm

from tandem.config import EngineConfig
from tandem.engine.executor import start_workers
from tandem.engine.gc_pause import frozen_heap
from tandem.engine.llm_engine import LLMEngine, PromptType
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams


class LLM:
    """Offline generation. `model` is a local HF dir, a .gguf file, an architecture name (with
    load_format="dummy"), an in-memory transformers model, or None for the embedded default."""

    def __init__(self, model=None, tokenizer=None, **kwargs):
        tok_obj = None
        if tokenizer is not None and not isinstance(tokenizer, str):
            tok_obj, tokenizer = tokenizer, None
        hf_model = model if isinstance(model, torch.nn.Module) else None
        self.config = EngineConfig.from_kwargs(
            model=None if hf_model is not None else model, tokenizer=tokenizer, **kwargs
        )
        # tensor parallel without a process group: spawn ranks 1..N-1, each runs what `mirror` sends
        self.tp_workers, hf_model = start_workers(self.config, hf_model, tok_obj, type(self))
        self.llm_engine = LLMEngine(self.config, model=hf_model, tokenizer=tok_obj)
        if self.tp_workers is not None:
            self.tp_workers.attach(self.llm_engine.worker.model_runner)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order."""
        prompts = self._as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params: got {len(params)} for {len(prompts)} prompts; pass one or one per prompt"
                )
        if self.tp_workers is not None:  # tensor parallel: spawned ranks make the same call
            self.tp_workers.mirror("generate", prompts, params)
        engine = self.llm_engine
        engine.worker.check_awake()
        # Check everything before queueing anything, so bad input leaves the engine untouched.
        tokenized = []
        for p, sp in zip(prompts, params):
            text, ids = engine.tokenize_prompt(p)
            engine.validate_request(ids, sp)
            tokenized.append({"prompt": text, "prompt_token_ids": ids})
        ids = [engine.add_request(None, t, sp, output_kind="final_only") for t, sp in zip(tokenized, params)]
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to conversations rendered through the tokenizer's chat template."""
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat() needs a tokenizer; this model has none")
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError("chat(): the tokenizer has no chat template; pass chat_template=...")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in convs:
            text = tok.apply_chat_template(
                conv, chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
            )
            ids = tok.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    # -- colocation: the engine shares its device with a trainer ----------------------------------
    def sleep(self, level: int = 1) -> dict:
        """Level 1: offload weights to pinned host memory and free the KV cache; level 2: free both."""
        if self.tp_workers is not None:  # tensor parallel: spawned ranks make the same call
            self.tp_workers.mirror("sleep", level)
        return self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> dict:
        """Restore `tags` ("weights", "kv_cache"; default both)."""
        if self.tp_workers is not None:  # tensor parallel: spawned ranks make the same call
            self.tp_workers.mirror("wake_up", tags)
        return self.llm_engine.wake_up(tags)

    def load_weights(self, weights) -> int:
        """Load an iterable of (HF name, tensor) in place; merged q/k/v and gate/up handled."""
        if self.tp_workers is not None:  # tensor parallel: not mirrored, raises a clear error
            self.tp_workers.mirror("load_weights")
        return self.llm_engine.load_weights(weights)

    def update_weights_from_model(self, model: torch.nn.Module) -> int:
        """Copy a trainer's HF model into the engine, device to device."""
        if self.tp_workers is not None:  # tensor parallel: not mirrored, raises a clear error
            self.tp_workers.mirror("update_weights_from_model")
        return self.llm_engine.update_weights_from_model(model)

    def memory_report(self) -> dict:
        return self.llm_engine.memory_report()

    def reset_prefix_cache(self) -> None:
        if self.tp_workers is not None:  # tensor parallel: spawned ranks make the same call
            self.tp_workers.mirror("reset_prefix_cache")
        self.llm_engine.reset_prefix_cache()

    def _as_list(self, prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            with frozen_heap():
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            bar.update(1)
        except BaseException:
            engine.abort_request(list(engine.requests))  # never leave blocks behind
            raise
        finally:
            bar.close()
        return [results[r] for r in request_ids]
