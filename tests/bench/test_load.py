"""Arrival schedules: rates, burstiness, constant gaps, all at once; splitting over workers."""

import math

import numpy as np
import pytest

from tandem.bench.load import (
    LoadConfig,
    arrival_offsets,
    auto_client_processes,
    split_concurrency,
    split_for_workers,
)


def test_inf_sends_everything_at_once():
    assert arrival_offsets(5, LoadConfig()) == [0.0] * 5


def test_constant_rate_even_gaps():
    assert arrival_offsets(4, LoadConfig(request_rate=2.0, rate_type="constant")) == [
        0.0,
        0.5,
        1.0,
        1.5,
    ]


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_gamma_gaps_keep_the_mean_rate(burstiness):
    cfg = LoadConfig(request_rate=10.0, burstiness=burstiness, seed=1)
    off = np.array(arrival_offsets(20001, cfg))
    gaps = np.diff(off)
    assert off[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    # gamma(shape k): coefficient of variation 1/sqrt(k): Poisson 1, burstier above, smoother below
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_schedule_is_seeded():
    cfg = LoadConfig(request_rate=5.0, seed=3)
    assert arrival_offsets(10, cfg) == arrival_offsets(10, cfg)


def test_validation_says_what_is_wrong():
    with pytest.raises(ValueError, match="request_rate"):
        LoadConfig(request_rate=0)
    with pytest.raises(ValueError, match="burstiness"):
        LoadConfig(burstiness=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        LoadConfig(max_concurrency=0)


def test_split_for_workers_round_robin():
    assert split_for_workers(5, 2) == [[0, 2, 4], [1, 3]]
    assert split_for_workers(2, 4) == [[0], [1]]


def test_split_concurrency():
    assert split_concurrency(None, 3) == [None, None, None]
    assert split_concurrency(7, 3) == [3, 2, 2]
    with pytest.raises(ValueError, match="num_client_processes"):
        split_concurrency(1, 2)


def test_auto_client_processes_follow_the_burst_and_the_cores():
    """All at once: one process per 256 requests sent together, a concurrency cap bounding the
    burst, at most a quarter of the cores; a finite rate keeps one."""
    burst = LoadConfig()  # rate inf
    assert auto_client_processes(1024, burst, cpus=16) == 4
    assert auto_client_processes(1024, burst, cpus=2) == 1  # a small machine keeps its cores
    assert auto_client_processes(10_000, burst, cpus=64) == 16
    assert auto_client_processes(257, burst, cpus=16) == 2
    assert auto_client_processes(256, burst, cpus=16) == 1
    assert auto_client_processes(1024, LoadConfig(max_concurrency=300), cpus=16) == 2
    assert auto_client_processes(1024, LoadConfig(request_rate=500.0), cpus=16) == 1
    assert auto_client_processes(0, burst, cpus=16) == 1
