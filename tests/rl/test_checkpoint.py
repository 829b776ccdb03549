"""Checkpoints: HF-format round trip, atomicity under a crash, rotation."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tandem.rl import checkpoint as ckpt
from tandem.rl.checkpoint import (
    COMPLETE_MARKER,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
)


def _train_one_step(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / 10)
    ids = torch.randint(0, 128, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    return opt, sched


def test_round_trip(tmp_path, make_llama, tiny_tokenizer):
    model = make_llama(seed=0)
    opt, sched = _train_one_step(model)
    state = {"sampler": {"epoch": 1, "position": 3}, "config": {"loss_type": "dapo"}}
    path = save_checkpoint(
        tmp_path,
        7,
        model,
        tokenizer=tiny_tokenizer,
        optimizer=opt,
        scheduler=sched,
        trainer_state=state,
    )
    assert path == tmp_path / "checkpoint-7" and (path / COMPLETE_MARKER).is_file()

    fresh = make_llama(seed=1)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda step: 1.0 - step / 10)
    torch.rand(5)  # move the RNG on
    loaded = load_checkpoint(path, fresh, opt2, sched2)
    assert loaded["global_step"] == 7 and loaded["sampler"] == {"epoch": 1, "position": 3}
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert sched2.get_last_lr() == sched.get_last_lr()
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)

    # HF format: loadable without tandem.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(hf.lm_head.weight, model.lm_head.weight)
    assert AutoTokenizer.from_pretrained(path).chat_template == tiny_tokenizer.chat_template


def test_rng_is_restored(tmp_path, make_llama):
    model = make_llama()
    path = save_checkpoint(tmp_path, 1, model)
    want = (torch.rand(4), random.random())
    torch.rand(9)
    random.random()
    load_checkpoint(path)
    assert torch.equal(torch.rand(4), want[0]) and random.random() == want[1]


def test_crash_mid_write_leaves_no_checkpoint(tmp_path, make_llama, monkeypatch):
    model = make_llama()
    save_checkpoint(tmp_path, 1, model)
    opt, _ = _train_one_step(model)

    real_save = torch.save

    def dying_save(obj, f, *a, **kw):
        real_save(obj, f, *a, **kw)
        raise OSError("disk full")  # after writing part of the checkpoint

    monkeypatch.setattr(ckpt.torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, model, optimizer=opt)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


def test_killed_process_leftovers_are_ignored_then_cleaned(tmp_path, make_llama):
    model = make_llama()
    save_checkpoint(tmp_path, 1, model)
    # A process killed mid-save leaves its temp dir; a non-atomic copy leaves an unmarked dir.
    stale = tmp_path / ".tmp-checkpoint-5-99999-deadbeef"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    unmarked = tmp_path / "checkpoint-9"
    unmarked.mkdir()
    (unmarked / "config.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(unmarked)
    save_checkpoint(tmp_path, 2, model)
    assert not stale.exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-2"


def test_rotation_and_resave(tmp_path, make_llama):
    model = make_llama()
    for step in (1, 2, 3, 10):
        save_checkpoint(tmp_path, step, model, save_total_limit=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-10"]
    save_checkpoint(tmp_path, 10, model, trainer_state={"again": True}, save_total_limit=2)
    state = json.loads((tmp_path / "checkpoint-10" / "trainer_state.json").read_text())
    assert state["again"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-3"]
    assert latest_checkpoint(tmp_path / "nowhere") is None


def test_load_model_weights_rejects_a_different_model(tmp_path, make_llama):
    path = save_checkpoint(tmp_path, 1, make_llama())
    with pytest.raises(RuntimeError, match="does not fit the model"):
        load_model_weights(path, make_llama(vocab_size=64))
