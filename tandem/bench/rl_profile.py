"""`tandem bench rl --profile-train FILE`: the train phase (`PolicyUpdate.run`) of one step under
torch.profiler, CPU and (where there is one) CUDA activities; FILE gets the operators' table
(`key_averages`) sorted by device time, by CPU time where there is no GPU.

The profiled step comes after the timed ones, so the profiler's overhead stays out of their times.
"""

from __future__ import annotations

from pathlib import Path

import torch


def profile_train_phase(trainer, path: str, row_limit: int = 60) -> dict:
    """One more trainer step with its train phase profiled; writes the table to `path`."""
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    run, held = trainer.update.run, {}

    def profiled(*args, **kwargs):
        with profile(activities=activities) as prof:
            out = run(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
        held["prof"] = prof
        return out

    trainer.update.run = profiled  # for this one step
    try:
        m = trainer.step()
    finally:
        del trainer.update.run  # the class's method again
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    header = (f"# tandem bench rl --profile-train: the train phase of one step (PolicyUpdate.run), "
              f"{m['time/train']:.3f} s under the profiler, {m['train/micro_batches']:g} micro-batches "
              f"per optimizer step, {m['train/tokens']:.0f} real tokens; sorted by {sort_by}\n")
    table = held["prof"].key_averages().table(sort_by=sort_by, row_limit=row_limit)
    Path(path).write_text(header + table + "\n")
    return {"file": path, "sort_by": sort_by, "train_s": m["time/train"]}
