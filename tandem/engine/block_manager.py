"""BlockManager: the paged KV cache's bookkeeping (fixed-size blocks, ref counts, prefix cache)."""

from __future__ import annotations

from collections import OrderedDict

from tandem.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # set once the block is full and its KV computed
        self.token_ids: tuple[int, ...] = ()


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block that also covers every block before it."""
    return hash((parent_hash, token_ids))


class BlockManager:
    """Hands out KV-cache blocks to sequences.

    A full block whose KV has been computed is registered under the chained hash of its tokens, so a
    later prompt with the same prefix reuses it. Freed blocks keep their hash and sit in an LRU free
    list; they are evicted only when a fresh block is needed.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Blocks of the prefix cache that hold the longest cached prefix of `seq`.

        At least the last token is left to compute, so the step that runs it yields logits. None
        for a sequence that still needs its prompt logprobs: every prompt token must run.
        """
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.hash_to_block_id.get(self._block_hash(seq, i))
            if block_id is None or self.blocks[block_id].token_ids != self._block_tokens(seq, i):
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        """Whether `seq`, holding no blocks yet, can take `cached` plus what `num_new_tokens` need."""
        new = self.blocks_needed(len(cached) * self.block_size + num_new_tokens) - len(cached)
        reused_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return new + reused_free <= self.num_free_blocks

    def try_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give `seq` the blocks its computed tokens plus `num_new_tokens` need, if enough are free."""
        bs = self.block_size
        needed = (seq.num_computed_tokens + num_new_tokens + bs - 1) // bs - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > len(self.free_block_ids):
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    # -- changes -------------------------------------------------------------------------------
    def allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> None:
        """Give a sequence with no blocks its cached prefix blocks plus fresh ones."""
        assert not seq.block_table, f"{seq} already holds blocks"
        self.num_prefix_queries += seq.num_tokens
        self.num_prefix_hits += len(cached) * self.block_size
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(cached) * self.block_size
        self.append_slots(seq, num_new_tokens)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make sure `seq` owns blocks for its computed tokens plus `num_new_tokens`."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        while len(seq.block_table) < needed:
            seq.block_table.append(self._take_free_block())

    def deallocate(self, seq: Sequence) -> None:
        # Tail blocks go to the free list first so they are evicted before the shared prefix.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if block.hash is None:  # nothing cached in it: reuse it before cached blocks
                    self.free_block_ids.move_to_end(block_id, last=False)
        seq.block_table.clear()
        seq.block_table_epoch += 1
        seq.num_registered_blocks = 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register blocks that became full of computed tokens under their chained hash. A block
        whose ids are not all known yet (a decode window's tokens still in flight) waits for a
        later call."""
        known = min(seq.num_computed_tokens, len(seq.token_ids))
        num_full = min(known // self.block_size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks or not self.enable_prefix_caching:
            return  # the common case, every decode step: no block filled up
        for i in range(seq.num_registered_blocks, num_full):
            h = self._block_hash(seq, i)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block_id:
                block.hash = h
                block.token_ids = self._block_tokens(seq, i)
                self.hash_to_block_id[h] = block.block_id
        seq.num_registered_blocks = num_full

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def _block_hash(self, seq: Sequence, i: int) -> int:
        """Chained hash of the sequence's i-th full block, memoised on the sequence."""
        hashes = seq.block_hashes
        while len(hashes) <= i:
            parent = hashes[-1] if hashes else None
            hashes.append(chain_hash(parent, self._block_tokens(seq, len(hashes))))
        return hashes[i]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (after a weight update the cached KV is stale)."""
        for block_id in self.hash_to_block_id.values():  # every block with a hash is in it
            block = self.blocks[block_id]
            block.hash = None
            block.token_ids = ()
        self.hash_to_block_id.clear()

    def _take_free_block(self) -> int:
        if not self.free_block_ids:
            raise RuntimeError("out of KV-cache blocks: the scheduler should have preempted first")
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id
