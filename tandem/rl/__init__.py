"""GRPO-family RL training colocated with the engine: config, losses, rewards, data, checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.rl.config import GRPOConfig

if TYPE_CHECKING:
    from tandem.rl.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]


def __getattr__(name: str) -> Any:
    # The trainer pulls in the engine; import it only when asked for.
    if name == "GRPOTrainer":
        from tandem.rl.trainer import GRPOTrainer

        return GRPOTrainer
    raise AttributeError(f"module 'tandem.rl' has no attribute {name!r}")
