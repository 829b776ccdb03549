"""OutputProcessor: sampled tokens in, RequestOutputs out (vLLM V1's OutputProcessor).

Per request it keeps the detokenizers and what was already sent; per sampled token it records
logprobs, detokenizes where stop strings need the text, and says whether the sample stopped and
whether the request has an output due (first token, every `stream_interval` tokens, the end).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.sequence import Sequence, SequenceStatus
from tandem.engine.stop_checker import check_stop, find_stop_string
from tandem.outputs import CompletionOutput, FlatLogprobs, Logprob, RequestOutput
from tandem.sampling_params import SamplingParams

OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: str  # "cumulative" | "delta" | "final_only"
    seqs: list[Sequence] = field(default_factory=list)
    detokenizers: list[IncrementalDetokenizer] | None = None
    sent_tokens: list[int] = field(default_factory=list)  # per sample, for delta outputs
    sent_chars: list[int] = field(default_factory=list)
    sent_prompt_logprobs: bool = False  # delta outputs carry them once, in the first

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # a plain loop: this runs for every streamed output
            if s.status is not SequenceStatus.FINISHED:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer, stream_interval: int):
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.requests: dict[str, RequestState] = {}
        self._token_texts: dict[int, str] = {}  # decoded single tokens, for logprobs

    def add_request(self, state: RequestState) -> None:
        params = state.params
        wants_text = state.output_kind != "final_only" or params.stop_strings
        if wants_text and params.detokenize and self.tokenizer is not None:
            state.detokenizers = [
                IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, params.skip_special_tokens)
                for _ in state.seqs
            ]
        state.sent_tokens = [0] * params.n
        state.sent_chars = [0] * params.n
        self.requests[state.request_id] = state

    # -- per sampled token -----------------------------------------------------------------------
    @staticmethod
    def record_logprobs(seq: Sequence, row: int, ranks: list, topk_ids: list | None, topk_lps: list | None) -> None:
        """Keep row `row` of the step's ranks and top-k alternatives for a sample that asked for logprobs."""
        k = seq.sampling_params.logprobs
        seq.output_ranks.append(ranks[row])
        if k and topk_ids is not None:
            ids, lps = topk_ids[row][:k], topk_lps[row][:k]
            seq.top_logprobs.append({t: (lp_t, r + 1) for r, (t, lp_t) in enumerate(zip(ids, lps))})

    def check_stop(self, state: RequestState, seq: Sequence) -> tuple[str, int | str | None] | None:
        """(finish_reason, stop_reason) when the token just appended ends the sample."""
        stop = check_stop(seq)
        if state.detokenizers is not None and seq.sampling_params.stop_strings:
            # stop strings are matched as the text grows: detokenize every token
            det = state.detokenizers[seq.index]
            delta = det.add(seq.last_token_id)
            # as vLLM's: text that the first min_tokens tokens wrote ends nothing, as their stop
            # tokens were banned (the token just appended is counted)
            if stop is None and delta and seq.num_output_tokens > seq.sampling_params.min_tokens:
                hit = find_stop_string(det.text, len(delta), seq.sampling_params.stop_strings)
                if hit is not None:
                    stop_str, idx = hit
                    end = idx + len(stop_str) if seq.sampling_params.include_stop_str_in_output else idx
                    det.text = det.text[:end]
                    stop = ("stop", stop_str)
            elif stop is not None:
                det.flush()
            seq.output_text = det.text
        return stop

    def output_due(self, state: RequestState, seq: Sequence) -> bool:
        """final_only requests produce an output only when a sample finishes; streamed ones on
        their first token (time to first token is not held back), then every stream_interval
        tokens, as vLLM's."""
        if seq.is_finished:
            return True
        if state.output_kind == "final_only":
            return False
        sent = state.sent_tokens[seq.index]
        return sent == 0 or seq.num_output_tokens - sent >= self.stream_interval

    # -- outputs ---------------------------------------------------------------------------------
    def make_output(self, state: RequestState) -> RequestOutput | None:
        finished = state.finished
        kind = state.output_kind
        if kind == "final_only" and not finished:
            return None
        delta = kind == "delta"
        sent_tokens, sent_chars = state.sent_tokens, state.sent_chars
        outputs = []
        for seq in state.seqs:
            i = seq.index
            start_tok = sent_tokens[i] if delta else 0
            if state.detokenizers is not None:
                self._catch_up_text(state, seq)
                text = seq.output_text
            else:
                text = self._decode_final(seq)
            stop_strings = seq.sampling_params.stop_strings
            if stop_strings and not seq.is_finished:
                # hold back what could still become the start of a stop string
                text = text[: max(0, len(text) - max(map(len, stop_strings)) + 1)]
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=text[sent_chars[i]:] if delta else text,
                    token_ids=seq.token_ids[seq.num_prompt_tokens + start_tok :],
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=self._logprobs(seq, start_tok),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
            sent_tokens[i] = seq.num_output_tokens
            sent_chars[i] = len(text)
        if finished:
            self.requests.pop(state.request_id, None)
        prompt_logprobs = None
        if state.params.prompt_logprobs is not None and not (delta and state.sent_prompt_logprobs):
            prompt_logprobs = self._prompt_logprobs(state.seqs[0])
            state.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=state.seqs[0].num_cached_tokens,
            metrics={"arrival_time": state.seqs[0].arrival_time,
                     "first_token_time": _first_token_time(state.seqs)},
        )

    @staticmethod
    def _catch_up_text(state: RequestState, seq: Sequence) -> None:
        """Without stop strings a sample's text is only needed when it is emitted: detokenize the
        tokens since the last emission now, in one go (and flush at the end)."""
        det = state.detokenizers[seq.index]
        if not seq.sampling_params.stop_strings:
            det.add_many(seq.token_ids[seq.num_prompt_tokens + det.num_added :])
            if seq.is_finished:
                det.flush()
            seq.output_text = det.text

    def _decode_final(self, seq: Sequence) -> str:
        if not seq.is_finished or self.tokenizer is None or not seq.sampling_params.detokenize:
            return ""
        return self.tokenizer.decode(
            seq.output_token_ids, skip_special_tokens=seq.sampling_params.skip_special_tokens
        )

    def _logprobs(self, seq: Sequence, start: int) -> FlatLogprobs | None:
        """Positions start.. of the sample's logprobs; decoded_token only with detokenize (as vLLM)."""
        params = seq.sampling_params
        if params.logprobs is None:
            return None
        text = self._token_text if params.detokenize else None
        end, p = len(seq.output_ranks), seq.num_prompt_tokens
        tops = seq.top_logprobs
        if not tops:  # one entry per position, the sampled token: the lists are slices
            out = FlatLogprobs(list(range(end - start)), list(range(1, end - start + 1)),
                               seq.token_ids[p + start : p + end], seq.output_logprobs[start:end],
                               seq.output_ranks[start:end])
            out.decoded_tokens = [None] * len(out) if text is None else [text(t) for t in out.token_ids]
            return out
        def decoded(t: int) -> str | None:
            return None if text is None else text(t)

        out = FlatLogprobs()
        ids = seq.token_ids
        for i in range(start, end):
            t = ids[p + i]
            entry = {t: Logprob(seq.output_logprobs[i], seq.output_ranks[i], decoded(t))}
            for t_k, (lp_k, rank_k) in tops[i].items():
                if t_k not in entry:
                    entry[t_k] = Logprob(lp_k, rank_k, decoded(t_k))
            out.append(entry)
        return out

    def _prompt_logprobs(self, seq: Sequence) -> list[dict[int, Logprob] | None]:
        """vLLM's shape: None for the first prompt token (nothing predicts it), then per token a
        dict holding it and the top-k alternatives."""
        text = self._token_text
        out: list[dict[int, Logprob] | None] = [None]
        ids = seq.token_ids
        for p, (lp, rank) in enumerate(zip(seq.prompt_lps, seq.prompt_ranks)):
            t = ids[p + 1]
            entry = {t: Logprob(lp, rank, text(t))}
            if seq.prompt_tops:
                for r, (t_k, lp_k) in enumerate(seq.prompt_tops[p]):
                    if t_k not in entry:
                        entry[t_k] = Logprob(lp_k, r + 1, text(t_k))
            out.append(entry)
        return out

    def _token_text(self, token_id: int) -> str | None:
        """`decode([token_id])`, cached: the vocabulary bounds the cache, and a token's text is
        looked up once per vocabulary entry instead of once per sampled token."""
        text = self._token_texts.get(token_id)
        if text is None and self.tokenizer is not None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text


def _first_token_time(seqs: list[Sequence]) -> float | None:
    """When the request's first token came back (its earliest sample's)."""
    if len(seqs) == 1:  # (every streamed output asks: the common case without a generator)
        return seqs[0].first_token_time or None
    return min((s.first_token_time for s in seqs if s.first_token_time), default=None)
