"""Trainer -> engine weight sync, with a check that makes a silently skipped sync impossible.

TRL once shipped a sleep-mode path whose sync stopped without a word, and runs trained on rollouts
of the base model. Here every sync bumps the engine's weights_version, and a sampled tensor of the
engine is compared with the trainer's after the copy: a mismatch raises at once.

A sharded (FSDP) trainer hands in `weights`: a callable giving (HF name, full tensor) pairs lazily,
one FSDP unit gathered at a time (`tandem.rl.fsdp.full_weights`). They go to the engine in one
`load_weights` call, which copies each tensor as it arrives: one weights version per sync, and a
level-2 sleep (which needs every weight at once) refills from it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor


class WeightSync:
    def __init__(self, llm, model: torch.nn.Module,
                 weights: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
                 check: Callable[[torch.nn.Module], None] | None = None):
        self.llm = llm
        self.model = model
        self.weights = weights  # None: the engine reads the (unsharded) model itself
        self.check = check  # a further check of the engine's model (LoRA: an adapted weight)
        self.stale = True  # the engine's weights may differ from the trainer's
        self.num_syncs = 0

    def mark_stale(self) -> None:
        self.stale = True

    @torch.no_grad()
    def sync(self) -> None:
        """Wake the engine if it sleeps, and copy the trainer's weights in when they changed."""
        engine = self.llm.llm_engine
        if engine.is_sleeping:
            # Weights first so a level-2 sleep refills before the KV cache takes memory back.
            if self.stale or not engine.weights_valid:
                self.llm.wake_up(["weights"])
                self._copy()
            self.llm.wake_up(["kv_cache"])
        elif self.stale:
            self._copy()

    def _copy(self) -> None:
        engine = self.llm.llm_engine
        before = engine.weights_version
        if self.weights is None:
            self.llm.update_weights_from_model(self.model)
        else:
            self.llm.load_weights(self.weights())
        if engine.weights_version != before + 1:
            raise RuntimeError("weight sync did not reach the engine (weights_version did not move)")
        self._verify()
        self.stale = False
        self.num_syncs += 1

    def _verify(self) -> None:
        """The engine's embedding must equal the trainer's, up to the engine's dtype (under FSDP:
        the rows of this rank's shard)."""
        ours = self.model.get_input_embeddings().weight
        theirs = self.llm.llm_engine.model.model.embed_tokens.weight
        if hasattr(ours, "to_local"):  # a DTensor shard
            ours, rows = local_rows(ours)
            theirs = theirs[rows]
        if torch.equal(ours.to(theirs.dtype), theirs):
            if self.check is not None:  # LoRA: an adapted weight too (the embedding has no adapter)
                self.check(self.llm.llm_engine.model)
            return
        bad = int((~torch.isfinite(ours)).sum())
        if bad:
            landed = torch.allclose(ours.to(theirs.dtype), theirs, rtol=0, atol=0, equal_nan=True)
            raise RuntimeError(
                f"the trainer's weights are not finite ({bad} NaN/inf values in its input embedding), "
                "so the engine would generate from a broken model"
                + ("; the copy itself landed" if landed else "; the copy did not land either")
                + ". An optimizer step wrote them: lower the learning rate or train in fp32 (bf16=False)")
        raise RuntimeError(
            "the weight sync did not land: after the copy the engine's input embedding differs "
            "from the trainer's (finite) one")


def local_rows(t: torch.Tensor) -> tuple[torch.Tensor, slice]:
    """This rank's dim-0 shard of an FSDP2 parameter and the rows of the full tensor it holds
    (FSDP2 shards dim 0 as torch.chunk does). A plain tensor is all rows."""
    if not isinstance(t, DTensor):
        return t, slice(0, t.shape[0])
    local = t.to_local()
    n, world, rank = t.shape[0], t.device_mesh.size(), t.device_mesh.get_local_rank()
    chunk = -(-n // world)
    start = min(rank * chunk, n)
    rows = slice(start, min(start + chunk, n))
    if local.shape[0] != rows.stop - rows.start:
        raise RuntimeError(f"FSDP2 shard of {local.shape[0]} rows where {rows} was expected; "
                           "the shard layout is not torch.chunk's")
    return local, rows
