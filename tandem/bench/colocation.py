"""`tandem bench colocation`: what sleeping costs and returns, for an engine beside a trainer's model.

Figures (issue 4's targets): share of the engine's device memory that `sleep(level=2)` returns,
`wake_up()` + `update_weights_from_model()` seconds, `sleep(level=1)` + `wake_up()` seconds, and
whether greedy output after each wake equals the output before the sleep. Medians of repeats,
for each sleep backend (cumem: stable addresses; recapture: reallocate and capture graphs again).

Both sleep/wake figures are timed twice: right after the sleep, and after `trainer_turn_s` with
the engine asleep (the trainer's turn in a colocated loop). They differ because back to back,
`cuMemCreate` of the KV cache takes ~0.19 s for 60 GiB on an H200 against 4 ms a second later:
the driver appears to clear freed pages before it hands them out again.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch


@dataclass
class ColocationConfig:
    model: str = "qwen2.5-1.5b"
    load_format: str = "dummy"
    gpu_memory_utilization: float = 0.5
    backends: str = "cumem,recapture"
    repeats: int = 5
    num_prompts: int = 8
    max_tokens: int = 32
    trainer_turn_s: float = 1.0  # asleep this long before the second timed wake
    output: str | None = None
    print_json: bool = False


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _trainer_model(cfg: ColocationConfig):
    from transformers import AutoModelForCausalLM

    from tandem.models.loader import init_dummy_weights, resolve_model

    source = resolve_model(cfg.model, cfg.load_format)
    if source.path and cfg.load_format != "dummy":
        return AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.bfloat16).cuda().eval()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(source.hf_config, dtype=torch.bfloat16)
    init_dummy_weights(model, seed=0)
    with torch.no_grad():  # dummy weights are near-uniform; spread them so greedy tokens differ
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    return model.eval()


def measure(trainer_model, backend: str, cfg: ColocationConfig) -> dict:
    from tandem import LLM, SamplingParams

    llm = LLM(trainer_model, enable_sleep_mode=True, gpu_memory_utilization=cfg.gpu_memory_utilization,
              sleep_mode_backend=backend, max_model_len=1024)
    prompts = [[100 + 7 * i + j for j in range(64)] for i in range(cfg.num_prompts)]
    greedy = SamplingParams(temperature=0, max_tokens=cfg.max_tokens, ignore_eos=True)

    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    reference = tokens()
    report = llm.memory_report()
    engine_bytes = report["weights_bytes"] + report["kv_cache_bytes"]
    freed_share, wake_update, sleep1_wake, identical = [], [], [], True
    sleep1_turn: list[float] = []  # sleep(1) + wake_up() seconds, the trainer's turn between
    parts: dict[str, list[float]] = defaultdict(list)  # wake_<part>_s from wake_up(), update_s
    back_to_back: list[float] = []

    def sleep2_wake_update(turn_s: float, record_parts: bool) -> float:
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        llm.sleep(2)
        torch.cuda.synchronize()
        freed_share.append((torch.cuda.mem_get_info()[0] - free0) / engine_bytes)
        time.sleep(turn_s)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        woke = llm.wake_up()
        t1 = time.perf_counter()
        llm.update_weights_from_model(trainer_model)
        torch.cuda.synchronize()
        if record_parts:  # the breakdown of the headline figure
            for key in ("weights_s", "kv_cache_s", "kv_cache_map_s", "kv_cache_cu_mem_create_s",
                        "kv_cache_cu_mem_map_s", "kv_cache_cu_mem_set_access_s"):
                parts["wake_" + key].append(woke.get(key, 0.0))
            parts["update_s"].append(time.perf_counter() - t1)
        return time.perf_counter() - t0

    for _ in range(cfg.repeats):
        back_to_back.append(sleep2_wake_update(0.0, record_parts=False))
        identical &= tokens() == reference
        wake_update.append(sleep2_wake_update(cfg.trainer_turn_s, record_parts=True))
        identical &= tokens() == reference
        sleep1_wake.append(_timed(lambda: (llm.sleep(1), llm.wake_up())))
        identical &= tokens() == reference
        slept = _timed(lambda: llm.sleep(1))
        time.sleep(cfg.trainer_turn_s)
        sleep1_turn.append(slept + _timed(llm.wake_up))
        identical &= tokens() == reference
    result = {
        "backend": backend, "engine_bytes": engine_bytes, "memory_report": report,
        "sleep2_freed_share_median": statistics.median(freed_share),
        "trainer_turn_s": cfg.trainer_turn_s,
        "wake_plus_update_s_median": statistics.median(wake_update),
        "wake_plus_update_back_to_back_s_median": statistics.median(back_to_back),
        "sleep1_plus_wake_s_median": statistics.median(sleep1_wake),
        "sleep1_plus_wake_after_turn_s_median": statistics.median(sleep1_turn),
        "greedy_identical_after_wake": identical,
        **{k + "_median": statistics.median(v) for k, v in parts.items()},
        "cudagraph_capture_s": llm.llm_engine.worker.cudagraph_capture_s,
        "samples": {"freed_share": freed_share, "wake_plus_update_s": wake_update,
                    "wake_plus_update_back_to_back_s": back_to_back, "sleep1_plus_wake_s": sleep1_wake,
                    "sleep1_plus_wake_after_turn_s": sleep1_turn},
    }
    llm.llm_engine.worker.model_runner.graph_runner = None  # let the caller's gc free the engine now
    return result


def print_table(results: dict, trainer_turn_s: float) -> None:
    turn = f"after {trainer_turn_s:g} s"
    print(f"{'':<10} {'sleep(2)':>9} {'wake+update s':>27} {'sleep(1)+wake s':>27} {'same':>7}")
    print(f"{'backend':<10} {'frees':>9} {turn:>13} {'back to back':>13} {turn:>13} {'back to back':>13} "
          f"{'tokens':>7}")
    for r in results.values():
        print(f"{r['backend']:<10} {100 * r['sleep2_freed_share_median']:>8.1f}% "
              f"{r['wake_plus_update_s_median']:>13.3f} {r['wake_plus_update_back_to_back_s_median']:>13.3f} "
              f"{r['sleep1_plus_wake_after_turn_s_median']:>13.3f} {r['sleep1_plus_wake_s_median']:>13.3f} "
              f"{str(r['greedy_identical_after_wake']):>7}")
        print(f"{'':<10} wake: weights {r['wake_weights_s_median']:.3f}s, kv cache "
              f"{r['wake_kv_cache_s_median']:.3f}s (mapping {r['wake_kv_cache_map_s_median']:.3f}s: "
              f"cuMemCreate {r['wake_kv_cache_cu_mem_create_s_median']:.3f}s, cuMemMap "
              f"{r['wake_kv_cache_cu_mem_map_s_median']:.3f}s, cuMemSetAccess "
              f"{r['wake_kv_cache_cu_mem_set_access_s_median']:.3f}s); "
              f"update_weights_from_model {r['update_s_median']:.3f}s")


def run(cfg: ColocationConfig) -> dict:
    from tandem.bench.report import finish, make_report

    if not torch.cuda.is_available():
        raise ValueError("bench colocation measures device memory: it needs a CUDA GPU")
    model = _trainer_model(cfg)
    results = {}
    for backend in [b for b in cfg.backends.split(",") if b]:
        results[backend] = measure(model, backend, cfg)
        gc.collect()
        torch.cuda.empty_cache()
    print_table(results, cfg.trainer_turn_s)
    report = make_report("colocation", asdict(cfg), results)
    finish(report, cfg.output, cfg.print_json)
    return report


def add_parser(subparsers) -> None:
    from tandem.bench.report import add_output_args

    d = ColocationConfig()
    p = subparsers.add_parser("colocation", help="sleep / wake / weight-update costs on a GPU")
    p.add_argument("--model", default=d.model, help="architecture preset or local HF model dir")
    p.add_argument("--load-format", default=d.load_format,
                   help="dummy: random weights; auto: the model dir's own")
    p.add_argument("--backends", default=d.backends, help="comma list of sleep backends: cumem, recapture")
    add_output_args(p)
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="the engine's share of GPU memory")
    p.add_argument("--repeats", type=int, default=d.repeats, help="sleep/wake cycles (medians reported)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="prompts of the greedy check")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens of the greedy check")
    p.add_argument("--trainer-turn-s", type=float, default=d.trainer_turn_s,
                   help="seconds asleep before the headline wake (the trainer's turn)")
    p.set_defaults(func=lambda a: run(ColocationConfig(**{k: v for k, v in vars(a).items()
                                                          if k in ColocationConfig.__dataclass_fields__})) and 0)
