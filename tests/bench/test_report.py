"""The shared result schema, the closing JSON line, CSV."""

import csv
import json
import math
from dataclasses import dataclass

import pytest

from tandem.bench.report import (
    SCHEMA,
    check_report,
    compact,
    flatten,
    json_line,
    make_report,
    write_csv,
    write_json,
)


@dataclass
class Cfg:
    rate: float = math.inf
    name: str = "x"


def test_report_schema_and_compact_line(tmp_path):
    rep = make_report(
        "serve",
        Cfg(),
        {"completed": 3, "requests": [{"i": 1}] * 3, "ttft_ms": {"p99": 1.5}},
        {"available": True, "devices": [], "samples": {"t": [0.1]}},
    )
    check_report(rep)
    assert rep["schema"] == SCHEMA == "tandem.bench/1"
    assert rep["config"] == {"rate": math.inf, "name": "x"}
    assert {"python", "host", "versions", "time_utc"} <= set(rep["env"])
    line = json_line(rep)
    assert "\n" not in line
    back = json.loads(line)
    assert back["config"]["rate"] == "inf"  # valid JSON: no Infinity
    assert "requests" not in back["results"] and "samples" not in back["gpu"]
    write_json(rep, tmp_path / "a" / "r.json")
    full = json.loads((tmp_path / "a" / "r.json").read_text())
    assert len(full["results"]["requests"]) == 3 and full["gpu"]["samples"] == {"t": [0.1]}


def test_no_gpu_default_and_check_errors():
    rep = make_report("sweep", {}, {})
    assert rep["gpu"]["available"] is False
    with pytest.raises(ValueError, match="schema"):
        check_report({**rep, "schema": "other/2"})
    with pytest.raises(ValueError, match="results"):
        check_report({k: v for k, v in rep.items() if k != "results"})


def test_flatten_and_csv(tmp_path):
    rows = [flatten({"a": 1, "ttft_ms": {"p99": 2.0}, "errors": [1]}), {"a": 2, "b": "z"}]
    assert rows[0] == {"a": 1, "ttft_ms.p99": 2.0}
    write_csv(rows, tmp_path / "x.csv")
    with open(tmp_path / "x.csv") as f:
        got = list(csv.DictReader(f))
    assert got == [
        {"a": "1", "ttft_ms.p99": "2.0", "b": ""},
        {"a": "2", "ttft_ms.p99": "", "b": "z"},
    ]
    assert compact({"x": [{"requests": 1, "k": 2}]}) == {"x": [{"k": 2}]}


def test_api_keys_stay_out_of_reports(monkeypatch):
    import sys

    monkeypatch.setattr(sys, "argv", ["tandem", "bench", "serve", "--api-key", "sk-secret"])
    rep = make_report("serve", {"target": {"api_key": "sk-secret", "model": "m"}}, {})
    assert "sk-secret" not in json_line(rep)
    assert rep["config"]["target"] == {"api_key": "<redacted>", "model": "m"}


def test_finish_writes_the_file_and_prints_json_only_when_asked(tmp_path, capsys):
    from tandem.bench.report import finish

    rep = make_report("x", {"a": 1}, {"b": 2})
    finish(rep, str(tmp_path / "r.json"))
    assert capsys.readouterr().out == f"report written to {tmp_path / 'r.json'}\n"
    assert json.loads((tmp_path / "r.json").read_text())["results"] == {"b": 2}
    finish(rep, None, print_json=True)
    assert json.loads(capsys.readouterr().out)["kind"] == "x"
