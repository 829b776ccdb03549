"""GRPO with the engine colocated: the trainer's model and tandem's engine share one device.

    python examples/train_grpo_colocate.py [MODEL_DIR]

With no model, the embedded SmolLM2-135M-Instruct learns the built-in arithmetic task. Reward
functions have TRL's signature, so TRL reward functions work unchanged.
"""

import re
import sys

from tandem.rl import GRPOConfig, GRPOTrainer
from tandem.rl.data import arithmetic_dataset
from tandem.rl.rewards import accuracy_reward


def just_a_number(completions, **kwargs):
    """1.0 when the reply is only a number (TRL signature: completions are message lists here)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if re.fullmatch(r"\s*-?\d+\s*", t) else 0.0 for t in texts]


def main() -> None:
    if len(sys.argv) > 1:
        model = sys.argv[1]
    else:
        from tandem.models import gguf

        model = str(gguf.converted_dir(gguf.default_gguf_path()))
    args = GRPOConfig(
        output_dir="runs/example-grpo", num_generations=8, per_device_train_batch_size=16,
        max_completion_length=16, learning_rate=1e-5, max_steps=10, report_to=["jsonl"],
        gradient_checkpointing=False, vllm_gpu_memory_utilization=0.3, engine_sleep_level=2,
    )
    trainer = GRPOTrainer(
        model, [accuracy_reward, just_a_number], args,
        train_dataset=arithmetic_dataset(500, split="train"),
        eval_dataset=arithmetic_dataset(50, split="test"),
    )
    print("held-out before:", trainer.evaluate())
    trainer.train()
    print("held-out after:", trainer.evaluate())


if __name__ == "__main__":
    main()
