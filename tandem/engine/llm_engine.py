"""LLMEngine: requests in, RequestOutputs out; one `step()` runs one batch through the model."""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterable

import torch

from tandem.config import EngineConfig
from tandem.engine.async_output import AsyncSamplerOutput
from tandem.engine.block_manager import BlockManager
from tandem.engine.output_processor import OUTPUT_KINDS, OutputProcessor, RequestState
from tandem.engine.scheduler import Scheduler, SchedulerOutput
from tandem.engine.sequence import Sequence
from tandem.engine.stop_checker import check_stop, window_tokens_kept
from tandem.engine.structured_output import StructuredOutputManager, check_grammar
from tandem.engine.worker import Worker
from tandem.models.loader import ModelSource, resolve_model
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.weights.check import TensorSpec, specs_of

PromptType = str | list[int] | dict

# A sample whose grammar is complete (either backend) ends as a stop with no stop string, as vLLM's.
GRAMMAR_COMPLETE = ("stop", None)


class LLMEngine:
    """The engine loop of docs/architecture.md: add_request -> step (schedule, run, postprocess) -> outputs.

    The worker owns the device (model, weights, KV cache, graphs, sleep/wake); the engine owns
    the requests: scheduling, the in-flight step, output processing.
    """

    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None, tokenizer=None):
        self.config = config
        source = resolve_model(model if model is not None else config.model, config.load_format,
                               config.trust_remote_code, config.revision)
        self.hf_config = source.hf_config
        self.max_model_len = self._resolve_max_model_len()
        config.check_model_len(self.max_model_len)
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer(source)
        self.worker = Worker(config, source, self.max_model_len)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        if config.num_scheduler_steps is None:  # decode windows where the host runs ahead of the device
            config.num_scheduler_steps = 4 if self.device.type == "cuda" else 1
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            config.enable_chunked_prefill,
            # without graphs no step is cheaper than another: holding prompts back gains nothing
            config.max_admission_delay_steps if self.worker.has_graphs else 0,
            config.num_scheduler_steps,
            config.decode_window_min_seqs or 1,
        )
        # vLLM's async scheduling: on by default where a device runs asynchronously to the host
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda")
        # the launched step whose sampled tokens the host has not read yet
        self._in_flight: tuple[SchedulerOutput, AsyncSamplerOutput] | None = None
        self._drained: list[RequestOutput] = []
        # grammars taking the in-flight step's tokens on the model runner's worker thread: their
        # sequences, and the ones the read-back held back for the verdicts (with their requests)
        self._grammar_rows: list[Sequence] = []
        self._grammar_held: list[tuple[Sequence, RequestState]] = []
        self._grammar_touched: dict[str, RequestState] = {}  # their requests the read-back touched
        self.eos_token_ids = frozenset(self._eos_token_ids())
        self.output_processor = OutputProcessor(self.tokenizer, config.stream_interval)
        self._structured: StructuredOutputManager | None = None  # made at the first constraint
        self._structured_refusal: str | None = None  # ...or why it cannot be
        self._request_counter = itertools.count()
        self.num_generated_tokens = 0
        self.step_stats: dict[str, list] = {"decode": [0, 0.0], "prefill_or_mixed": [0, 0.0]}  # [steps, s]
        # host seconds spent waiting for the device to finish a step (the rest of a step's host
        # time is the host's own work: when it is most of it, the host is the bottleneck)
        self.device_wait_s = 0.0

    # -- the worker's state, as callers read it ------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self.worker.model

    @property
    def device(self) -> torch.device:
        return self.worker.device

    @property
    def num_blocks(self) -> int:
        return self.worker.num_blocks

    @property
    def weights_version(self) -> int:
        return self.worker.weights_version

    @property
    def weights_valid(self) -> bool:
        return self.worker.weights_valid

    @property
    def is_sleeping(self) -> bool:
        return self.worker.sleep_level > 0

    @property
    def requests(self) -> dict[str, RequestState]:
        """The unfinished requests, by id."""
        return self.output_processor.requests

    # -- setup ---------------------------------------------------------------------------------------
    def _resolve_max_model_len(self) -> int:
        model_len = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        if self.config.max_model_len is None:
            return model_len
        if self.config.max_model_len > model_len:
            raise ValueError(
                f"max_model_len ({self.config.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({model_len}); use a value <= {model_len}"
            )
        return self.config.max_model_len

    def _load_tokenizer(self, source: ModelSource):
        path = self.config.tokenizer or source.tokenizer_path
        if path is None:
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, trust_remote_code=self.config.trust_remote_code)

    def _eos_token_ids(self) -> set[int]:
        """The model's end-of-sequence ids (generation config, else model config, else tokenizer):
        the one place they are worked out; each Sequence folds them into its stop set."""
        ids: set[int] = set()
        gen_cfg = None
        path = getattr(self.hf_config, "_name_or_path", None)
        if path:
            try:
                from transformers import GenerationConfig

                gen_cfg = GenerationConfig.from_pretrained(path)
            except (OSError, ValueError):
                gen_cfg = None
        for src in (gen_cfg, self.hf_config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
                break
        if not ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # -- requests ------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; pass token ids instead")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        params.verify()  # again: a field changed after construction must not reach a step
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: must not be empty")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens is too long; max_model_len is {self.max_model_len}, so a prompt "
                f"may have at most {self.max_model_len - 1} tokens"
            )
        vocab = self.hf_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids: ids {bad_stop[:5]} are outside the vocabulary [0, {vocab})")
        bad_bias = [t for t in params.logit_bias or {} if t >= vocab]
        if bad_bias:
            raise ValueError(
                f"logit_bias: ids {bad_bias[:5]} are outside the vocabulary [0, {vocab})")
        if params.logprobs is not None and params.logprobs > 20:
            raise ValueError(f"logprobs must be <= 20, got {params.logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > 20:
            raise ValueError(f"prompt_logprobs must be <= 20, got {params.prompt_logprobs}")
        if params.structured_outputs is not None:
            check_grammar(params.structured_outputs)
        if self.config.host_only:
            needs = [f for f, v in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs),
                                    ("structured_outputs", params.structured_outputs)) if v is not None]
            if needs:
                raise ValueError(f"{', '.join(needs)}: this engine runs with host_only=True (a benchmark "
                                 "of its host work: no logits are computed); send the request without it")

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams,
        output_kind: str = "cumulative",
    ) -> str:
        """Queue a request; raises ValueError (engine state untouched) on bad input."""
        self.worker.check_awake()
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be cumulative, delta or final_only, got {output_kind!r}")
        text, ids = self.tokenize_prompt(prompt)
        self.validate_request(ids, params)
        if request_id is None:
            request_id = str(next(self._request_counter))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        grammars = [None] * params.n
        if params.structured_outputs is not None:
            grammars = self.structured_outputs.sample_grammars(params.structured_outputs, params.n)
        state = RequestState(request_id, text, ids, params, output_kind)
        leader = None
        for i in range(params.n):
            seq = Sequence(ids, params, request_id, i, leader, self.max_model_len, self.eos_token_ids)
            if grammars[i] is not None:
                seq.set_grammar(grammars[i])
            leader = leader or seq
            state.seqs.append(seq)
        self.output_processor.add_request(state)
        for seq in state.seqs:
            self.scheduler.add(seq)
        return request_id

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """Made at the first constrained request; a refusal (no llguidance, a tokenizer it
        misreads) is kept and raised again for each later one, not rebuilt."""
        if self._structured is None:
            if self._structured_refusal is not None:
                raise ValueError(self._structured_refusal)
            try:
                self._structured = StructuredOutputManager(self.tokenizer, self.hf_config.vocab_size,
                                                           self.eos_token_ids,
                                                           self.config.structured_outputs_backend)
            except ValueError as e:
                self._structured_refusal = str(e)
                raise
        return self._structured

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else request_id
        for rid in ids:
            state = self.requests.pop(rid, None)
            self._drained = [o for o in self._drained if o.request_id != rid]
            if state is None:
                continue
            for seq in state.seqs:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the step whose tokens are back.

        Synchronous scheduling returns this step's outputs. With async scheduling the step is
        launched first and the previous step's tokens are read while the device runs it, so the
        host's work hides behind the device's; outputs come one step later, identical otherwise.
        """
        t0 = time.perf_counter()
        in_flight = self._in_flight
        if in_flight is not None and in_flight[1].reads_history:
            self.drain()  # penalties count every output token: no placeholders in the next batch
        elif in_flight is not None and in_flight[1].advances_grammars and in_flight[1].ready():
            # its tokens are back already (the host is the slower side): the grammars take them on
            # the worker while this step is scheduled and launched
            self.worker.model_runner.advance_grammars_async(self._grammar_tokens(*in_flight))
        try:
            sched = self.scheduler.schedule()
            sampled = None if sched.is_empty else self._launch(sched)  # the device starts on it...
        finally:
            self._settle_grammars(in_flight)
        if sched.is_empty:
            if self._in_flight is None:
                self._check_progress()
            self.drain()
            return self._take_drained()
        self.drain()  # ...while the host takes in the previous one's tokens
        self._book(sched, sampled, t0)
        return self._take_drained()

    def _check_progress(self) -> None:
        if self.scheduler.waiting and not self.scheduler.running:
            raise RuntimeError(
                "the KV cache cannot hold even one waiting sequence; lower max_model_len or "
                "raise gpu_memory_utilization"
            )

    def _launch(self, sched: SchedulerOutput) -> AsyncSamplerOutput | None:
        """Run the step on the device, its inputs' placeholders read from the in-flight step.
        Grammars of the in-flight step's constrained rows take its tokens while this step's
        forward runs, before this step samples (their masks need them)."""
        in_flight = self._in_flight
        prev = in_flight[1].token_ids if in_flight is not None else None
        advance = None
        if in_flight is not None and in_flight[1].advances_grammars and not in_flight[1].grammars_advanced:
            advance = functools.partial(self._grammar_tokens, *in_flight)
        # a step with grammar masks reads the in-flight step back while its masks are filled
        sampled = self.worker.execute_model(sched, prev, advance, self.drain if self.async_scheduling else None)
        if sampled is None:  # only prefill chunks that end mid-prompt: nothing sampled
            return None
        runner = self.worker.model_runner
        return AsyncSamplerOutput(sampled, runner.sampling_reads_history,
                                  runner.sampling_advances_grammars)

    def _book(self, sched: SchedulerOutput, sampled: AsyncSamplerOutput | None, t0: float) -> None:
        """The launched step becomes the in-flight one (read back at once without async scheduling)."""
        self.scheduler.update_from_output(sched)
        self._in_flight = (sched, sampled) if sampled is not None else None
        if not self.async_scheduling:
            self.drain()
        stats = self.step_stats["decode" if sched.is_decode_only else "prefill_or_mixed"]
        stats[0] += sched.num_steps
        stats[1] += time.perf_counter() - t0

    def drain(self) -> None:
        """Read back the in-flight step (if any) now; its outputs come with the next `step()`."""
        if self._in_flight is None:
            return
        touched: dict[str, RequestState] = {}
        self._postprocess(*self._in_flight, touched)
        self._in_flight = None
        if self._grammar_held:  # these requests' outputs come with the grammars' verdicts
            held = {state.request_id for _, state in self._grammar_held}
            self._grammar_touched = {rid: st for rid, st in touched.items() if rid in held}
            touched = {rid: st for rid, st in touched.items() if rid not in held}
        self._make_outputs(touched)

    def _make_outputs(self, touched: dict[str, RequestState]) -> None:
        self._drained += [out for st in touched.values() if (out := self.output_processor.make_output(st)) is not None]

    def _take_drained(self) -> list[RequestOutput]:
        out, self._drained = self._drained, []
        return out

    def _postprocess(self, sched: SchedulerOutput, sampled: AsyncSamplerOutput, touched: dict[str, RequestState]) -> None:
        """Take the step's sampled tokens into their sequences; finish the ones that stopped."""
        token_ids, logprobs, topk_ids, topk_lps, ranks = sampled.get()
        self.device_wait_s += sampled.wait_s
        if sampled.prompt_spans:
            self._record_prompt_logprobs(sched, sampled)
        if sampled.num_steps > 1:
            self._postprocess_window(sched, token_ids, logprobs, ranks, touched)
            return
        outputs = self.output_processor
        requests = self.requests
        # the rows sampled, in order (every sequence's in a decode step)
        seqs = sched.seqs if all(sched.sampling) else [s for s, smp in zip(sched.seqs, sched.sampling) if smp]
        filled = 0
        interval = outputs.stream_interval
        for row, seq in enumerate(seqs):
            if not seq.num_placeholders:
                continue  # finished or aborted meanwhile: this row was computed for nothing
            seq.fill_placeholder(token_ids[row], logprobs[row])
            filled += 1
            state = requests[seq.request_id]
            if not seq.has_token_hooks:
                # Most rows: no logprobs, stop strings or grammar. OutputProcessor.output_due's
                # streaming rule is inlined (its call a row of every step cost ~3% of the engine
                # core's CPU a token); test_postprocess_fast_path holds this path to the general one.
                stop = check_stop(seq)
                if stop is not None:
                    self.scheduler.finish(seq, stop[0], stop[1])
                    touched[seq.request_id] = state  # a finished sample is always due
                elif state.output_kind != "final_only":
                    sent = state.sent_tokens[seq.index]
                    if sent == 0 or seq.num_tokens - seq.num_prompt_tokens - sent >= interval:
                        touched[seq.request_id] = state
                continue
            if seq.sampling_params.logprobs is not None:
                outputs.record_logprobs(seq, row, ranks, topk_ids, topk_lps)
            stop = outputs.check_stop(state, seq)
            if seq.fsm is not None and stop is None and seq.fsm.advance(token_ids[row]):
                stop = GRAMMAR_COMPLETE
            if seq.matcher is not None and stop is None:
                if sampled.grammar_verdicts_pending:  # its grammar is taking the token now
                    self._grammar_held.append((seq, state))
                    continue
                if not sampled.grammars_advanced:
                    self._advance_grammar(seq, token_ids[row])
                stop = seq.grammar_stop
            if stop is not None:
                self.scheduler.finish(seq, stop[0], stop[1])
            if outputs.output_due(state, seq):
                touched[seq.request_id] = state
        self.num_generated_tokens += filled

    def _postprocess_window(self, sched: SchedulerOutput, token_ids: list[list[int]], logprobs: list[list[float]],
                            ranks: list[list[int]] | None, touched: dict[str, RequestState]) -> None:
        """A decode window's K tokens a sequence (every row sampled): each sample keeps them up
        to the token that ends it and then ends as it would have token by token. A stop token is
        found in the ids at once; stop strings are matched in the text as it grows, token by
        token (the window let nothing else end a sample: `Scheduler._decode_window`)."""
        outputs = self.output_processor
        filled = 0
        for row, (seq, ids, lps) in enumerate(zip(sched.seqs, token_ids, logprobs)):
            if not seq.num_placeholders:
                continue  # finished or aborted meanwhile
            state = self.requests[seq.request_id]
            if seq.sampling_params.stop_strings:
                keep, stop = 0, None
                while stop is None and keep < len(ids):
                    seq.fill_placeholder(ids[keep], lps[keep])
                    keep += 1
                    stop = outputs.check_stop(state, seq)
                    if seq.fsm is not None and stop is None and seq.fsm.advance(ids[keep - 1]):
                        stop = GRAMMAR_COMPLETE
            else:
                keep = window_tokens_kept(seq, ids)
                complete = False
                if seq.fsm is not None:  # (the tokens past a stop token are never kept)
                    keep, complete = seq.fsm.tokens_kept(ids[:keep])
                seq.fill_placeholders(ids[:keep], lps[:keep])
                stop = outputs.check_stop(state, seq)
                if stop is None and complete:
                    stop = GRAMMAR_COMPLETE
            if seq.sampling_params.logprobs is not None:
                seq.output_ranks += ranks[row][:keep]
            filled += keep
            if stop is not None:
                self.scheduler.finish(seq, stop[0], stop[1])
            if outputs.output_due(state, seq):
                touched[seq.request_id] = state
        self.num_generated_tokens += filled

    def _grammar_tokens(self, sched: SchedulerOutput, sampled: AsyncSamplerOutput) -> list[tuple[object, int]]:
        """The in-flight step's constrained rows, as (matcher, sampled token) pairs for the model
        runner to consume before it fills this step's masks; `_settle_grammars` applies the
        verdicts (the read-back meanwhile holds those rows' stops and outputs)."""
        token_ids = sampled.get()[0]
        pairs = []
        row = -1
        for seq, smp in zip(sched.seqs, sched.sampling):
            if smp:
                row += 1
                if seq.matcher is not None and seq.has_placeholder:
                    self._grammar_rows.append(seq)
                    pairs.append((seq.matcher, token_ids[row]))
        sampled.grammars_advanced = sampled.grammar_verdicts_pending = True
        return pairs

    def _settle_grammars(self, in_flight: tuple[SchedulerOutput, AsyncSamplerOutput] | None) -> None:
        """The grammars that took the in-flight step's tokens on the worker give their verdicts
        (accepted[i] for _grammar_rows[i]): a sample ends when its grammar refused the token or is
        complete and can take nothing more. The rows the read-back held back finish now and get
        their outputs. Nothing stays held if the worker failed: its error propagates."""
        if in_flight is None or not in_flight[1].grammar_verdicts_pending:
            return
        in_flight[1].grammar_verdicts_pending = False
        rows, held, touched = self._grammar_rows, self._grammar_held, self._grammar_touched
        self._grammar_rows, self._grammar_held, self._grammar_touched = [], [], {}
        accepted = self.worker.model_runner.take_grammar_verdicts()  # (raises the worker's error)
        if accepted is None:  # the step failed before the grammars took their tokens
            return
        for seq, ok in zip(rows, accepted):
            self._grammar_verdict(seq, ok)
        for seq, state in held:
            if seq.grammar_stop is not None:
                self.scheduler.finish(seq, *seq.grammar_stop)
            if self.output_processor.output_due(state, seq):
                touched[state.request_id] = state
        self._make_outputs(touched)

    @staticmethod
    def _advance_grammar(seq: Sequence, token_id: int) -> None:
        """The sample's grammar takes its new token; it ends when the grammar is complete and
        can take nothing more (or, should a token break it, at once)."""
        LLMEngine._grammar_verdict(seq, seq.matcher.consume_token(token_id))

    @staticmethod
    def _grammar_verdict(seq: Sequence, accepted: bool) -> None:
        """A sample whose grammar refused its token, or is complete, ends with "stop"."""
        if not accepted or seq.matcher.is_stopped():
            seq.grammar_stop = GRAMMAR_COMPLETE

    @staticmethod
    def _record_prompt_logprobs(sched: SchedulerOutput, sampled: AsyncSamplerOutput) -> None:
        """Append each span's rows to its sequence's prompt logprobs, from the first position not
        recorded yet (a sequence preempted while this step was in flight recomputes its prompt:
        its rows may overlap rows recorded meanwhile)."""
        lps, ranks, top_ids, top_lps = sampled.get_prompt_logprobs()
        row = 0
        for i, pos, count in sampled.prompt_spans:
            seq = sched.seqs[i]
            skip = len(seq.prompt_lps) - pos
            if not seq.is_finished and 0 <= skip < count:  # (aborted meanwhile: nothing)
                a, b = row + skip, row + count
                seq.prompt_lps += lps[a:b]
                seq.prompt_ranks += ranks[a:b]
                if top_ids is not None:
                    k = seq.sampling_params.prompt_logprobs
                    seq.prompt_tops += [list(zip(ids[:k], lp[:k]))
                                        for ids, lp in zip(top_ids[a:b], top_lps[a:b])]
                seq.wants_prompt_logprobs = len(seq.prompt_lps) < seq.num_prompt_tokens - 1
            row += count

    # -- introspection -------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    # -- sleep, wake and weight updates: what lets the engine share a GPU with a trainer ---------
    def sleep(self, level: int = 1) -> dict:
        """Level 1: weights to pinned host memory, KV cache freed. Level 2: both freed."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep() needs the engine built with enable_sleep_mode=True")
        if self.is_sleeping:
            return {"already_sleeping": True}
        if self.has_unfinished_requests():
            raise ValueError(f"cannot sleep with {len(self.requests)} requests in flight; abort them first")
        self.drain()  # nothing may still be running on the memory about to go
        return self.worker.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> dict:
        """Bring back the weights and/or the KV cache; the prefix cache starts empty."""
        return self.worker.wake_up(tags, on_kv_cache=self.block_manager.reset_prefix_cache)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     specs: list[TensorSpec] | None = None) -> int:
        """Copy HF-named tensors into the engine in place (merging q/k/v and gate/up); all or
        nothing where they can be checked first (`Worker.load_weights`), then the version moves
        and the prefix cache is reset. Works while asleep: the weights are woken first. Returns
        how many tensors were loaded.
        """
        before = self.worker.weights_version
        try:
            return self.worker.load_weights(weights, specs)
        finally:
            if self.worker.weights_version != before:  # something may have been copied
                self.block_manager.reset_prefix_cache()  # cached KV came from the old weights

    def update_weights_from_model(self, model: torch.nn.Module) -> int:
        """Copy a trainer's HF model into the engine, device to device, never through disk."""
        state = model.state_dict()

        def tensors():
            for name, t in state.items():
                if hasattr(t, "full_tensor"):  # FSDP2 / DTensor shards: gather this one tensor
                    t = t.full_tensor()
                yield name, t.detach()

        return self.load_weights(tensors(), specs_of(state.items()))  # a DTensor's shape is whole

    def memory_report(self) -> dict:
        """Where the engine's memory is: weights, KV cache, CUDA graphs, other, and what is free."""
        return self.worker.memory_report()
