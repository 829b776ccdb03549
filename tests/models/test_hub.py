"""Hub ids resolve through huggingface_hub's cache: HF_HOME, HF_HUB_OFFLINE and revision honoured.
The cache is laid out by hand in a temp dir (models--org--name/snapshots/<commit>/, refs/<name>)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.models import hub

REPO = "tiny-org/tiny-llama"
MAIN, V2 = "a" * 40, "b" * 40


def make_hub_cache(root: Path, model_dirs: dict[str, tuple[str, str]]) -> Path:
    """HF_HOME layout: root/hub/models--org--name/{snapshots/<commit>/..., refs/<ref>}."""
    repo = root / "hub" / ("models--" + REPO.replace("/", "--"))
    for ref, (commit, src) in model_dirs.items():
        shutil.copytree(src, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return root


@pytest.fixture(scope="module")
def two_revisions(tmp_path_factory):
    from model_fixtures import make_tiny_model, make_tokenizer

    dirs = {}
    for ref, commit, seed in (("main", MAIN, 0), ("v2", V2, 1)):
        d = tmp_path_factory.mktemp(f"src-{ref}")
        make_tiny_model("llama", seed=seed).save_pretrained(d)
        make_tokenizer().save_pretrained(d)
        dirs[ref] = (commit, str(d))
    return make_hub_cache(tmp_path_factory.mktemp("hf-home"), dirs), dirs


SCRIPT = """
import json, sys
from tandem import LLM, SamplingParams
greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
out = {}
for name, kw in [("hub", {}), ("hub_v2", {"revision": "v2"}), ("local", {"model": sys.argv[1]})]:
    kw = {"model": "tiny-org/tiny-llama", **kw}
    llm = LLM(**kw, device="cpu", max_model_len=64)
    out[name] = llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    del llm
print("RESULT " + json.dumps(out))
"""


def test_llm_takes_a_hub_id_from_the_cache_offline(two_revisions, tmp_path):
    home, dirs = two_revisions
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    r = subprocess.run([sys.executable, "-c", SCRIPT, dirs["main"][1]], env=env, cwd=tmp_path,
                       capture_output=True, text=True, check=False, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    out = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert out["hub"] == out["local"]  # main is the local model's copy
    assert out["hub_v2"] != out["hub"]  # revision="v2" is another snapshot (other weights)


def test_offline_miss_names_the_id_and_the_cache(two_revisions, monkeypatch):
    from huggingface_hub import constants

    home, _ = two_revisions
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub.snapshot_dir(REPO).endswith(MAIN)
    assert hub.snapshot_dir(REPO, revision="v2").endswith(V2)
    with pytest.raises(ValueError, match=r"'tiny-org/not-there'.*HF_HUB_OFFLINE=1.*hf download"):
        hub.snapshot_dir("tiny-org/not-there")
    assert not hub.looks_like_repo_id("./model.gguf") and hub.looks_like_repo_id("Qwen/Qwen2.5-0.5B")
