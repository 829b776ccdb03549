"""The GPU monitor: 'no GPU' never crashes; summaries and idle-while-busy on scripted samples;
the NVML path (GPM included) against a fake pynvml module."""

import sys
import time
import types

import pytest

from tandem.bench import gpu_monitor
from tandem.bench.gpu_monitor import FIELDS, GpuMonitor


def test_no_gpu_path_reports_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as if nvidia-ml-py were not installed
    with GpuMonitor(interval_s=0.01) as mon:
        time.sleep(0.03)
    s = mon.summary()
    assert s == {
        "available": False,
        "reason": "no GPU: pynvml (nvidia-ml-py) is not installed",
        "devices": [],
    }
    assert mon.idle_while_busy([(0.0, 1)])["idle_while_busy_frac"] is None


def test_real_nvml_or_no_gpu_never_crashes():
    with GpuMonitor(interval_s=0.05) as mon:
        time.sleep(0.12)
    s = mon.summary()
    assert isinstance(s["available"], bool)
    if not s["available"]:
        assert s["reason"].startswith("no GPU")


class ScriptedBackend:
    """One device whose utilization follows a script, one value per read."""

    def __init__(self, utils):
        self.utils = list(utils)
        self.closed = False

    def device_info(self):
        return [{"index": 0, "name": "Fake H200", "memory_total_gb": 141.0, "gpm": False}]

    def read(self):
        u = self.utils.pop(0) if self.utils else 0.0
        return [
            dict.fromkeys(FIELDS) | {"util": u, "mem_used_gb": 10.0 + u / 100, "power_w": 100 + u}
        ]

    def close(self):
        self.closed = True


def test_summary_of_scripted_samples():
    backend = ScriptedBackend([0, 50, 95, 100])
    mon = GpuMonitor(backend=backend)
    for _ in range(4):  # by hand, no thread: exact samples
        mon.sample_once()
    mon.stop()
    assert backend.closed
    d = mon.summary()["devices"][0]
    assert d["n_samples"] == 4 and d["name"] == "Fake H200"
    assert d["util_mean"] == pytest.approx(61.25)
    assert d["util_median"] == pytest.approx(72.5)
    assert d["util_ge90_frac"] == pytest.approx(0.5)
    assert d["mem_used_max_gb"] == pytest.approx(11.0)
    assert d["power_max_w"] == pytest.approx(200.0)
    assert d["sm_active_mean"] is None  # no GPM on this device
    cols = mon.samples_json()
    assert cols["devices"][0]["util"] == [0, 50, 95, 100] and len(cols["t"]) == 4
    assert mon.util_during([(mon.times[0], mon.times[0]), (mon.times[3], mon.times[3])]) == pytest.approx(50.0)
    assert mon.util_during([]) is None
    # the load's window only: client start-up before it and the tail after it are left out
    inner = mon.summary(window=(mon.times[1], mon.times[2]))
    d = inner["devices"][0]
    assert d["n_samples"] == 2 and d["util_mean"] == pytest.approx(72.5)
    assert inner["window_s"] == pytest.approx(mon.times[2] - mon.times[1])


def test_background_thread_samples_at_10_hz_or_more():
    with GpuMonitor(interval_s=0.02, backend=ScriptedBackend([50] * 1000)) as mon:
        time.sleep(0.3)
    s = mon.summary()
    assert s["sample_hz"] >= 10 and s["devices"][0]["n_samples"] >= 5


def test_idle_while_requests_in_flight():
    mon = GpuMonitor(backend=ScriptedBackend([]))
    mon.interval_s = 0.1
    mon.times = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    utils = [0, 90, 5, 95, 2, 0]
    mon.samples = [[dict.fromkeys(FIELDS) | {"util": u} for u in utils]]
    # requests in flight from 0.5 to 4.5: samples at 1..4 are busy; at 2 and 4 the GPU idled
    out = mon.idle_while_busy([(0.5, 2), (2.5, 1), (4.5, 0)], threshold_pct=10)
    assert out["busy_samples"] == 4
    assert out["idle_while_busy_frac"] == pytest.approx(0.5)


def fake_pynvml(gpm_supported: bool):
    import pynvml as real

    def util(_h):
        return types.SimpleNamespace(gpu=87, memory=40)

    def clock(_h, kind):
        if kind == real.NVML_CLOCK_MEM:
            raise RuntimeError("not supported")  # one field NVML refuses: None, not a crash
        return 1980

    def metrics_get(q):
        for j in range(q.numMetrics):
            q.metrics[j].value, q.metrics[j].nvmlReturn = 40.0 + j, 0
        return q

    nv = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=141e9, used=20e9),
        nvmlDeviceGetUtilizationRates=util,
        nvmlDeviceGetPowerUsage=lambda h: 350_000,
        nvmlDeviceGetClockInfo=clock,
        NVML_CLOCK_SM=real.NVML_CLOCK_SM,
        NVML_CLOCK_MEM=real.NVML_CLOCK_MEM,
        nvmlGpmQueryDeviceSupport=lambda h: types.SimpleNamespace(
            isSupportedDevice=int(gpm_supported)
        ),
        nvmlGpmSampleAlloc=lambda: object(),
        nvmlGpmSampleGet=lambda h, s: s,
        nvmlGpmSampleFree=lambda s: None,
        nvmlGpmMetricsGet=metrics_get,
        c_nvmlGpmMetricsGet_t=real.c_nvmlGpmMetricsGet_t,  # the real struct layout
        NVML_GPM_METRICS_GET_VERSION=real.NVML_GPM_METRICS_GET_VERSION,
    )
    for name in ("SM_UTIL", "SM_OCCUPANCY", "DRAM_BW_UTIL", "ANY_TENSOR_UTIL"):
        setattr(nv, f"NVML_GPM_METRIC_{name}", getattr(real, f"NVML_GPM_METRIC_{name}"))
    return nv


@pytest.mark.parametrize("gpm", [True, False])
def test_nvml_backend_with_fake_pynvml(monkeypatch, gpm):
    pytest.importorskip("pynvml")
    nv = fake_pynvml(gpm)
    if gpm:  # the struct needs real sample handles; stand in with the struct's own pointer type
        import pynvml as real

        nv.nvmlGpmSampleAlloc = lambda: real.c_nvmlGpmSample_t()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setattr(gpu_monitor.NvmlBackend, "GPM_MIN_GAP_S", 0.0)
    with GpuMonitor(interval_s=0.01) as mon:
        time.sleep(0.08)
    s = mon.summary()
    assert s["available"] and len(s["devices"]) == 2
    d = s["devices"][0]
    assert d["name"] == "NVIDIA H200" and d["util_mean"] == 87.0 and d["util_ge90_frac"] == 0.0
    assert d["power_w_mean"] == 350.0 and d["mem_used_max_gb"] == pytest.approx(20.0)
    assert d["sm_clock_mhz_mean"] == 1980 and d["mem_clock_mhz_mean"] is None
    if gpm:
        assert d["sm_active_mean"] == 40.0 and d["dram_bw_util_mean"] == 42.0
    else:
        assert d["sm_active_mean"] is None and not d["gpm"]
