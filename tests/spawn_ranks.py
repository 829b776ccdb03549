"""Spawned ranks whose deaths explain themselves.

`torch.multiprocessing.spawn` reports a rank killed by a signal as "process 1 terminated with
signal SIGABRT" and nothing else: the C++ message that preceded the abort went to a stderr the
test run captured and cut. `spawn_ranks` writes each rank's stderr to its own log, dumps every
thread's Python stack there on a fatal signal (faulthandler), and on a failure raises with the
tail of each rank's log."""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import torch.multiprocessing as tmp
from torch.multiprocessing.spawn import ProcessException

TAIL_CHARS = 4000


def _logged(rank: int, fn, log_dir: str, args: tuple) -> None:
    with open(os.path.join(log_dir, f"rank{rank}.log"), "w", buffering=1) as log:
        sys.stderr.flush()
        os.dup2(log.fileno(), 2)  # C++ (gloo, libstdc++'s terminate) writes to fd 2 directly
        sys.stderr = log
        faulthandler.enable(file=log, all_threads=True)
        fn(rank, *args)
        faulthandler.disable()


def spawn_ranks(fn, nprocs: int, *args, log_dir: str | Path) -> None:
    """`fn(rank, *args)` in `nprocs` spawned processes; joins them all."""
    os.makedirs(log_dir, exist_ok=True)
    try:
        tmp.spawn(_logged, args=(fn, str(log_dir), args), nprocs=nprocs, join=True)
    except ProcessException as e:
        tails = []
        for rank in range(nprocs):
            path = Path(log_dir) / f"rank{rank}.log"
            text = path.read_text(errors="replace") if path.exists() else "(no log)"
            tails.append(f"--- rank {rank} stderr (last {TAIL_CHARS} chars) ---\n{text[-TAIL_CHARS:]}")
        raise RuntimeError(f"{e}\n" + "\n".join(tails)) from None  # the tails say more than spawn's frames
