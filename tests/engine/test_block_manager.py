"""BlockManager in plain Python: ref counts, prefix-cache hits, collisions, eviction order."""

from tandem.engine.block_manager import BlockManager
from tandem.engine.sequence import Sequence
from tandem.sampling_params import SamplingParams


def seq(tokens):
    return Sequence(list(tokens), SamplingParams())


def admit(bm, s):
    cached = bm.find_cached_blocks(s)
    n = s.num_tokens - len(cached) * bm.block_size
    assert bm.can_allocate(s, cached, n)
    bm.allocate(s, cached, n)
    return len(cached)


def finish_prefill(bm, s):
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_allocate_and_free_all_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(range(10)), seq(range(100, 103))
    admit(bm, a)
    admit(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 1
    assert not set(a.block_table) & set(b.block_table)
    assert bm.num_free_blocks == 4
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 8


def test_prefix_hit_shares_blocks_and_leaves_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(range(12))
    admit(bm, a)
    finish_prefill(bm, a)
    b = seq(range(12))  # identical prompt: 2 full blocks hit, the last block is recomputed
    hits = admit(bm, b)
    assert hits == 2
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_computed_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    c = seq(list(range(8)) + [99, 98, 97, 96, 95])  # shares 2 blocks, then diverges
    assert admit(bm, c) == 2
    for s in (a, b, c):
        bm.deallocate(s)
    assert bm.num_free_blocks == 16


def test_freed_cached_blocks_still_hit_until_evicted():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    finish_prefill(bm, a)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4
    b = seq([1, 2, 3, 4, 9])
    assert admit(bm, b) == 2  # blocks came back from the free list
    bm.deallocate(b)
    # Fill the whole cache with other tokens: the cached prefix is evicted.
    c = seq(range(50, 58))
    admit(bm, c)
    bm.deallocate(c)
    assert bm.find_cached_blocks(seq([1, 2, 3, 4, 9])) == []


def test_hash_collision_is_caught_by_token_check(monkeypatch):
    import tandem.engine.block_manager as mod

    monkeypatch.setattr(mod, "chain_hash", lambda parent, tokens: 42)  # every block collides
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3])
    admit(bm, a)
    finish_prefill(bm, a)
    assert bm.find_cached_blocks(seq([7, 8, 9])) == []
    assert len(bm.find_cached_blocks(seq([1, 2, 9]))) == 1


def test_uncached_blocks_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq([1, 2, 3])  # block 0 full and cached, block 1 partial
    admit(bm, a)
    finish_prefill(bm, a)
    cached_block = a.block_table[0]
    bm.deallocate(a)
    b = seq([9])
    admit(bm, b)
    assert b.block_table[0] != cached_block


def test_try_append_takes_blocks_only_when_all_fit():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = seq(range(4))
    admit(bm, a)
    a.num_computed_tokens = 4
    assert not bm.try_append(a, 5)  # needs 2 more blocks, 1 is free: nothing taken
    assert len(a.block_table) == 1 and bm.num_free_blocks == 1
    assert bm.try_append(a, 4)
    assert len(a.block_table) == 2 and bm.num_free_blocks == 0
    assert bm.try_append(a, 4)  # already covered: no new block needed


def test_reset_prefix_cache_forgets_hashes():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    finish_prefill(bm, a)
    bm.deallocate(a)
    bm.reset_prefix_cache()
    assert bm.find_cached_blocks(seq([1, 2, 3, 4, 5])) == []
