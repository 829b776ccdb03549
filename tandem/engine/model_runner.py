"""ModelRunner: turns a scheduled step into tensors, runs the model, samples on the device."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tandem import batch_invariant
from tandem.config import EngineConfig
from tandem.engine.scheduler import SchedulerOutput
from tandem.engine.sequence import Sequence
from tandem.engine.step_inputs import DecodeWindow, StepInputBuilder
from tandem.engine.structured_output import BitmaskFiller
from tandem.engine.token_fsm import FSMCursor, FSMStates
from tandem.forward_context import AttentionMetadata, set_attention_metadata
from tandem.layers.attention import Attention
from tandem.layers.sampler import (
    GrammarFSM,
    PromptLogprobs,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    prompt_token_logprobs,
)

HOST_ONLY_TOKEN = 100  # the token every row gets with EngineConfig.host_only (an ordinary one)
PROMPT_LOGPROB_ROWS = 1024  # logits rows materialised at once for prompt logprobs ([rows, V] fp32)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device, dtype):
        self.config = config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.vocab_size = model.config.vocab_size
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.kv_cache: torch.Tensor | None = None
        self.graph_runner = None  # CUDAGraphRunner once captured
        self.graph_bytes = 0
        self.kv_store = None
        self._sampling_key: tuple | None = None
        self._sampling_meta: SamplingMetadata | None = None
        self.inputs = StepInputBuilder(config.block_size, device)
        self.sampler = Sampler(config.seed, device)
        self.pin = device.type == "cuda"
        self.fill_bitmask = BitmaskFiller(self.vocab_size, self.pin)
        self.fsm_states = FSMStates(device)  # token automata's per-sample states
        self._fsm_tables: tuple[list, torch.Tensor, torch.Tensor, dict[int, int]] | None = None
        # whether the last step's sampling read the sequences' output tokens (penalties) or
        # their grammars
        self.sampling_reads_history = False
        self.sampling_advances_grammars = False

    # -- KV cache --------------------------------------------------------------------------------
    def kv_cache_block_bytes(self) -> int:
        a = self.attn_layers[0]
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.attn_layers) * self.block_size * a.num_kv_heads * a.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int, use_cumem: bool = False) -> None:
        from tandem.engine.sleep_mode import KVCacheStore

        a = self.attn_layers[0]
        shape = (len(self.attn_layers), 2, num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        self.kv_store = KVCacheStore(shape, self.dtype, self.device, use_cumem)
        self.kv_cache = self.kv_store.tensor
        self.bind_kv_cache()

    def release_kv_cache(self, sync: bool = True) -> None:
        self.kv_store.release(sync)
        if not self.kv_store.stable_address:
            self.kv_cache = None
            self.bind_kv_cache()

    def restore_kv_cache(self) -> None:
        self.kv_store.restore()
        self.kv_cache = self.kv_store.tensor
        self.bind_kv_cache()

    def bind_kv_cache(self) -> None:
        for i, layer in enumerate(self.attn_layers):
            if self.kv_cache is None:
                layer.k_cache = layer.v_cache = None
            else:
                layer.k_cache, layer.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]

    def set_attention_backend(self, name: str) -> str:
        """'auto' picks Triton on a GPU and the torch reference elsewhere."""
        if name == "auto":
            name = "triton" if self.device.type == "cuda" else "torch"
        if batch_invariant.is_enabled():
            name = "triton"  # the per-query decode kernel, on any device (tandem.batch_invariant)
        if name == "triton":
            from tandem.layers.triton_attention import TritonAttentionBackend

            backend = TritonAttentionBackend()
        else:
            from tandem.layers.attention import TorchAttentionBackend

            backend = TorchAttentionBackend()
        for layer in self.attn_layers:
            layer.backend = backend
        return name

    # -- batch building ----------------------------------------------------------------------------
    def _to_device(self, data: list, dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.pin)
        return t.to(self.device, non_blocking=True)

    def prepare_inputs(
        self, sched: SchedulerOutput, prev_token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], DecodeWindow | None]:
        """The step's token ids, positions, attention metadata, sampled rows and decode window
        (`StepInputBuilder.build`)."""
        x = self.inputs.build(sched, prev_token_ids)
        return x.input_ids, x.positions, x.meta, x.sample_rows, x.window

    def prepare_sampling(self, seqs: list[Sequence]) -> SamplingMetadata:
        """Per-row sampling tensors; reused while the batch keeps the same sequences (steady decode)
        unless a row has state that changes every step (penalty counts, min_tokens)."""
        key = tuple(s.seq_id for s in seqs)
        if key == self._sampling_key and self._sampling_meta is not None:
            m = self._sampling_meta
        else:
            m = self._build_sampling(seqs)
            stateful = m.output_counts is not None or m.min_tokens_mask is not None
            self._sampling_key, self._sampling_meta = (None, None) if stateful else (key, m)
        if m.seeded_rows is not None:  # the one per-step input of a seeded row's key
            m.seed_offsets = self._to_device([seqs[r].num_tokens for r in m.seeded_rows_cpu], torch.int64)
        # the next step's sampling needs this one's tokens on the host: penalty counts (before the
        # next step is scheduled), grammars (before it samples)
        self.sampling_reads_history = m.output_counts is not None
        self.sampling_advances_grammars = m.structured_rows is not None
        return m

    def _build_sampling(self, seqs: list[Sequence]) -> SamplingMetadata:
        params = [s.sampling_params for s in seqs]
        greedy = [p.greedy for p in params]
        dev = self.device
        V = self.vocab_size
        m = SamplingMetadata(
            temperature=self._to_device([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32),
            greedy=self._to_device(greedy, torch.bool),
            all_greedy=all(greedy),
            top_k=None,
            top_p=None,
            min_p=None,
            generators={},
            max_num_logprobs=max((p.logprobs if p.logprobs is not None else -1) for p in params),
            processed_logprobs=self.config.logprobs_mode == "processed_logprobs",
        )
        if any(p.top_k > 0 for p in params):
            m.top_k = self._to_device([p.top_k if p.top_k > 0 else V for p in params], torch.int64)
        if any(p.top_p < 1.0 for p in params):
            m.top_p = self._to_device([p.top_p for p in params], torch.float32)
        if any(p.min_p > 0.0 for p in params):
            m.min_p = self._to_device([p.min_p for p in params], torch.float32)
        seeded = [row for row, seq in enumerate(seqs) if seq.sampling_params.seed is not None and not greedy[row]]
        if seeded:  # the fused sampler keys these rows on the device
            m.seeded_rows, m.seeded_rows_cpu = self._to_device(seeded, torch.int64), seeded
            m.row_seeds = self._to_device([seqs[r].sampling_params.seed + seqs[r].index for r in seeded],
                                          torch.int64)
        for row in seeded:  # the torch path's per-row generators (made once per sequence)
            seq = seqs[row]
            if seq.generator is None:
                seed = seq.sampling_params.seed + seq.index
                seq.generator = torch.Generator(device=dev).manual_seed(seed)
            m.generators[row] = seq.generator
        rows, cols = [], []
        for row, seq in enumerate(seqs):
            if seq.stop_tokens_banned:
                banned = seq.stop_ids  # EOS (unless ignore_eos) and stop_token_ids
                rows.extend([row] * len(banned))
                cols.extend(banned)
        if rows:
            m.min_tokens_mask = (self._to_device(rows, torch.int64), self._to_device(cols, torch.int64))
        structured = [row for row, seq in enumerate(seqs) if seq.matcher is not None]
        if structured:
            m.structured_rows = self._to_device(structured, torch.int64)
            m.structured_rows_cpu = structured
        fsm_rows = [row for row, seq in enumerate(seqs) if seq.fsm is not None]
        if fsm_rows:
            m.fsm = self._grammar_fsm(fsm_rows, [seqs[r].fsm for r in fsm_rows])
        if any(p.logit_bias for p in params):
            biased = [(row, t, b) for row, p in enumerate(params)
                      for t, b in (p.logit_bias or {}).items()]
            r, c, b = zip(*biased)
            m.logit_bias = (self._to_device(r, torch.int64), self._to_device(c, torch.int64),
                            self._to_device(b, torch.float32))
        if any(p.has_penalties for p in params):
            S = len(seqs)
            prompt_mask = torch.zeros(S, V + 1, dtype=torch.bool)
            counts = torch.zeros(S, V + 1, dtype=torch.int32)
            for row, seq in enumerate(seqs):
                prompt_mask[row, seq.prompt_token_ids] = True
                out = torch.tensor(seq.output_token_ids, dtype=torch.int64)
                counts[row].scatter_add_(0, out, torch.ones_like(out, dtype=torch.int32))
            m.prompt_mask = prompt_mask[:, :V].to(dev)
            m.output_counts = counts[:, :V].to(dev)
            m.repetition_penalty = self._to_device([p.repetition_penalty for p in params], torch.float32)
            m.presence_penalty = self._to_device([p.presence_penalty for p in params], torch.float32)
            m.frequency_penalty = self._to_device([p.frequency_penalty for p in params], torch.float32)
        return m

    def _grammar_fsm(self, rows: list[int], cursors: list[FSMCursor]) -> GrammarFSM:
        """The device side of the batch's token automata: slots for samples new to the device,
        and the tables of the batch's grammars concatenated (kept while the set is the same)."""
        self.fsm_states.bind(cursors)
        fsms = list({id(c.fsm): c.fsm for c in cursors}.values())
        cached = self._fsm_tables
        if cached is None or len(cached[0]) != len(fsms) or any(a is not b for a, b in zip(cached[0], fsms)):
            tables = [f.device_tables(self.device) for f in fsms]
            starts = np.cumsum([0] + [f.num_states for f in fsms]).tolist()
            allowed = torch.cat([t[0] for t in tables]) if len(tables) > 1 else tables[0][0]
            nxt = torch.cat([t[1] for t in tables]) if len(tables) > 1 else tables[0][1]  # (local states)
            self._fsm_tables = (fsms, allowed, nxt, {id(f): s for f, s in zip(fsms, starts)})
        _, allowed, nxt, starts = self._fsm_tables
        return GrammarFSM(
            rows=self._to_device(rows, torch.int64),
            slots=self._to_device([c.slot for c in cursors], torch.int64),
            offsets=self._to_device([starts[id(c.fsm)] for c in cursors], torch.int32),
            allowed=allowed, next_state=nxt, states=self.fsm_states)

    def release_cudagraphs(self) -> None:
        """Drop the captured graphs (they hold NCCL communicators alive under tensor parallel)."""
        if self.graph_runner is None:
            return
        torch.cuda.synchronize(self.device)  # no replay may still be running
        for graph in self.graph_runner.all_graphs():
            graph.reset()  # destroys the executable graph now, not whenever refcounts let go
        self.graph_runner = None
        self.graph_bytes = 0

    def capture_cudagraphs(self, max_model_len: int) -> float:
        """Capture decode graphs for the batch-size ladder and mixed-step graphs for the token-count
        ladder; returns the seconds it took."""
        import time

        from tandem.engine.cuda_graph import CUDAGraphRunner

        t0 = time.perf_counter()
        self.graph_runner = None
        before = torch.cuda.memory_allocated(self.device)
        max_blocks = -(-max_model_len // self.block_size)
        max_mixed = min(self.config.max_cudagraph_capture_size, self.config.max_num_batched_tokens)
        self.graph_runner = CUDAGraphRunner(self.model, self.config.max_num_seqs, max_blocks, self.device,
                                            max_mixed)
        self.graph_runner.capture()
        self.graph_bytes = torch.cuda.memory_allocated(self.device) - before
        return time.perf_counter() - t0

    @torch.inference_mode()
    def warmup_kernels(self, max_model_len: int) -> float:
        """Compile, before serving, every Triton variant an eager step can reach, and load the
        cuBLAS kernels of the LM head for every number of sampled rows.

        Graph capture compiles the decode path. What it leaves is shape-dependent: prefill
        attention's tile (by the longest query in the step), the sampler (greedy or sampling,
        with or without ranks) and the grammar mask. A serving engine whose batches vary would
        otherwise compile them between tokens, stalling every request for the second each takes.
        Dummy steps write no KV-cache slot. Returns the seconds it took.
        """
        import time

        from tandem.kernels.prefill_attention import tile_rows_classes
        from tandem.kernels.sampling import sample
        from tandem.layers.sampler import apply_grammar_bitmask

        t0 = time.perf_counter()
        a = self.attn_layers[0]
        group = a.num_heads // a.num_kv_heads
        dev = self.device
        hidden = None
        longest = min(max_model_len, self.config.max_num_batched_tokens)  # no step's query is longer
        for q_len in tile_rows_classes(group, self.dtype, longest):
            meta = AttentionMetadata(
                slot_mapping=torch.full((q_len,), -1, dtype=torch.int64, device=dev),
                query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=dev),
                seq_lens=torch.tensor([q_len], dtype=torch.int32, device=dev),
                block_tables=torch.zeros(1, -(-q_len // self.block_size), dtype=torch.int32, device=dev),
                max_query_len=q_len, max_seq_len=q_len, decode_only=False,
                query_start_loc_cpu=[0, q_len], seq_lens_cpu=[q_len],
            )
            ids = torch.zeros(q_len, dtype=torch.int64, device=dev)
            with set_attention_metadata(meta):
                hidden = self.model(ids, torch.arange(q_len, device=dev))
        # The LM head runs eagerly on the rows a step samples (after a decode graph's replay, or
        # on a mixed step's last tokens), and cuBLAS picks its kernel by their count. The first
        # launch of a kernel loads its module and waits for the device: gen-7b's first mixed
        # step of 191 rows stalled 0.33 s on it, a full prefill chunk. Every count, once, here.
        rows = hidden[-1:].expand(self.config.max_num_seqs, -1).contiguous()
        for n in range(1, self.config.max_num_seqs + 1):
            self.model.compute_logits(rows[:n])
        logits = self.model.compute_logits(rows[:2])
        temperature = torch.ones(2, dtype=torch.float32, device=dev)
        processed = self.config.logprobs_mode == "processed_logprobs"
        words = -(-logits.shape[1] // 32)  # the grammar mask (llguidance's and token automata's)
        apply_grammar_bitmask(logits.clone(), torch.zeros(1, dtype=torch.int64, device=dev),
                              torch.full((1, words), -1, dtype=torch.int32, device=dev))
        for sampling in (False, True):
            greedy = torch.tensor([True, False], device=dev) if sampling else None
            seeds = torch.zeros(2, dtype=torch.int64, device=dev) if sampling else None
            for want_ranks in (False, True):
                sample(logits, temperature, greedy, seeds, processed, want_ranks)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    # -- running -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, sched: SchedulerOutput, prev_token_ids: torch.Tensor | None = None,
            before_sampling=None, while_masking=None) -> SamplerOutput | None:
        """Launch the step; returns device tensors without waiting for the device.
        `before_sampling` runs once the forward is launched and returns the grammars that take the
        in-flight step's tokens first, as (matcher, token) pairs (`take_grammar_verdicts` says
        which accepted); `while_masking` runs on this thread while a worker thread has them take
        the tokens and fills the step's grammar masks (the engine reads the previous step back)."""
        if self.config.host_only:
            return self._run_host_only(sched, prev_token_ids)
        plp_rows = self._prompt_logprob_rows(sched)
        input_ids, positions, meta, sample_rows, window = self.prepare_inputs(sched, prev_token_ids)
        if window is not None:
            return self._run_window(sched, input_ids, meta, window)
        graphs = self.graph_runner
        num_tokens, num_seqs = input_ids.shape[0], len(sched.seqs)
        rows = None
        if sample_rows and len(sample_rows) < num_tokens:  # prefill chunks that end mid-prompt
            rows = torch.tensor(sample_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        prompt_lps = None
        # (the decode graphs give logits, not the hidden states prompt logprobs need)
        decode_graph = graphs is not None and graphs.can_run(num_seqs) and not plp_rows
        if meta.decode_only and sample_rows and decode_graph:
            # (a decode-shaped step may hold a 1-token chunk of a longer prompt: no row to sample)
            logits = graphs.run(input_ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables,
                                meta.seq_lens_cpu)
            if rows is not None:
                logits = logits[rows]
        else:
            if graphs is not None and graphs.can_run_mixed(num_tokens, num_seqs):
                hidden = graphs.run_mixed(input_ids, positions, meta.slot_mapping, meta.query_start_loc,
                                          meta.seq_lens, meta.block_tables)
            else:
                with set_attention_metadata(meta):
                    hidden = self.model(input_ids, positions)
            if plp_rows:
                prompt_lps = self._prompt_logprobs(hidden, sched, plp_rows)
            if not sample_rows:
                if prompt_lps is None:
                    return None
                empty = torch.empty(0, dtype=torch.int64, device=self.device)
                return SamplerOutput(token_ids=empty, logprobs=empty.float(),
                                     prompt_logprobs=prompt_lps)
            logits = self.model.compute_logits(hidden if rows is None else hidden[rows])
        # (matcher, token) pairs: grammars that take the in-flight step's tokens before the masks
        advance = before_sampling() if before_sampling is not None else None
        sampling_seqs = [s for s, smp in zip(sched.seqs, sched.sampling) if smp]
        m = self.prepare_sampling(sampling_seqs)
        filler = self.fill_bitmask
        if m.structured_rows is not None:  # filled on the host, copied without waiting
            matchers = [sampling_seqs[r].matcher for r in m.structured_rows_cpu]
            if while_masking is not None:
                pending = filler.fill_async(matchers, advance or [])
                try:
                    while_masking()
                except BaseException:
                    pending.exception()  # the worker holds the matchers until it is done
                    raise
                mask = pending.result()
            else:
                if advance:
                    filler.advance(advance)
                mask = filler(matchers)
            m.grammar_bitmask = mask.to(self.device, non_blocking=True)
        elif advance:
            filler.advance(advance)
        out = self.sampler(logits, m)
        out.prompt_logprobs = prompt_lps
        return out

    def _run_host_only(self, sched: SchedulerOutput, prev_token_ids: torch.Tensor | None) -> SamplerOutput | None:
        """`EngineConfig.host_only`: the step's inputs and sampling metadata made and copied as for
        a real step, then one fixed token for every sampled row (each of a window's steps)."""
        _, _, _, sample_rows, window = self.prepare_inputs(sched, prev_token_ids)
        rows = len(sched.seqs) if window is not None else len(sample_rows)
        if not rows:
            return None
        self.prepare_sampling([s for s, smp in zip(sched.seqs, sched.sampling) if smp])
        shape = (rows,) if window is None else (rows, window.num_steps)
        token = min(HOST_ONLY_TOKEN, self.vocab_size - 1)
        return SamplerOutput(token_ids=torch.full(shape, token, dtype=torch.int64, device=self.device),
                             logprobs=torch.zeros(shape, dtype=torch.float32, device=self.device))

    def _run_window(self, sched: SchedulerOutput, input_ids: torch.Tensor, meta: AttentionMetadata,
                    window: DecodeWindow) -> SamplerOutput:
        """A decode window: its steps launched back to back, each step's sampled tokens the next
        one's inputs on the device, with no read-back between them. Returns the tokens [B, K]
        (each sequence's K in order), their logprobs and ranks alike."""
        m = self.prepare_sampling(sched.seqs)  # windowable rows: the same tensors every step...
        graphs = self.graph_runner
        replay = graphs is not None and graphs.can_run(len(sched.seqs))
        rows = torch.arange(len(sched.seqs), device=self.device) if m.output_counts is not None else None
        ids, steps = input_ids, []
        for k in range(window.num_steps):
            step_meta = meta if k == 0 else window.meta(meta, k)
            positions = window.positions[k]
            if replay:
                logits = graphs.run(ids, positions, step_meta.slot_mapping, step_meta.seq_lens,
                                    step_meta.block_tables, step_meta.seq_lens_cpu if k == 0 else None)
            else:
                with set_attention_metadata(step_meta):
                    logits = self.model.compute_logits(self.model(ids, positions))
            # a seeded row's draw is keyed by its token count: one more each step
            step_m = m if k == 0 or m.seed_offsets is None else dataclasses.replace(m, seed_offsets=m.seed_offsets + k)
            steps.append(self.sampler(logits, step_m))
            ids = steps[-1].token_ids
            if rows is not None and k + 1 < window.num_steps:  # ...but penalties' output counts
                m.output_counts[rows, ids] += 1
        ranks = None if steps[0].ranks is None else torch.stack([o.ranks for o in steps], dim=1)
        return SamplerOutput(token_ids=torch.stack([o.token_ids for o in steps], dim=1),
                             logprobs=torch.stack([o.logprobs for o in steps], dim=1), ranks=ranks)

    def advance_grammars_async(self, pairs: list[tuple[object, int]]) -> None:
        """The grammars take their tokens ((matcher, token) pairs) on the worker thread, before
        the next step's masks are filled there; `take_grammar_verdicts` waits for them."""
        self.fill_bitmask.advance_async(pairs)

    def take_grammar_verdicts(self) -> list[bool] | None:
        """Whether each of the last pairs the grammars took (`advance_grammars_async`'s, or
        `before_sampling`'s) accepted its token; None if the step stopped before they took them."""
        return self.fill_bitmask.take_accepted()

    @staticmethod
    def _prompt_logprob_rows(sched: SchedulerOutput) -> list[tuple[int, int, int, int]]:
        """(index in the step, flat row of the first predicting position, first position, count)
        for each chunk whose positions predict prompt tokens that still need logprobs. Position p
        predicts token p + 1; the last prompt position predicts the first output token instead."""
        out = []
        flat = 0
        for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_new_tokens)):
            if seq.wants_prompt_logprobs:
                start = seq.num_computed_tokens
                lo = max(start, len(seq.prompt_lps))  # (a recomputed chunk after preemption)
                hi = min(start + n, seq.num_prompt_tokens - 1)
                if lo < hi:
                    out.append((i, flat + lo - start, lo, hi - lo))
            flat += n
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, sched: SchedulerOutput,
                         plp_rows: list[tuple[int, int, int, int]]) -> PromptLogprobs:
        """Prompt logprobs of this step's chunks, PROMPT_LOGPROB_ROWS logits rows at a time."""
        rows, targets = [], []
        for i, row, pos, count in plp_rows:
            rows.extend(range(row, row + count))
            targets.extend(sched.seqs[i].token_ids[pos + 1 : pos + 1 + count])
        k = max(sched.seqs[i].sampling_params.prompt_logprobs for i, *_ in plp_rows)
        rows_dev = self._to_device(rows, torch.int64)
        targets_dev = self._to_device(targets, torch.int64)
        parts = []
        for a in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            r = rows_dev[a : a + PROMPT_LOGPROB_ROWS]
            logits = self.model.compute_logits(hidden[r])
            parts.append(prompt_token_logprobs(logits, targets_dev[a : a + PROMPT_LOGPROB_ROWS], k))
        lps, ranks, top_ids, top_lps = (None if p[0] is None else torch.cat(p) for p in zip(*parts))
        spans = [(i, pos, count) for i, _, pos, count in plp_rows]
        return PromptLogprobs(lps, ranks, top_ids, top_lps, spans)
