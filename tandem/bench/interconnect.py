"""`tandem bench interconnect`: how the GPUs of this host talk to each other.

GPU pairs' links from NVML (NVLink or the PCIe level, as `nvidia-smi topo -m` names them),
peer-to-peer copy bandwidth (torch copies timed with CUDA events), all-reduce bandwidth over
message sizes (algbw = bytes / time; busbw = algbw * 2(n-1)/n, nccl-tests' definition) and
small-message all-reduce latency, eager and inside a CUDA graph. One process per rank, started
with torch.multiprocessing spawn on a free port. `--backend gloo` runs the same path on CPUs.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

BACKENDS = ("auto", "nccl", "gloo")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_LEVELS = {0: "same board", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def parse_bytes(text: str) -> int:
    """'8K' -> 8192, '1G' -> 2**30, '768K' -> 786432."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    return int(float(t[: len(t) - len(unit)]) * _UNITS[unit])


def fmt_bytes(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


@dataclass
class InterconnectConfig:
    """What to measure; sizes accept K/M/G suffixes (powers of 1024)."""

    backend: str = "auto"  # auto: nccl with >= 2 GPUs, else report "no GPU" | nccl | gloo (CPU)
    world_size: int | None = None  # None: every GPU (nccl), 2 (gloo)
    min_bytes: str = "8K"
    max_bytes: str | None = None  # None: 1G with nccl, 16M with gloo
    iters: int = 20  # timed all-reduces per size (5x that at <= 1M)
    warmup_iters: int = 5
    latency_bytes: str = "8K,64K,768K"  # small messages: eager and CUDA-graph latency
    graph_ops: int = 20  # all-reduces captured in one CUDA graph
    p2p_bytes: str = "256M"
    p2p_iters: int = 10

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.world_size is not None and self.world_size < 2:
            raise ValueError(f"world_size must be >= 2 for an all-reduce, got {self.world_size}")
        if parse_bytes(self.min_bytes) < 4:
            raise ValueError(f"min_bytes must be >= 4 (one float32), got {self.min_bytes!r}")
        if self.iters < 1 or self.warmup_iters < 0 or self.graph_ops < 1:
            raise ValueError("iters and graph_ops must be >= 1, warmup_iters >= 0")


def message_sizes(cfg: InterconnectConfig, backend: str) -> list[int]:
    lo = parse_bytes(cfg.min_bytes)
    hi = parse_bytes(cfg.max_bytes or ("1G" if backend == "nccl" else "16M"))
    sizes = []
    while lo <= hi:
        sizes.append(lo)
        lo *= 2
    return sizes


def gpu_topology() -> dict:
    """Every GPU pair's link from NVML; {'available': False, 'reason': ...} without one."""
    try:
        import pynvml as nv

        nv.nvmlInit()
    except Exception as e:  # no module, no library, no driver
        return {"available": False, "reason": f"no GPU: {type(e).__name__}: {e}"}
    try:
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        if not handles:
            return {"available": False, "reason": "no GPU: NVML sees no device"}
        bus = [_s(nv.nvmlDeviceGetPciInfo(h).busId) for h in handles]
        remote = [_nvlink_remotes(nv, h) for h in handles]
        devices = [
            {
                "index": i,
                "name": _s(nv.nvmlDeviceGetName(h)),
                "pci_bus_id": bus[i],
                "nvlinks_active": len(remote[i]),
            }
            for i, h in enumerate(handles)
        ]
        pairs = []
        for i in range(len(handles)):
            for j in range(i + 1, len(handles)):
                pairs.append(_pair(nv, handles, bus, remote, i, j))
        return {"available": True, "reason": "", "devices": devices, "pairs": pairs}
    finally:
        nv.nvmlShutdown()


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _nvlink_remotes(nv, handle) -> list[str]:
    """PCI bus id at the far end of each active NVLink ('' when that is an NVSwitch port)."""
    out = []
    for link in range(nv.NVML_NVLINK_MAX_LINKS):
        try:
            if nv.nvmlDeviceGetNvLinkState(handle, link) != nv.NVML_FEATURE_ENABLED:
                continue
        except Exception:  # this link absent, or no NVLink at all
            if link == 0:
                break
            continue
        try:
            out.append(_s(nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
        except Exception:
            out.append("")
    return out


def _pair(nv, handles, bus, remote, i: int, j: int) -> dict:
    level = None
    with contextlib.suppress(Exception):
        level = nv.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
    try:
        status = nv.nvmlDeviceGetP2PStatus(handles[i], handles[j], nv.NVML_P2P_CAPS_INDEX_NVLINK)
        nvlink = status == nv.NVML_P2P_STATUS_OK
    except Exception:
        nvlink = False
    direct = sum(r == bus[j] for r in remote[i])
    if nvlink:
        link = f"NVLink x{direct}" if direct else "NVLink (NVSwitch)"
    else:
        link = f"PCIe {_LEVELS.get(level, '?')}"
    return {
        "a": i,
        "b": j,
        "link": link,
        "nvlink": nvlink,
        "direct_nvlinks": direct,
        "pcie_level": _LEVELS.get(level),
    }


def p2p_bandwidth(nbytes: int, iters: int) -> list[dict]:
    """Copy `nbytes` from cuda:i to cuda:j for every ordered pair; GB/s from CUDA events on the
    source device's stream (PyTorch runs a cross-device copy there)."""
    import torch

    n = torch.cuda.device_count()
    src = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}") for i in range(n)]
    dst = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}") for i in range(n)]
    rows = []
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            for _ in range(2):
                dst[j].copy_(src[i], non_blocking=True)
            torch.cuda.synchronize(i)
            torch.cuda.synchronize(j)
            with torch.cuda.device(i):
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                for _ in range(iters):
                    dst[j].copy_(src[i], non_blocking=True)
                end.record()
                end.synchronize()
            ms = start.elapsed_time(end) / iters
            rows.append(
                {
                    "src": i,
                    "dst": j,
                    "bytes": nbytes,
                    "time_us": ms * 1e3,
                    "gb_s": nbytes / (ms / 1e3) / 1e9,
                    "peer_access": torch.cuda.can_device_access_peer(i, j),
                }
            )
    return rows


class _Timer:
    """CUDA events on a GPU, perf_counter on a CPU; `stop()` returns seconds."""

    def __init__(self, cuda: bool):
        import torch

        self.cuda = cuda
        if cuda:
            self.start_ev, self.end_ev = (torch.cuda.Event(enable_timing=True) for _ in range(2))

    def start(self) -> None:
        if self.cuda:
            self.start_ev.record()
        else:
            self.t = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.end_ev.record()
            self.end_ev.synchronize()
            return self.start_ev.elapsed_time(self.end_ev) / 1e3
        return time.perf_counter() - self.t


def _allreduce_worker(
    rank: int, world: int, backend: str, port: int, cfg: dict, sizes: list, out_path: str
) -> None:
    """One rank: check correctness once, then time all-reduces of every size (the slowest
    rank's time counts) and small-message latency eager and in a CUDA graph."""
    import torch
    import torch.distributed as dist

    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    try:
        x = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(x)
        correct = bool((x == world * (world + 1) / 2).all())
        timer = _Timer(cuda)

        def slowest(seconds: float) -> float:
            t = torch.tensor([seconds], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t.item())

        bw = []
        for nbytes in sizes:
            buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
            iters = cfg["iters"] * (5 if nbytes <= 1 << 20 else 1)
            for _ in range(cfg["warmup_iters"]):
                dist.all_reduce(buf)
            timer.start()
            for _ in range(iters):
                dist.all_reduce(buf)
            sec = slowest(timer.stop() / iters)
            algbw = nbytes / sec / 1e9
            bw.append(
                {
                    "bytes": nbytes,
                    "time_us": sec * 1e6,
                    "algbw_gb_s": algbw,
                    "busbw_gb_s": algbw * 2 * (world - 1) / world,
                }
            )
        lat = [_latency(dist, torch, device, timer, slowest, n, cfg) for n in cfg["latency"]]
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"correct": correct, "bandwidth": bw, "latency": lat}, f)
    finally:
        dist.destroy_process_group()


def _latency(dist, torch, device, timer, slowest, nbytes: int, cfg: dict) -> dict:
    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    n = max(50, cfg["iters"] * 5)
    for _ in range(cfg["warmup_iters"] + 1):
        dist.all_reduce(buf)
    timer.start()
    for _ in range(n):
        dist.all_reduce(buf)
    row = {
        "bytes": nbytes,
        "eager_us": slowest(timer.stop() / n) * 1e6,
        "graph_us": None,
        "graph_error": None,
    }
    if device.type != "cuda":
        row["graph_error"] = "CUDA graphs need a GPU (nccl)"
        return row
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                dist.all_reduce(buf)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(cfg["graph_ops"]):
                dist.all_reduce(buf)
        graph.replay()
        torch.cuda.synchronize()
        replays = 10
        timer.start()
        for _ in range(replays):
            graph.replay()
        row["graph_us"] = slowest(timer.stop() / (replays * cfg["graph_ops"])) * 1e6
    except Exception as e:  # capture unsupported by this torch/NCCL: say so, keep the rest
        row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_allreduce(cfg: InterconnectConfig, backend: str, world: int) -> dict:
    """Spawn `world` ranks on a free port; rank 0's figures."""
    import torch.multiprocessing as tmp

    sizes = message_sizes(cfg, backend)
    worker_cfg = {
        "iters": cfg.iters,
        "warmup_iters": cfg.warmup_iters,
        "graph_ops": cfg.graph_ops,
        "latency": [parse_bytes(b) for b in cfg.latency_bytes.split(",") if b.strip()],
    }
    with tempfile.TemporaryDirectory() as tmpdir:
        out = os.path.join(tmpdir, "rank0.json")
        t = time.perf_counter()
        tmp.spawn(
            _allreduce_worker,
            args=(world, backend, _free_port(), worker_cfg, sizes, out),
            nprocs=world,
            join=True,
        )
        with open(out) as f:
            res = json.load(f)
    res.update(backend=backend, world_size=world, wall_s=time.perf_counter() - t)
    return res


def run_interconnect(cfg: InterconnectConfig) -> dict:
    """Topology, p2p copies and all-reduce, each where the machine allows; report kind
    'interconnect' whose results say 'no GPU' plainly when there is none."""
    import torch

    from tandem.bench import report as rp
    from tandem.bench.gpu_monitor import GpuMonitor

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if n_gpu >= 2 else None)
    results: dict = {
        "num_gpus": n_gpu,
        "topology": gpu_topology(),
        "p2p": None,
        "allreduce": None,
        "notes": [],
    }
    if n_gpu == 0:
        results["notes"].append("no GPU: torch.cuda.is_available() is False")
    if backend is None:
        results["notes"].append(
            "all-reduce needs 2 GPUs for nccl; --backend gloo --world-size 2 runs it on CPUs"
        )
    with GpuMonitor() as mon:
        if n_gpu >= 2 and cfg.backend != "gloo":
            results["p2p"] = p2p_bandwidth(parse_bytes(cfg.p2p_bytes), cfg.p2p_iters)
        if backend == "nccl" and n_gpu < 2:
            raise RuntimeError(f"--backend nccl needs >= 2 GPUs; this host has {n_gpu}")
        if backend is not None:
            world = cfg.world_size or (n_gpu if backend == "nccl" else 2)
            if backend == "nccl" and world > n_gpu:
                raise RuntimeError(f"world_size {world} > {n_gpu} GPUs")
            results["allreduce"] = run_allreduce(cfg, backend, world)
    return rp.make_report("interconnect", asdict(cfg), results, mon.summary())


def print_interconnect(report: dict) -> None:
    from tandem.bench import report as rp

    res, out = report["results"], rp.console()
    topo = res["topology"]
    if topo["available"]:
        n = len(topo["devices"])
        links = {(p["a"], p["b"]): p["link"] for p in topo["pairs"]}
        links.update({(b, a): v for (a, b), v in links.items()})
        rows = [
            [f"GPU{i} {topo['devices'][i]['name']}"]
            + ["X" if i == j else links[(i, j)] for j in range(n)]
            for i in range(n)
        ]
        rp.print_rows("GPU links (NVML indices)", ["", *[f"GPU{j}" for j in range(n)]], rows)
    else:
        out.print(f"topology: {topo['reason']}", markup=False)
    if res["p2p"]:
        rp.print_rows(
            "peer-to-peer copy",
            ["src -> dst", "GB/s", "peer access"],
            [
                [f"cuda:{r['src']} -> cuda:{r['dst']}", r["gb_s"], r["peer_access"]]
                for r in res["p2p"]
            ],
        )
    ar = res["allreduce"]
    if ar:
        title = f"all-reduce, {ar['backend']}, {ar['world_size']} ranks, float32"
        rp.print_rows(
            title,
            ["size", "time (us)", "algbw (GB/s)", "busbw (GB/s)"],
            [
                [fmt_bytes(r["bytes"]), r["time_us"], r["algbw_gb_s"], r["busbw_gb_s"]]
                for r in ar["bandwidth"]
            ],
        )
        rp.print_rows(
            "small all-reduce latency",
            ["size", "eager (us)", "CUDA graph (us)"],
            [
                [fmt_bytes(r["bytes"]), r["eager_us"], r["graph_us"] or r["graph_error"]]
                for r in ar["latency"]
            ],
        )
        if not ar["correct"]:
            out.print("all-reduce gave a WRONG sum", style="bold red")
    for note in res["notes"]:
        out.print(note, markup=False)
