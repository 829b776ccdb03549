"""Data-parallel colocated GRPO: one process per GPU, each with its own engine and model replica.

    torchrun --standalone --nproc-per-node 2 examples/train_grpo_ddp.py [MODEL_DIR]

Each rank generates for its slice of every global batch (prompts_per_generation prompts per rank,
as TRL's per-device settings), gradients are summed over ranks, and one step equals the
single-process step on the whole batch. Rank 0 logs and writes checkpoints; rerunning the same
command resumes from the newest checkpoint in output_dir. On CPU-only machines it uses gloo.
"""

import os
import sys

import torch
import torch.distributed as dist

from tandem.rl import GRPOConfig, GRPOTrainer
from tandem.rl.checkpoint import latest_checkpoint
from tandem.rl.data import arithmetic_dataset
from tandem.rl.rewards import accuracy_reward, short_answer_reward


def main() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # "cuda" now means this rank's GPU
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if len(sys.argv) > 1:
        model = sys.argv[1]
    else:
        from tandem.models import gguf

        model = str(gguf.converted_dir(gguf.default_gguf_path()))  # every rank reads the same cache
    args = GRPOConfig(
        output_dir="runs/example-grpo-ddp", num_generations=8, per_device_train_batch_size=16,
        max_prompt_length=128, max_completion_length=16, learning_rate=1e-5, max_steps=10, report_to=["jsonl"],
        gradient_checkpointing=False, vllm_gpu_memory_utilization=0.3, engine_sleep_level=2,
        save_steps=5,
    )
    try:
        trainer = GRPOTrainer(model, [accuracy_reward, short_answer_reward], args,
                              train_dataset=arithmetic_dataset(500, split="train"))
        resume = latest_checkpoint(args.output_dir) is not None
        last = trainer.train(resume_from_checkpoint=resume)
        if trainer.dist.is_main and last:
            print(f"world size {trainer.dist.world_size}, step {trainer.global_step}: "
                  f"loss {last['loss']:.4f}, reward {last['reward']:.3f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
