"""Where rollouts come from, chosen once per trainer (`GRPOConfig.vllm_mode`).

colocate: tandem's engine in this process, on this GPU: wake, sync weights in place, generate, sleep.
server:   a `tandem serve` process on other GPUs: weights pushed over a collective group, rollouts
          over HTTP. The trainer is otherwise the same.
"""

from __future__ import annotations

from tandem.rl.data import PromptBatch
from tandem.rl.rollout import Rollout, generate_rollout
from tandem.sampling_params import SamplingParams
from tandem.weights.sync import WeightSync


class ColocatedGenerator:
    def __init__(self, llm, model, sleep_level: int | None, weights=None, check=None):
        self.llm = llm
        self.weight_sync = WeightSync(llm, model, weights, check)
        self.sleep_level = sleep_level  # None: never sleep

    @property
    def weights_version(self) -> int:
        return self.llm.llm_engine.weights_version

    def mark_stale(self) -> None:
        self.weight_sync.mark_stale()

    def sync(self) -> None:
        self.weight_sync.sync()  # wakes the engine and copies the trainer's weights in place

    def rollout(self, batch: PromptBatch, num_generations: int, params: SamplingParams, seed: int,
                offset: int) -> Rollout:
        rollout = generate_rollout(self.llm, batch, num_generations, params, seed, offset)
        self.release()
        return rollout

    def greedy(self, prompt_ids: list[list[int]], max_tokens: int,
               structured_outputs=None) -> tuple[list[str], list[list[int]]]:
        greedy = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=structured_outputs)
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], greedy, use_tqdm=False)
        self.release()
        return [o.outputs[0].text for o in outs], [o.outputs[0].token_ids for o in outs]

    def release(self) -> None:
        if self.sleep_level:
            self.llm.sleep(self.sleep_level)


class ServerGenerator:
    """Rollouts from a `tandem serve` started with --enable-admin-api (and, for IS correction at
    temperature != 1, --logprobs-mode processed_logprobs)."""

    def __init__(self, client, model, backend: str, dtype=None):
        self.client = client
        self.model = model
        self.dtype = dtype  # weights are sent in the engine's dtype (bf16 halves the bytes of fp32)
        self.client.init_communicator(backend)
        self.stale = True
        self.weights_version = 0

    def mark_stale(self) -> None:
        self.stale = True

    def sync(self) -> None:
        if self.stale:
            self.client.push_weights(self.model, dtype=self.dtype)
            self.weights_version += 1
            self.stale = False

    def rollout(self, batch: PromptBatch, num_generations: int, params: SamplingParams, seed: int,
                offset: int) -> Rollout:
        body = {"n": num_generations, "temperature": params.temperature, "top_p": params.top_p,
                "top_k": params.top_k, "min_p": params.min_p, "max_tokens": params.max_tokens,
                "repetition_penalty": params.repetition_penalty, "seed": seed + offset * num_generations,
                **_structured(params.structured_outputs)}
        r = Rollout([], [], [], [], [])
        for c in self.client.generate(batch.prompt_ids, body):
            r.prompt_ids.append(batch.prompt_ids[c.prompt_index])
            r.completion_ids.append(list(c.token_ids))
            r.engine_logps.append(list(c.logprobs or [0.0] * len(c.token_ids)))
            r.truncated.append(c.finish_reason == "length")
            r.texts.append(c.text)
        return r

    def greedy(self, prompt_ids: list[list[int]], max_tokens: int,
               structured_outputs=None) -> tuple[list[str], list[list[int]]]:
        outs = self.client.generate(prompt_ids, {"temperature": 0, "max_tokens": max_tokens,
                                                 **_structured(structured_outputs)})
        return [c.text for c in outs], [c.token_ids for c in outs]

    def release(self) -> None:
        pass


def _structured(so) -> dict:
    """The trainer's regex as vLLM's `structured_outputs` extra field of a /v1/completions request."""
    return {} if so is None else {"structured_outputs": {"regex": so.regex}}
