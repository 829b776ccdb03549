"""A vLLM-style plain script (LLM at module level, no `if __name__ == "__main__":`) runs with
tensor_parallel_size=2: the ranks are forked while CUDA is not initialised, so they do not re-run
the script. This is examples/offline_inference.py as written, with tensor_parallel_size=2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.engine.executor import start_method

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "offline_inference.py"


def test_offline_inference_example_with_tp2_runs_unguarded(tiny_llama_dir, tmp_path):
    source = EXAMPLE.read_text()
    assert 'if __name__ == "__main__"' not in source and "tensor_parallel_size=1" in source
    script = tmp_path / "offline_inference_tp2.py"
    script.write_text(source.replace("tensor_parallel_size=1", "tensor_parallel_size=2"))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TANDEM_WORKER_START_METHOD", None)
    r = subprocess.run([sys.executable, str(script), tiny_llama_dir], env=env, cwd=tmp_path,
                       capture_output=True, text=True, check=False, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("Prompt: ")]
    assert len(lines) == 2 and "Generated: " in lines[0], r.stdout
    assert "bootstrapping phase" not in r.stderr


def test_start_method_forks_until_cuda_is_initialised(monkeypatch, caplog):
    monkeypatch.delenv("TANDEM_WORKER_START_METHOD", raising=False)
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert start_method() == "fork"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with caplog.at_level("WARNING"):
        assert start_method() == "spawn"
    assert 'if __name__ == "__main__":' in caplog.text
    monkeypatch.setenv("TANDEM_WORKER_START_METHOD", "spawn")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert start_method() == "spawn"


def _run(script: Path, model_dir: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), model_dir], env=env, cwd=script.parent,
                          capture_output=True, text=True, check=False, timeout=600)


def _two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.mark.gpu
def test_offline_inference_example_with_tp2_on_two_gpus(tiny_llama_dir, tmp_path):
    """On GPUs the ranks are forked too: nothing before the fork may initialise CUDA."""
    _two_gpus()
    script = tmp_path / "offline_inference_tp2.py"
    script.write_text(EXAMPLE.read_text().replace("tensor_parallel_size=1", "tensor_parallel_size=2"))
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_WORKER_START_METHOD"}
    r = _run(script, tiny_llama_dir, env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sum(line.startswith("Prompt: ") for line in r.stdout.splitlines()) == 2


@pytest.mark.gpu
def test_a_cuda_initialised_script_spawns_and_is_told_to_guard(tiny_llama_dir, tmp_path):
    _two_gpus()
    body = EXAMPLE.read_text().replace("tensor_parallel_size=1", "tensor_parallel_size=2")
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_WORKER_START_METHOD"}
    unguarded = tmp_path / "unguarded.py"
    unguarded.write_text("import torch\ntorch.zeros(1, device='cuda')\n" + body)
    r = _run(unguarded, tiny_llama_dir, env)
    assert r.returncode != 0 and 'if __name__ == "__main__":' in r.stderr, r.stderr[-3000:]
    guarded = tmp_path / "guarded.py"
    indented = "".join("    " + line if line.strip() else line for line in body.splitlines(True))
    guarded.write_text("import torch\n\nif __name__ == '__main__':\n    torch.zeros(1, device='cuda')\n"
                       + indented)
    r = _run(guarded, tiny_llama_dir, env)
    assert r.returncode == 0, r.stderr[-3000:]
