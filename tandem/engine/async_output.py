"""A step's sampled tokens on their way to the host, so the next step can launch before they land.

The copy is queued on the device stream right after sampling, into pinned host memory, with an
event behind it; `get()` waits for that event only. Meanwhile the host schedules and launches the
next step, whose placeholder inputs read the same tokens straight from `token_ids` on the device.
"""

from __future__ import annotations

import time

import torch

from tandem.layers.sampler import SamplerOutput


class AsyncSamplerOutput:
    def __init__(self, sampled: SamplerOutput, reads_history: bool = False,
                 advances_grammars: bool = False):
        # a decode window's tokens are [B, K]: get() gives each row's K in a list
        self.num_steps = sampled.token_ids.shape[1] if sampled.token_ids.dim() == 2 else 1
        # device: the next step gathers its inputs from here (a window's: its last step's)
        self.token_ids = sampled.token_ids if self.num_steps == 1 else sampled.token_ids[:, -1]
        # the next step's sampling needs this one's ids on the host (penalty counts): read first
        self.reads_history = reads_history
        # its constrained rows' grammars take this step's tokens before the next step samples
        self.advances_grammars = advances_grammars
        self.grammars_advanced = False
        # the grammars are taking them on the model runner's worker (the read-back holds those rows)
        self.grammar_verdicts_pending = False
        # float64 holds every token id exactly: one copy carries ids and logprobs
        packed = [torch.stack([sampled.token_ids.double(), sampled.logprobs.double()]),
                  sampled.topk_ids, sampled.topk_logprobs, sampled.ranks]
        plp = sampled.prompt_logprobs
        if plp is not None:
            packed += [plp.logprobs, plp.ranks, plp.topk_ids, plp.topk_logprobs]
        self.prompt_spans = plp.spans if plp is not None else []
        self._event = None
        if sampled.token_ids.is_cuda:
            self._host = [None if t is None else _to_pinned(t) for t in packed]
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = packed
        self._lists = None
        self.wait_s = 0.0  # how long `get` waited for the device to finish the step

    def ready(self) -> bool:
        """Whether the device has finished the step (its tokens can be read without waiting)."""
        return self._event is None or self._event.query()

    def get(self) -> tuple[list[int], list[float], list | None, list | None, list | None]:
        """(token ids, logprobs, top-k ids, top-k logprobs, ranks) as Python lists (a decode
        window's ids, logprobs and ranks: a list of K per row)."""
        if self._lists is None:
            if self._event is not None:
                t0 = time.perf_counter()
                self._event.synchronize()
                self.wait_s = time.perf_counter() - t0
            lists = [None if t is None else t.tolist() for t in self._host]
            ids_lps, topk_ids, topk_lps, ranks = lists[:4]
            if self.num_steps == 1:
                token_ids = [int(t) for t in ids_lps[0]]
            else:
                token_ids = [list(map(int, row)) for row in ids_lps[0]]
            self._lists = (token_ids, ids_lps[1], topk_ids, topk_lps, ranks)
            self._prompt_lists = lists[4:]
        return self._lists

    def get_prompt_logprobs(self) -> tuple[list[float], list[int], list | None, list | None]:
        """(logprobs, ranks, top-k ids, top-k logprobs) of the step's prompt rows, after `get()`;
        `prompt_spans` says which sequence each run of rows belongs to."""
        return tuple(self._prompt_lists)


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
