"""A step's inputs: the scheduled sequences flattened into token ids, positions, KV-cache slots,
context lengths and block tables, built with numpy and moved to the device in one copy.

This runs on the host before every step (every window of steps), so its cost is per row of the
batch: one pass over the sequences for each attribute read, the rest vectorized. The int64 parts
(ids, positions, slots: kernels read them in place) and the int32 parts (query starts, context
lengths, block tables) share one host buffer and one copy; on the device each part is a view.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from tandem.engine.scheduler import SchedulerOutput
from tandem.engine.sequence import Sequence
from tandem.forward_context import AttentionMetadata

ALIGN = 16  # bytes: every part starts here (Triton specializes kernels on pointer alignment)


@dataclass
class DecodeWindow:
    """A decode window's steps (`SchedulerOutput.num_steps`): step k's inputs sit at position
    p + k of each sequence, written to the slot for it, over a context one longer each step."""

    positions: torch.Tensor  # [K, B] int64
    slot_mapping: torch.Tensor  # [K, B] int64
    seq_lens: torch.Tensor  # [K, B] int32
    seq_lens_cpu: np.ndarray  # [K, B]

    @property
    def num_steps(self) -> int:
        return self.positions.shape[0]

    def meta(self, first: AttentionMetadata, k: int) -> AttentionMetadata:
        """Step k's attention metadata (step 0's is `first`)."""
        lens = self.seq_lens_cpu[k]
        return dataclasses.replace(first, slot_mapping=self.slot_mapping[k], seq_lens=self.seq_lens[k],
                                   max_seq_len=int(lens.max()), seq_lens_cpu=lens.tolist())


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64 on the device, placeholders filled
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # flat index of each sampled row's last token
    window: DecodeWindow | None


class StepInputBuilder:
    """Builds `StepInputs`; keeps the block-table array between steps (see `block_tables`)."""

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device
        self.pin = device.type == "cuda"
        self._block_table_cache: tuple[tuple[list[int], list[int]], np.ndarray, np.ndarray] | None = None

    def build(self, sched: SchedulerOutput, prev_token_ids: torch.Tensor | None = None) -> StepInputs:
        """Inputs that are still placeholders (tokens the in-flight step is sampling) are filled on
        the device from `prev_token_ids`. A decode window (`sched.num_steps` > 1) gets every
        step's positions, slots and context lengths in the same copy (`DecodeWindow`); the ids
        and metadata returned are its first step's."""
        bs = self.block_size
        seqs = sched.seqs
        B = len(seqs)
        K = sched.num_steps
        width = B if K == 1 else -(-B // 4) * 4  # a window's rows, each starting 16-byte aligned
        decode_only = sched.is_decode_only  # every row computes one token
        starts_list = [s.num_computed_tokens for s in seqs]
        token_lists = [s.token_ids for s in seqs]  # known tokens: placeholders are not in them
        known = np.fromiter(map(len, token_lists), np.int64, B)
        starts = np.array(starts_list, dtype=np.int64)
        if decode_only:
            n = np.ones(B, dtype=np.int64)
            qsl = np.arange(B + 1, dtype=np.int64)
            T = B
        else:
            n = np.array(sched.num_new_tokens, dtype=np.int64)
            qsl = np.zeros(B + 1, dtype=np.int64)
            np.cumsum(n, out=qsl[1:])
            T = int(qsl[-1])
        # rows whose chunk reaches their placeholder: that last input comes from the in-flight
        # step's sampled tokens on the device (every row of a steady decode under async scheduling)
        pending_seqs = np.flatnonzero(starts + n > known)
        if len(pending_seqs) and prev_token_ids is None:
            raise RuntimeError("placeholder inputs but no in-flight step to read them from")
        all_pending = decode_only and len(pending_seqs) == B
        parts64: dict[str, np.ndarray] = {}
        if decode_only:
            if not all_pending:
                # each row's input is its token at `start` (a decode's last token, or a 1-token
                # chunk of a longer prompt); a placeholder reads 0 here, filled on the device
                parts64["ids"] = np.array([t[a] if a < k else 0 for t, a, k in
                                           zip(token_lists, starts_list, known.tolist())], dtype=np.int64)
            if K == 1:
                seq_index, positions = np.arange(B), starts
            else:  # [K, width] flat: step k's positions (padding columns repeat the last row)
                seq_index = np.tile(np.minimum(np.arange(width), B - 1), K)
                positions = starts[seq_index] + np.repeat(np.arange(K), width)
        else:
            input_ids = np.zeros(T, dtype=np.int64)
            for t, a, k, q in zip(token_lists, starts_list, sched.num_new_tokens, qsl.tolist()):
                chunk = t[a : a + k]  # one short when the chunk ends at a placeholder
                input_ids[q : q + len(chunk)] = chunk
            parts64["ids"] = input_ids
            seq_index = np.repeat(np.arange(B), n)
            positions = np.arange(T, dtype=np.int64) - np.repeat(qsl[:-1] - starts, n)
        tables = self.block_tables(seqs)
        max_blocks = tables.shape[1]
        slots = tables[seq_index, positions // bs] * bs + positions % bs
        seq_lens = starts + n if K == 1 else positions + 1
        parts64["positions"], parts64["slots"] = positions, slots
        in_order = False  # every row's input is the in-flight step's token of the same row
        if len(pending_seqs):
            rows = np.array([s.pending_row for s in seqs], dtype=np.int64)[pending_seqs]
            in_order = all_pending and prev_token_ids.is_contiguous() and np.array_equal(rows, np.arange(B))
            if not in_order:
                parts64["pending_rows"] = rows
                if not all_pending:
                    parts64["pending_at"] = qsl[1:][pending_seqs] - 1  # flat index of the input
        dev64, dev32 = self._to_device(parts64, {"qsl": qsl, "seq_lens": seq_lens, "tables": tables})
        if in_order:  # the in-flight step's tokens are this step's inputs as they are
            input_dev = prev_token_ids[:B]
        elif all_pending:
            input_dev = prev_token_ids[dev64["pending_rows"]]
        else:
            input_dev = dev64["ids"]
            if len(pending_seqs):
                input_dev[dev64["pending_at"]] = prev_token_ids[dev64["pending_rows"]]
        lens = dev32["seq_lens"]
        seq_lens_b = seq_lens[:B]
        meta = AttentionMetadata(
            slot_mapping=dev64["slots"][:T],
            query_start_loc=dev32["qsl"],
            seq_lens=lens[:B],
            block_tables=dev32["tables"].view(B, max_blocks),
            max_query_len=1 if decode_only else int(n.max()),
            max_seq_len=int(seq_lens_b.max()),
            decode_only=decode_only,
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens_b.tolist(),
        )
        sampling = sched.sampling
        if decode_only and all(sampling):
            sample_rows = list(range(B))
        else:
            sample_rows = (qsl[1:][np.asarray(sampling, dtype=bool)] - 1).tolist()
        window = None
        if K > 1:
            window = DecodeWindow(*(t.view(K, width)[:, :B] for t in (dev64["positions"], dev64["slots"], lens)),
                                  seq_lens.reshape(K, width)[:, :B])
        return StepInputs(input_dev, dev64["positions"][:T], meta, sample_rows, window)

    def _to_device(self, parts64: dict[str, np.ndarray], parts32: dict[str, np.ndarray]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Every part in one host buffer (the int64 ones, then the int32 ones, each starting
        `ALIGN`-byte aligned), one (pinned, asynchronous) copy; a view on the device for each."""
        sizes64 = [p.size for p in parts64.values()]
        sizes32 = [p.size for p in parts32.values()]
        pad64 = [s + (-s) % (ALIGN // 8) for s in sizes64]
        pad32 = [s + (-s) % (ALIGN // 4) for s in sizes32]
        n64 = sum(pad64)
        host = np.empty(8 * n64 + 4 * sum(pad32), dtype=np.uint8)
        h64, h32 = host[: 8 * n64].view(np.int64), host[8 * n64 :].view(np.int32)
        o = 0
        for p, s, ps in zip(parts64.values(), sizes64, pad64):
            h64[o : o + s] = p.ravel()
            o += ps
        o = 0
        for p, s, ps in zip(parts32.values(), sizes32, pad32):
            h32[o : o + s] = p.ravel()
            o += ps
        dev = torch.from_numpy(host)
        if self.pin:
            dev = dev.pin_memory()
        dev = dev.to(self.device, non_blocking=True)
        d64 = dev[: 8 * n64].view(torch.int64).split(pad64)
        d32 = dev[8 * n64 :].view(torch.int32).split(pad32)
        return ({k: t if s == ps else t[:s] for k, t, s, ps in zip(parts64, d64, sizes64, pad64)},
                {k: t if s == ps else t[:s] for k, t, s, ps in zip(parts32, d32, sizes32, pad32)})

    def block_tables(self, seqs: list[Sequence]) -> np.ndarray:
        """[B, longest table] int64, zero-padded. Kept between steps: while the batch holds the
        same sequences (steady decode) only what the tables gained is written (a block appended
        to a row, the common case, in one vectorized write), not the whole table of every
        sequence. A table rewritten in place (`block_table_epoch`) rebuilds the array."""
        B = len(seqs)
        block_lists = [s.block_table for s in seqs]
        lens = np.fromiter(map(len, block_lists), np.int64, B)
        key = ([s.seq_id for s in seqs], [s.block_table_epoch for s in seqs])  # compared as lists
        max_blocks = int(lens.max())
        cached = self._block_table_cache
        if cached is not None and cached[2].shape[1] >= max_blocks and cached[0] == key:
            _, old_lens, tables = cached
            grew = lens - old_lens
            one = np.flatnonzero(grew == 1)
            if len(one):
                tables[one, old_lens[one]] = [block_lists[r][-1] for r in one.tolist()]
            for row in np.flatnonzero((grew != 0) & (grew != 1)).tolist():
                table = block_lists[row]
                tables[row, : len(table)] = table
                tables[row, len(table) :] = 0
        else:
            tables = np.zeros((B, max_blocks + 4), dtype=np.int64)  # room to grow a few blocks
            tables[np.arange(tables.shape[1]) < lens[:, None]] = np.fromiter(
                itertools.chain.from_iterable(block_lists), np.int64, int(lens.sum()))
        self._block_table_cache = (key, lens, tables)
        return tables[:, :max_blocks]
