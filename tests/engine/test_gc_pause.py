"""frozen_heap: full GC passes skip what predates the block, and get it back after."""

import gc
import weakref

from tandem.engine.gc_pause import frozen_heap


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_frozen_heap_hides_then_returns_the_old_heap():
    assert gc.get_freeze_count() == 0
    old = Node()
    old_ref = weakref.ref(old)
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        mid = Node()  # made after the outer freeze
        mid_ref = weakref.ref(mid)
        with frozen_heap():  # nested: a no-op, so `mid` stays in the collector's sight
            # frozen objects freed by refcount leave the count: it may drop, never grow
            assert gc.get_freeze_count() <= frozen
            del mid
            gc.collect()
            assert mid_ref() is None
        assert gc.get_freeze_count() > 0  # the inner block's exit left the outer freeze alone
        del old
        gc.collect()
        assert old_ref() is not None  # frozen: no pass looks at it
        fresh = Node()
        fresh_ref = weakref.ref(fresh)
        del fresh
        gc.collect()
        assert fresh_ref() is None  # garbage made inside the block is collected as usual
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None  # back in the collector's sight, and collected


def test_frozen_heap_unfreezes_on_error():
    try:
        with frozen_heap():
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0



def test_frozen_heap_freezes_beside_a_foreign_freeze():
    """Someone froze a few objects before (the GPU host's interpreter starts with 375 frozen):
    the block still freezes the heap that exists when it starts."""
    gc.freeze()  # the foreign freeze
    try:
        old = Node()  # made after it, before the block
        old_ref = weakref.ref(old)
        with frozen_heap():
            del old
            gc.collect()
            assert old_ref() is not None  # frozen by the block: no pass looks at it
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None
