"""GPU monitor: NVML samples at >= 10 Hz in a background thread, summarised with the run.

NVML "utilization" is the share of time any kernel ran, not how busy the SMs were; on Hopper the
GPM metrics (SM activity, DRAM bandwidth utilization) say more and are read where available.
Without NVML or a device the monitor records nothing and reports `available: false`.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time

import numpy as np

FIELDS = (
    "util",
    "mem_util",
    "mem_used_gb",
    "power_w",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "sm_active",
    "sm_occupancy",
    "dram_bw_util",
    "tensor_active",
)


class NvmlBackend:
    """Reads one sample of every field from each device; fields NVML refuses are None."""

    GPM_MIN_GAP_S = 0.1  # GPM metrics are rates between two samples; keep the gap meaningful

    def __init__(self, indices: list[int] | None = None):
        import pynvml  # nvidia-ml-py

        self.nv = pynvml
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            pynvml.nvmlShutdown()
            raise RuntimeError("NVML sees no GPU")
        self.indices = list(range(count)) if indices is None else list(indices)
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices]
        self.gpm = [self._gpm_setup(h) for h in self.handles]
        self._gpm_last = [
            dict.fromkeys(("sm_active", "sm_occupancy", "dram_bw_util", "tensor_active"))
            for _ in self.handles
        ]

    def _gpm_setup(self, handle) -> dict | None:
        nv = self.nv
        try:
            if not nv.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                return None
            sample = nv.nvmlGpmSampleAlloc()
            nv.nvmlGpmSampleGet(handle, sample)
            return {"prev": sample, "cur": nv.nvmlGpmSampleAlloc(), "t": time.perf_counter()}
        except Exception:  # older driver, non-Hopper GPU, or bindings without GPM
            return None

    def device_info(self) -> list[dict]:
        nv, out = self.nv, []
        for i, h in zip(self.indices, self.handles):
            name = nv.nvmlDeviceGetName(h)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            out.append(
                {
                    "index": i,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "memory_total_gb": mem.total / 1e9,
                    "gpm": self.gpm[len(out)] is not None,
                }
            )
        return out

    def read(self) -> list[dict]:
        return [self._read_one(k) for k in range(len(self.handles))]

    def _read_one(self, k: int) -> dict:
        nv, h = self.nv, self.handles[k]
        s: dict = dict.fromkeys(FIELDS)
        for key, fn in (
            ("util", lambda: nv.nvmlDeviceGetUtilizationRates(h)),
            ("mem_used_gb", lambda: nv.nvmlDeviceGetMemoryInfo(h).used / 1e9),
            ("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ("sm_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
            ("mem_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
        ):
            with contextlib.suppress(Exception):  # a field this GPU or driver lacks: None
                s[key] = fn()
        if s["util"] is not None:
            s["util"], s["mem_util"] = float(s["util"].gpu), float(s["util"].memory)
        s.update(self._read_gpm(k))
        return s

    def _read_gpm(self, k: int) -> dict:
        g = self.gpm[k]
        if g is None or time.perf_counter() - g["t"] < self.GPM_MIN_GAP_S:
            return self._gpm_last[k]
        nv = self.nv
        ids = {
            "sm_active": nv.NVML_GPM_METRIC_SM_UTIL,
            "sm_occupancy": nv.NVML_GPM_METRIC_SM_OCCUPANCY,
            "dram_bw_util": nv.NVML_GPM_METRIC_DRAM_BW_UTIL,
            "tensor_active": nv.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
        }
        try:
            nv.nvmlGpmSampleGet(self.handles[k], g["cur"])
            q = nv.c_nvmlGpmMetricsGet_t()
            q.version, q.numMetrics = nv.NVML_GPM_METRICS_GET_VERSION, len(ids)
            q.sample1, q.sample2 = g["prev"], g["cur"]
            for j, metric_id in enumerate(ids.values()):
                q.metrics[j].metricId = metric_id
            nv.nvmlGpmMetricsGet(q)
            vals = {
                key: (float(q.metrics[j].value) if q.metrics[j].nvmlReturn == 0 else None)
                for j, key in enumerate(ids)
            }
            g["prev"], g["cur"], g["t"] = g["cur"], g["prev"], time.perf_counter()
            self._gpm_last[k] = vals
        except Exception:
            self.gpm[k] = None  # degrade: stop asking rather than fail every sample
        return self._gpm_last[k]

    def close(self) -> None:
        for g in self.gpm:
            if g is not None:
                for key in ("prev", "cur"):
                    with contextlib.suppress(Exception):
                        self.nv.nvmlGpmSampleFree(g[key])
        self.nv.nvmlShutdown()


def open_nvml(indices: list[int] | None = None) -> tuple[NvmlBackend | None, str]:
    """The NVML backend, or None and the reason there is no GPU to watch."""
    try:
        return NvmlBackend(indices), ""
    except ImportError:
        return None, "no GPU: pynvml (nvidia-ml-py) is not installed"
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, no device ...
        return None, f"no GPU: {type(e).__name__}: {e}".rstrip(": ")


class GpuMonitor:
    """Samples every GPU in a background thread while the `with` block runs.

    `backend` is anything with `device_info()`, `read()` and `close()` (tests pass a fake one);
    by default NVML, and nothing at all where there is no NVML or no device.
    """

    def __init__(
        self,
        interval_s: float = 0.1,
        indices: list[int] | None = None,
        backend=None,
        enabled: bool = True,
    ):
        self.interval_s = interval_s
        self.reason = "disabled" if not enabled else ""
        if backend is None and enabled:
            backend, self.reason = open_nvml(indices)
        self.devices: list[dict] = []
        if backend is not None:
            try:
                self.devices = backend.device_info()
            except Exception as e:  # NVML half working: treat as no GPU, never crash a run
                backend.close()
                backend, self.reason = None, f"no GPU: {type(e).__name__}: {e}"
        self.backend = backend
        self.times: list[float] = []
        self.samples: list[list[dict]] = [[] for _ in self.devices]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._span = (0.0, 0.0)
        self._closed = False

    @property
    def available(self) -> bool:
        return self.backend is not None

    def __enter__(self) -> GpuMonitor:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._span = (time.perf_counter(), 0.0)
        if self.backend is not None:
            self._thread = threading.Thread(target=self._loop, name="gpu-monitor", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.backend is not None and not self._closed:
            self.backend.close()
            self._closed = True
        self._span = (self._span[0], time.perf_counter())

    def _loop(self) -> None:
        next_t = time.perf_counter()
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception as e:  # a GPU lost mid-run: keep what was sampled, say why
                self.reason = f"sampling stopped: {type(e).__name__}: {e}"
                return
            next_t += self.interval_s
            self._stop.wait(max(0.0, next_t - time.perf_counter()))

    def sample_once(self) -> None:
        t, rows = time.perf_counter(), self.backend.read()
        self.times.append(t)
        for dev, row in zip(self.samples, rows):
            dev.append(row)

    def summary(self, busy_util_pct: float = 90.0, window: tuple[float, float] | None = None) -> dict:
        """Per-device means/medians; `util_ge90_frac` is the share of samples >= 90% busy.
        `window` (perf_counter start, end): only the samples taken then, e.g. while the load ran
        (not while client processes started or the last responses were read)."""
        if not self.available:
            return {"available": False, "reason": self.reason, "devices": []}
        wall = (self._span[1] or time.perf_counter()) - self._span[0]
        keep = range(len(self.times)) if window is None else self._indices_in([window])
        devices = []
        for info, all_rows in zip(self.devices, self.samples):
            rows = [all_rows[k] for k in keep]
            d = dict(info, n_samples=len(rows))
            col = {f: np.array([r[f] for r in rows if r[f] is not None], float) for f in FIELDS}
            util = col["util"]
            d["util_mean"] = _mean(util)
            d["util_median"] = float(np.median(util)) if util.size else None
            busy = float((util >= busy_util_pct).mean()) if util.size else None
            d[f"util_ge{busy_util_pct:g}_frac"] = busy
            for f in (
                "sm_active",
                "sm_occupancy",
                "dram_bw_util",
                "tensor_active",
                "mem_util",
                "power_w",
                "sm_clock_mhz",
                "mem_clock_mhz",
            ):
                d[f"{f}_mean"] = _mean(col[f])
            d["mem_used_max_gb"] = _max(col["mem_used_gb"])
            d["power_max_w"] = _max(col["power_w"])
            devices.append(d)
        return {
            "available": True,
            "reason": self.reason,
            "interval_s": self.interval_s,
            "sample_hz": len(self.times) / wall if wall > 0 else None,
            "window_s": None if window is None else window[1] - window[0],
            "util_mean": _mean(
                np.array([d["util_mean"] for d in devices if d["util_mean"] is not None], float)
            ),
            "devices": devices,
        }

    def util_during(self, spans: list[tuple[float, float]]) -> float | None:
        """Mean utilization (over devices and samples) of the samples taken inside any of the
        perf_counter `spans`: how busy the GPU was during one phase of a repeated loop."""
        if not self.available:
            return None
        vals = [dev[k]["util"] for k in self._indices_in(spans)
                for dev in self.samples if dev[k]["util"] is not None]
        return float(np.mean(vals)) if vals else None

    def _indices_in(self, spans: list[tuple[float, float]]) -> list[int]:
        """Indices of the samples taken inside any of the perf_counter `spans`."""
        return [k for k, t in enumerate(self.times) if any(a <= t <= b for a, b in spans)]

    def samples_json(self) -> dict:
        """Every sample, column-wise per device, with times relative to the start."""
        t0 = self._span[0]
        return {
            "t": [t - t0 for t in self.times],
            "devices": [{f: [r[f] for r in rows] for f in FIELDS} for rows in self.samples],
        }

    def idle_while_busy(
        self, timeline: list[tuple[float, int]], threshold_pct: float = 10.0
    ) -> dict:
        """Share of samples where requests were in flight yet every GPU was below
        `threshold_pct` utilization: the GPU waited on something else (CPU, I/O, the client).
        `timeline` is [(perf_counter time, requests in flight from then on)], sorted."""
        out = {"threshold_pct": threshold_pct, "busy_samples": 0, "idle_while_busy_frac": None}
        if not self.available or not timeline or not self.times:
            return out
        t_line = [t for t, _ in timeline]
        busy = idle = 0
        for k, t in enumerate(self.times):
            i = bisect.bisect_right(t_line, t) - 1
            if i < 0 or timeline[i][1] <= 0:
                continue
            utils = [dev[k]["util"] for dev in self.samples if dev[k]["util"] is not None]
            if not utils:
                continue
            busy += 1
            idle += max(utils) < threshold_pct
        out["busy_samples"] = busy
        out["idle_while_busy_frac"] = idle / busy if busy else None
        out["idle_while_busy_s"] = idle * self.interval_s
        return out


def _mean(a: np.ndarray) -> float | None:
    return float(a.mean()) if a.size else None


def _max(a: np.ndarray) -> float | None:
    return float(a.max()) if a.size else None
