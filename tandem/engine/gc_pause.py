"""Keep the cyclic garbage collector's full passes off the hot loop.

A full collection walks every tracked object of the process: with torch and transformers loaded
that is several hundred thousand objects, tens to hundreds of milliseconds on the host, while
the GPU waits for the next step. Objects that exist before a loop starts (the model, the
tokenizer, a trainer's optimizer) are not what the loop makes garbage of, so they are frozen
(`gc.freeze`: moved out of the collector's sight) for the loop and given back after. vLLM's
engine-core process freezes its start-up heap the same way.
"""

from __future__ import annotations

import contextlib
import gc


_depth = 0  # frozen_heap blocks open now (process-wide, as the freeze is)


@contextlib.contextmanager
def frozen_heap():
    """Freeze what exists now for the duration of the block; a no-op inside another frozen_heap
    (only the outermost unfreezes). A freeze made by someone else before (a host's sitecustomize
    freezing its few hundred start-up objects, a forking server) does not stand in for this one:
    the heap that exists now is frozen all the same, and on exit `gc.unfreeze`, which cannot give
    back only what this block froze, returns those objects to the collector too."""
    global _depth
    if _depth:
        yield
        return
    _depth += 1
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()  # the frozen objects are collectable again (garbage among them included)
        _depth -= 1


def freeze_for_good() -> None:
    """For a process that lives to run one engine (`tandem serve`'s engine core): collect once,
    then keep everything that survived out of every later full pass."""
    gc.collect()
    gc.freeze()
