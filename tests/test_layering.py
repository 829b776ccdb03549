"""The import rule of docs/architecture.md: `kernels` <- `layers` <- `models` <- `parallel` <-
`weights` <- `engine` <- (`rl`, `serve`, `bench`); no package imports one above it, and `rl`,
`serve` and `bench` use one another only through the public functions listed here.

Every import counts, at module level or inside a function (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import tandem

ROOT = Path(tandem.__file__).parent

# the top-level modules every package may use: configs (and their field checks), parameters,
# outputs, the forward context
BASE = {"config", "checks", "sampling_params", "outputs", "forward_context", "batch_invariant"}
ORDER = ["kernels", "layers", "models", "parallel", "weights", "engine"]
APPS = {"rl", "serve", "bench"}
# (importer package, imported module, names): the documented crossings between applications
PUBLIC = {
    ("bench", "tandem.rl", frozenset({"GRPOConfig", "GRPOTrainer"})),  # bench rl times the trainer
    ("bench", "tandem.rl.trainer", frozenset({"PHASES"})),  # the step's phases, in order
    # bench rl plans (`--plan-only`) and reports memory as the trainer does
    ("bench", "tandem.rl.memory_plan", frozenset({"BUDGET_ENV", "GIB", "MemoryPlan", "MemoryPlanError"})),
    ("bench", "tandem.rl.memory_setup", frozenset({"plan_before_loading"})),
    ("bench", "tandem.rl.memory_table", frozenset({"format_measured"})),
    ("rl", "tandem.bench.report", frozenset({"pyplot", "save_figure"})),  # plotting helpers
    # bench train_kernels times the trainer's fused ops and the patched decoder layer against HF's,
    ("bench", "tandem.rl.fused_layers", frozenset({"patch_model", "rms_norm", "rotary_qk", "silu_mul"})),
    ("bench", "tandem.rl.logprobs", frozenset({"head_logprobs"})),  # and the fused log-prob head
    ("bench", "tandem.rl.grad_accum_linear", frozenset({"patch_model"})),
}


def _package(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "tandem"
    return parts[1]


def _imports(path: Path, module: str):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: (len(module.split(".")) - node.level + (path.name == "__init__.py"))]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = frozenset(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tandem"):
                    yield node.lineno, a.name, frozenset()
            continue
        else:
            continue
        if target == "tandem":  # `from tandem import batch_invariant`: that module, not the root
            modules = {n for n in names if (ROOT / f"{n}.py").exists() or (ROOT / n).is_dir()}
            for n in sorted(modules):
                yield node.lineno, f"tandem.{n}", frozenset()
            if names - modules:
                yield node.lineno, target, names - modules
        elif target.startswith("tandem."):
            # `from tandem.x import y` where y is a module counts as importing tandem.x.y
            yield node.lineno, target, names


def _allowed(src: str, target: str, names: frozenset) -> bool:
    dst = _package(target)
    if src in ("tandem", "cli") or dst == src:
        return True
    if dst in BASE:
        return src not in ("kernels",) or False
    if dst == "tandem":  # `from tandem import LLM, SamplingParams`: the engine's public API
        return src in APPS or names <= {"__version__"}
    if src in BASE:
        return dst in BASE
    if src in APPS:
        if dst in ORDER:
            return True
        return any(src == s and target == t and names <= n for s, t, n in PUBLIC)
    if src in ORDER and dst in ORDER:
        return ORDER.index(dst) < ORDER.index(src)
    return False


def _violations() -> list[str]:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        src = _package(module)
        if src not in BASE | APPS | set(ORDER) | {"tandem", "cli"}:
            bad.append(f"{module}: package {src!r} has no place in the layering rule")
            continue
        for line, target, names in _imports(path, module):
            if not _allowed(src, target, names):
                bad.append(f"{module}:{line} imports {target} ({', '.join(sorted(names))})")
    return bad


def test_no_package_imports_one_above_it():
    assert _violations() == []


def test_kernels_import_nothing_of_tandem():
    for path in (ROOT / "kernels").rglob("*.py"):
        module = "tandem.kernels." + path.stem
        assert [t for _, t, _ in _imports(path, module) if not t.startswith("tandem.kernels")] == [], path


def test_the_rule_catches_an_upward_import(tmp_path):
    assert not _allowed("layers", "tandem.engine.forward_context", frozenset({"AttentionMetadata"}))
    assert not _allowed("kernels", "tandem.layers.norm", frozenset({"rms_norm_ref"}))
    assert not _allowed("rl", "tandem.serve.communicator", frozenset({"Communicator"}))
    assert not _allowed("engine", "tandem.serve.metrics", frozenset({"EngineStats"}))
    assert _allowed("serve", "tandem.engine.async_llm", frozenset({"AsyncLLM"}))
