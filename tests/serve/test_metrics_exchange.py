"""Request metrics of several API servers, summed through their shared directory."""

from __future__ import annotations

import asyncio

from tandem.engine.metrics import EngineStats, ServerMetrics
from tandem.serve.metrics_exchange import MetricsExchange


def _metrics(ttfts: list[float], rejected: int, reasons: list[str]) -> ServerMetrics:
    m = ServerMetrics()
    for t in ttfts:
        m.ttft.observe(t)
    m.rejected = rejected
    m.prompt_tokens = 10 * len(reasons)
    for r in reasons:
        m.finished[r] += 1
    return m


def test_each_server_answers_for_all_of_them(tmp_path):
    a = _metrics([0.02, 0.3], rejected=1, reasons=["stop", "length"])
    b = _metrics([0.02, 4.0, 9.0], rejected=0, reasons=["length"])
    ex_a, ex_b = MetricsExchange(str(tmp_path), 0), MetricsExchange(str(tmp_path), 1)
    ex_b.publish(b)
    total = ex_a.collect(a)  # a's own live figures plus b's last published ones
    assert total.ttft.count == 5 and abs(total.ttft.sum - 13.34) < 1e-9
    assert total.ttft.counts == [x + y for x, y in zip(a.ttft.counts, b.ttft.counts)]
    assert (total.rejected, total.prompt_tokens) == (1, 30)
    assert total.finished == {"stop": 1, "length": 2}
    assert a.ttft.count == 2 and a.finished == {"stop": 1, "length": 1}  # a itself untouched

    assert ex_b.collect(b).render(EngineStats(), "m") == total.render(EngineStats(), "m")
    (tmp_path / "api-server-2.json").write_text("{half a fi")  # torn or foreign: skipped
    assert ex_b.collect(b).ttft.count == 5


def test_counters_never_go_back_whichever_server_answers(tmp_path):
    a, b = ServerMetrics(), ServerMetrics()
    ex_a, ex_b = MetricsExchange(str(tmp_path), 0), MetricsExchange(str(tmp_path), 1)
    seen = []
    for step in range(6):
        (a if step % 2 else b).e2e.observe(1.0)  # each server finishes requests in turn
        seen.append(ex_a.collect(a).e2e.count)  # scrapes alternate between the servers
        seen.append(ex_b.collect(b).e2e.count)
    assert seen == sorted(seen) and seen[-1] == 6, seen


def test_publishing_runs_in_the_loop_and_follows_the_live_metrics(tmp_path):
    live = ServerMetrics()
    ex = MetricsExchange(str(tmp_path), 0, interval_s=0.01)
    reader = MetricsExchange(str(tmp_path), 1)

    async def main() -> None:
        ex.start(live)
        live.e2e.observe(1.0)
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert reader.collect(ServerMetrics()).e2e.count == 1
