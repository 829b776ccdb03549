"""`tandem bench rl --compare colocate,server`: one GRPO workload on the same two GPUs, two ways.

colocate: two data-parallel ranks (as under torchrun), one per GPU; each rank holds its own engine
          and trainer and generates for half the prompts of every step (`--fsdp`: the trainers
          shard with FSDP2 instead of keeping full replicas).
server:   `tandem serve` on GPU 1 (a subprocess with CUDA_VISIBLE_DEVICES=1, dummy weights of the
          same architecture, replaced by the trainer's initial weights pushed before the first
          rollout) and the trainer on GPU 0 with vllm_mode="server".

Both take the same global batch per step (grpo-1.5b: 32 prompts x 8 generations, 128 in / 256
out, bf16 full fine-tune, beta 0). Reported per mode: median step time after one warm-up step,
completion tokens/s (total and per GPU), each GPU's busy fraction (NVML, gpu_monitor.py), the
step breakdown (generate / weight_sync / reward / train), and the colocate/server throughput ratio.

On a host with two GPUs (H200s), exactly:

    tandem bench rl --compare colocate,server --output rl-colocate-vs-server.json
    tandem bench rl --compare colocate,server --fsdp --output rl-colocate-fsdp-vs-server.json

A small run on a CPU (2 gloo ranks; the server on the CPU too), e.g. with a tiny HF model dir:

    tandem bench rl --compare colocate,server --device cpu --model DIR --num-prompts 4 \\
        --num-generations 2 --prompt-len 8 --completion-len 8 --micro-batch 4 --steps 2
"""

from __future__ import annotations

import json
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

import torch

MODES = ("colocate", "server")
NUM_GPUS = 2  # both modes use two devices: two ranks, or one trainer and one server
PHASES = ("generate", "weight_sync", "reward", "train")


def run_modes(cfg) -> dict:
    """Time every mode named in cfg.compare; returns the bench report."""
    from tandem.bench.report import finish, make_report

    modes = [m for m in cfg.compare.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"--compare {cfg.compare!r}: colocate and server compare only with each other, got {bad}")
    if cfg.device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {cfg.device!r}")
    if cfg.device == "cuda" and torch.cuda.device_count() < NUM_GPUS:
        raise ValueError(f"--compare {cfg.compare} needs {NUM_GPUS} GPUs, this host has "
                         f"{torch.cuda.device_count()}; --device cpu runs it on the CPU")
    if cfg.num_prompts % NUM_GPUS:
        raise ValueError(f"num_prompts ({cfg.num_prompts}) must split evenly over {NUM_GPUS} ranks")
    per_rank = cfg.num_prompts // NUM_GPUS * cfg.num_generations
    if per_rank % cfg.micro_batch:
        raise ValueError(f"micro_batch ({cfg.micro_batch}) must divide each rank's {per_rank} completions")
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-rl-") as work:
        for mode in modes:
            out = Path(work) / f"{mode}.json"
            if mode == "colocate":
                _spawn(_colocate_rank, NUM_GPUS, cfg, work, out)
            else:
                with _server(cfg, work) as (url, key):
                    _spawn(_server_trainer, 1, cfg, work, out, url, key)
            results[mode] = json.loads(out.read_text())
    if "colocate" in results and "server" in results:
        results["colocate_over_server"] = (results["colocate"]["completion_tokens_per_s"]
                                           / results["server"]["completion_tokens_per_s"])
    print_modes(results)
    monitored = any(r["gpu"]["available"] for m, r in results.items() if m in MODES)
    gpu = {"available": monitored, "reason": "per mode: results[mode]['gpu']", "devices": []}
    report = make_report("rl", asdict(cfg), results, gpu)
    finish(report, cfg.output, cfg.print_json)
    return report


def print_modes(results: dict) -> None:
    from tandem.bench.report import print_rows

    rows = []
    for mode in MODES:
        r = results.get(mode)
        if r is None:
            continue
        busy = [f"{b:.0%}" for b in r["gpu_busy_frac"]] if r["gpu_busy_frac"] else ["-"]
        rows.append([mode, r["step_s_median"], r["completion_tokens_per_s"],
                     r["completion_tokens_per_s_per_gpu"], " / ".join(busy),
                     *(r["breakdown_s"][p] for p in PHASES)])
    print_rows("GRPO step on 2 devices: colocated data parallel vs server mode",
               ["mode", "s/step", "compl tok/s", "tok/s/GPU", "GPU busy", *(f"{p} s" for p in PHASES)], rows)
    if "colocate_over_server" in results:
        print(f"colocate / server step throughput: {results['colocate_over_server']:.2f}x")


# ---- the processes ------------------------------------------------------------------------------


def _spawn(fn, nprocs: int, *args) -> None:
    torch.multiprocessing.spawn(fn, args=args, nprocs=nprocs, join=True)


def _colocate_rank(rank: int, cfg, work: str, out: Path) -> None:
    import torch.distributed as dist

    _claim_device(cfg, rank)
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{work}/store", rank=rank, world_size=NUM_GPUS)
    try:
        trainer = _trainer(cfg, NUM_GPUS, vllm_mode="colocate", fsdp=cfg.fsdp)
        result = _timed_steps(trainer, cfg, monitor=rank == 0)
        if rank == 0:
            result["engine_memory"] = trainer.llm.memory_report()
            out.write_text(json.dumps(result))
        dist.barrier()  # tear down together: a rank leaving its store early can abort the other
    finally:
        dist.destroy_process_group()


def _server_trainer(_: int, cfg, work: str, out: Path, url: str, key: str) -> None:
    _claim_device(cfg, 0)
    trainer = _trainer(cfg, 1, vllm_mode="server", vllm_server_base_url=url, vllm_server_api_key=key)
    try:
        out.write_text(json.dumps(_timed_steps(trainer, cfg, monitor=True)))
    finally:
        try:
            trainer.generator.client.close()
        except Exception as e:  # noqa: BLE001 - the timings are written; a teardown error must not lose them
            print(f"warning: closing the weight-push group failed: {e}", file=sys.stderr)


def _claim_device(cfg, index: int) -> None:
    if cfg.device == "cuda":
        torch.cuda.set_device(index)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the trainer takes a GPU whenever it sees one
        torch.set_num_threads(1)  # one core stands in for each device


class _server:
    """`tandem serve` on the second device, dummy weights, admin API on; its URL and key."""

    def __init__(self, cfg, work: str):
        self.cfg, self.work = cfg, work
        self.key = secrets.token_hex(16)

    def __enter__(self) -> tuple[str, str]:
        from tandem.bench.rl_workload import hf_config_of
        from tandem.bench.synthetic_tokenizer import synthetic_tokenizer

        cfg = self.cfg
        tok_dir = Path(self.work) / "tokenizer"  # the trainer's tokenizer, so texts agree
        hf_config = hf_config_of(cfg)
        synthetic_tokenizer(hf_config.vocab_size, hf_config.eos_token_id).save_pretrained(tok_dir)
        cmd = [sys.executable, "-m", "tandem.cli", "serve", cfg.model, "--port", "0", "--api-key", self.key,
               "--enable-admin-api", "--load-format", "dummy", "--tokenizer", str(tok_dir),
               "--device", cfg.device, "--dtype", "bfloat16" if cfg.device == "cuda" else "float32",
               "--max-model-len", str(cfg.prompt_len + cfg.completion_len), "--max-num-seqs", "256",
               "--gpu-memory-utilization", str(cfg.server_gpu_memory_utilization),
               "--logprobs-mode", "processed_logprobs", "--seed", str(cfg.seed), "--log-level", "warning"]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=_second_gpu() if cfg.device == "cuda" else "")
        if cfg.device == "cpu":
            env["OMP_NUM_THREADS"] = "1"
            cmd += ["--cpu-kv-cache-space-gib", str(cfg.cpu_kv_cache_space_gib)]
        self.log = open(Path(self.work) / "server.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        try:
            url = self._wait_listening(cfg.server_timeout_s)
        except BaseException:
            self.__exit__()
            raise
        return url, self.key

    def _wait_listening(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        for line in self.proc.stdout:  # the server prints its address once the model is loaded
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                url = m.group(1)
                while time.monotonic() < deadline:
                    try:
                        urllib.request.urlopen(url + "/health", timeout=5).close()
                        return url
                    except OSError:
                        time.sleep(0.2)
            if time.monotonic() > deadline:
                break
        self.log.seek(0)
        raise RuntimeError(f"tandem serve did not come up (exit {self.proc.poll()}): {self.log.read()[-2000:]}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ---- one mode's steps ---------------------------------------------------------------------------


def _trainer(cfg, world_size: int, **overrides):
    from tandem.bench.rl_workload import batching as workload_batching
    from tandem.bench.rl_workload import even_token_reward, model_and_data
    from tandem.rl import GRPOConfig, GRPOTrainer

    model, tok, data = model_and_data(cfg)
    batching = workload_batching(cfg)
    batching["gradient_accumulation_steps"] //= world_size  # each rank: its share of the global batch
    batching["bf16"] = cfg.device == "cuda"
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="tandem-bench-rl-run-"), report_to="none",
                      save_steps=10**9, max_prompt_length=cfg.prompt_len,
                      vllm_gpu_memory_utilization=cfg.gpu_memory_utilization, engine_sleep_level=cfg.sleep_level,
                      lr_scheduler_type="constant", shuffle_dataset=False, **batching, **overrides)
    engine_kwargs = {"max_num_seqs": 256}
    if cfg.device == "cpu":
        engine_kwargs |= {"device": "cpu", "cpu_kv_cache_space_gib": cfg.cpu_kv_cache_space_gib}
    return GRPOTrainer(model, even_token_reward, args, train_dataset=data, processing_class=tok,
                       engine_kwargs=engine_kwargs if args.vllm_mode == "colocate" else None)


def _timed_steps(trainer, cfg, monitor: bool) -> dict:
    """One warm-up step, then cfg.steps timed ones under the GPU monitor."""
    from tandem.bench.gpu_monitor import GpuMonitor

    sync = torch.cuda.synchronize if cfg.device == "cuda" else (lambda: None)
    trainer.step()
    steps = []
    with GpuMonitor(indices=_gpu_indices(), enabled=monitor and cfg.device == "cuda") as mon:
        for _ in range(cfg.steps):
            sync()
            t0 = time.perf_counter()
            m = trainer.step()
            sync()
            m["wall"] = time.perf_counter() - t0
            steps.append(m)
    wall = statistics.median(s["wall"] for s in steps)
    tokens = statistics.mean(s["completions/num_tokens"] for s in steps)  # the global batch's
    gpu = mon.summary()
    return {
        "step_s_median": wall, "step_s": [s["wall"] for s in steps],
        "completion_tokens_per_step": tokens, "completion_tokens_per_s": tokens / wall,
        "completion_tokens_per_s_per_gpu": tokens / wall / NUM_GPUS,
        "breakdown_s": {p: statistics.median(s[f"time/{p}"] for s in steps) for p in PHASES},
        "gpu_busy_frac": [d["util_mean"] / 100 for d in gpu["devices"] if d.get("util_mean") is not None],
        "gpu": gpu, "world_size": trainer.dist.world_size, "fsdp": trainer.args.fsdp,
        "vllm_mode": trainer.args.vllm_mode,
    }


def _visible() -> list[str]:
    return [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]


def _second_gpu() -> str:
    """The server's GPU: the second visible one (GPU 1 unless CUDA_VISIBLE_DEVICES says otherwise)."""
    ids = _visible()
    return ids[1] if len(ids) > 1 else "1"


def _gpu_indices() -> list[int]:
    """NVML numbers the physical GPUs: the two this bench uses are the first two visible ones."""
    ids = _visible()
    return [int(v) for v in ids[:NUM_GPUS]] if ids and all(v.isdigit() for v in ids) else list(range(NUM_GPUS))
