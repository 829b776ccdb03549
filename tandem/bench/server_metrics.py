"""The server's own counters over a `bench serve` run: its Prometheus `/metrics`, read before the
load and after it.

The client sees latencies; the server's counters say why they are what they are (vLLM's metrics
design: "server-level metrics explain the request-level ones"): how many engine steps the run
took, how long each took, how many tokens a step produced (a batch that was never full shows
here), preemptions and prefix-cache hits. Read from tandem (`tandem:` names) or vLLM (`vllm:`);
another server, or one without `/metrics`, gives no section. The counters are the server's whole:
other traffic during the run counts too.
"""

from __future__ import annotations

import re
import urllib.request

from tandem.bench.client import TargetConfig

PREFIXES = ("tandem:", "vllm:")  # tandem's names are vLLM's with this prefix
# a sample line: name{labels} value [timestamp]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_KIND = re.compile(r'\bkind="([^"]*)"')


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples summed by metric name, and by name and `kind` label where there is one
    (`name{kind=decode}`): the other labels (the model's name) are summed over."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        name, labels = m.group(1), m.group(2) or ""
        kind = _KIND.search(labels)
        key = f"{name}{{kind={kind.group(1)}}}" if kind else name
        out[key] = out.get(key, 0.0) + value
    return out


def scrape(target: TargetConfig, timeout_s: float = 10.0) -> dict[str, float] | None:
    """The server's counters now, or None where it has no Prometheus `/metrics` of tandem's or
    vLLM's names."""
    req = urllib.request.Request(target.base_url + "/metrics", headers=target.headers())
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (OSError, ValueError):  # (HTTPError, a 404 included, is an OSError)
        return None
    samples = parse_prometheus(text)
    if not any(k.startswith(PREFIXES) for k in samples):
        return None
    return samples


def over_run(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """What the server counted between the two scrapes (None without both)."""
    if before is None or after is None:
        return None
    prefix = next((p for p in PREFIXES if f"{p}generation_tokens_total" in after), None)
    if prefix is None:
        return None

    def delta(name: str) -> float | None:
        key = prefix + name
        return after[key] - before.get(key, 0.0) if key in after else None

    def count(name: str) -> int | None:
        d = delta(name)
        return None if d is None else round(d)

    out: dict = {"source": prefix.rstrip(":"), "generation_tokens": count("generation_tokens_total")}
    if prefix == "tandem:":  # steps by kind, with the host's seconds in them
        kinds = sorted(k.split("kind=")[1][:-1] for k in after
                       if k.startswith(f"{prefix}engine_steps_total{{kind="))
        steps = {}
        for kind in kinds:
            n = count(f"engine_steps_total{{kind={kind}}}") or 0
            sec = delta(f"engine_step_seconds_total{{kind={kind}}}")
            steps[kind] = {"steps": n, "mean_ms": 1e3 * sec / n if n and sec else None}
        out["steps_by_kind"] = steps
        out["engine_steps"] = sum(s["steps"] for s in steps.values())
    else:  # vLLM: a histogram of the tokens (prompt and generated) an engine step scheduled
        n = count("iteration_tokens_total_count")
        out["engine_steps"] = n
        tokens = delta("iteration_tokens_total_sum")
        out["scheduled_tokens_per_step"] = tokens / n if n and tokens is not None else None
    gen, n = out["generation_tokens"], out["engine_steps"]
    out["generation_tokens_per_step"] = gen / n if gen is not None and n else None
    out["preemptions"] = count("num_preemptions_total")
    hits, queries = delta("prefix_cache_hits_total"), delta("prefix_cache_queries_total")
    out["prefix_cache_hit_rate"] = hits / queries if hits is not None and queries else None
    return out


def server_rows(server: dict | None) -> list[tuple[str, object]]:
    """Rows for the report's table."""
    if server is None:
        return [("status", "no /metrics with tandem's or vLLM's counters")]
    rows: list[tuple[str, object]] = [("source", server["source"]),
                                      ("engine steps", server["engine_steps"])]
    for kind, s in (server.get("steps_by_kind") or {}).items():
        rows.append((f"  {kind}: steps / mean host ms", f"{s['steps']} / "
                     + (f"{s['mean_ms']:.2f}" if s["mean_ms"] is not None else "-")))
    if "scheduled_tokens_per_step" in server:
        rows.append(("scheduled tokens per step", server["scheduled_tokens_per_step"]))
    rows += [
        ("generated tokens", server["generation_tokens"]),
        ("generated tokens per step", server["generation_tokens_per_step"]),
        ("preemptions", server["preemptions"]),
        ("prefix-cache hit rate", server["prefix_cache_hit_rate"]),
    ]
    return rows
