"""The interconnect probe: the gloo CPU path with 2 processes (what CI runs), 'no GPU' said
plainly, and NVLink/PCIe read from a fake NVML."""

import json
import sys
import types

import pytest

from tandem.bench.cli import main
from tandem.bench.interconnect import (
    InterconnectConfig,
    gpu_topology,
    message_sizes,
    parse_bytes,
    run_interconnect,
)


def test_parse_bytes_and_sizes():
    assert parse_bytes("8K") == 8192 and parse_bytes("1G") == 1 << 30
    assert parse_bytes("768KiB") == 768 * 1024 and parse_bytes("100") == 100
    sizes = message_sizes(InterconnectConfig(), "nccl")
    assert sizes[0] == 8192 and sizes[-1] == 1 << 30 and len(sizes) == 18
    assert message_sizes(InterconnectConfig(), "gloo")[-1] == 16 << 20


def test_gloo_allreduce_two_processes_on_cpu():
    cfg = InterconnectConfig(
        backend="gloo", world_size=2, max_bytes="256K", iters=2, warmup_iters=1, latency_bytes="8K"
    )
    report = run_interconnect(cfg)
    ar = report["results"]["allreduce"]
    assert ar["correct"] and ar["backend"] == "gloo" and ar["world_size"] == 2
    assert [r["bytes"] for r in ar["bandwidth"]] == [
        8 << 10,
        16 << 10,
        32 << 10,
        64 << 10,
        128 << 10,
        256 << 10,
    ]
    for r in ar["bandwidth"]:
        assert r["time_us"] > 0
        assert r["algbw_gb_s"] == pytest.approx(r["bytes"] / (r["time_us"] / 1e6) / 1e9)
        assert r["busbw_gb_s"] == pytest.approx(r["algbw_gb_s"] * 2 * (2 - 1) / 2)
    lat = ar["latency"][0]
    assert lat["eager_us"] > 0 and lat["graph_us"] is None and "GPU" in lat["graph_error"]


def test_cli_without_gpu_says_no_gpu(capsys):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    assert main(["interconnect", "--json"]) == 0
    out = capsys.readouterr().out
    assert "no GPU" in out
    last = json.loads(out.strip().splitlines()[-1])
    assert last["kind"] == "interconnect" and last["results"]["allreduce"] is None
    assert last["results"]["topology"]["available"] is False


def fake_nvml(nvlink: bool):
    import pynvml as real

    bus = ["00000000:18:00.0", "00000000:2A:00.0"]

    def link_state(h, link):
        if link >= 4:
            raise RuntimeError("no such link")
        return real.NVML_FEATURE_ENABLED if nvlink else real.NVML_FEATURE_DISABLED

    return types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=bus[h].encode()),
        nvmlDeviceGetNvLinkState=link_state,
        nvmlDeviceGetNvLinkRemotePciInfo=lambda h, link: types.SimpleNamespace(busId=bus[1 - h]),
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: real.NVML_TOPOLOGY_SYSTEM,
        nvmlDeviceGetP2PStatus=lambda a, b, i: real.NVML_P2P_STATUS_OK if nvlink else 1,
        NVML_NVLINK_MAX_LINKS=real.NVML_NVLINK_MAX_LINKS,
        NVML_FEATURE_ENABLED=real.NVML_FEATURE_ENABLED,
        NVML_P2P_CAPS_INDEX_NVLINK=real.NVML_P2P_CAPS_INDEX_NVLINK,
        NVML_P2P_STATUS_OK=real.NVML_P2P_STATUS_OK,
    )


@pytest.mark.parametrize("nvlink", [True, False])
def test_topology_from_fake_nvml(monkeypatch, nvlink):
    pytest.importorskip("pynvml")
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(nvlink))
    topo = gpu_topology()
    assert topo["available"] and [d["nvlinks_active"] for d in topo["devices"]] == (
        [4, 4] if nvlink else [0, 0]
    )
    (pair,) = topo["pairs"]
    assert pair["link"] == ("NVLink x4" if nvlink else "PCIe SYS")


def test_topology_without_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    topo = gpu_topology()
    assert not topo["available"] and topo["reason"].startswith("no GPU")
