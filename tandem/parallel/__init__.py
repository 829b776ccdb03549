"""Tensor parallelism, applied from outside the model code.

`apply_tp` shards a model for one rank (`tensor_parallel`, `layers`), `groups` builds the process
groups. The engine's executor (`tandem.engine.executor`) spawns the other ranks when an LLM is
used alone.
"""

from tandem.parallel.groups import TPGroup, init_tp_group
from tandem.parallel.tensor_parallel import apply_tp, init_tensor_parallel, validate_tp

__all__ = ["TPGroup", "apply_tp", "init_tensor_parallel", "init_tp_group", "validate_tp"]
