"""The non-finite step guard and the weight-sync check's two messages, on the CPU trainer."""

import pytest
import torch

from tandem.rl.guard import NonFiniteGuard, NonFiniteStepError
from tests.rl.test_trainer import make_trainer


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def poison_logps(trainer, monkeypatch, steps: set[int]):
    """The trainer's logprobs turn NaN on the given optimizer steps (1-based)."""
    real = trainer.update.logps

    def logps(model, data, rows=slice(None), no_grad=False):
        out = real(model, data, rows, no_grad)
        if trainer.global_step + 1 in steps and not no_grad:
            out = out * torch.tensor(float("nan"))
        return out

    monkeypatch.setattr(trainer.update, "logps", logps)


def test_a_nonfinite_step_touches_nothing_and_training_goes_on(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, max_steps=3, gradient_accumulation_steps=1)  # 1 step a round
    trainer.step()
    poison_logps(trainer, monkeypatch, steps={2})
    before = weights(trainer.model)
    adam = [s["exp_avg_sq"].clone() for s in trainer.optimizer.state.values()]
    sched = trainer.scheduler.last_epoch
    m = trainer.step()
    assert m["train/nonfinite_steps"] == 1 and trainer.global_step == 2
    after = weights(trainer.model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # bitwise
    assert all(torch.equal(a, s["exp_avg_sq"]) for a, s in zip(adam, trainer.optimizer.state.values()))
    assert trainer.scheduler.last_epoch == sched
    assert all(p.grad is None for p in trainer.model.parameters())  # its gradients were dropped
    m = trainer.step()  # finite again: it learns
    assert m["train/nonfinite_steps"] == 1 and trainer.update.guard.consecutive == 0
    assert any(not torch.equal(after[n], p) for n, p in weights(trainer.model).items())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_several_nonfinite_steps_in_a_row_stop_the_run_with_the_reason(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, max_steps=8, gradient_accumulation_steps=1,
                           max_consecutive_nonfinite_steps=2)
    poison_logps(trainer, monkeypatch, steps={2, 3})
    trainer.step()
    trainer.step()  # step 2: skipped, counted
    with pytest.raises(NonFiniteStepError) as err:
        trainer.step()  # step 3: the second in a row
    msg = str(err.value)
    assert "stopped at step 3" in msg and "2 optimizer steps in a row" in msg
    assert "trainer's logprobs of rows" in msg and "learning_rate" in msg


def test_guard_counts_and_resets():
    g = NonFiniteGuard(3)
    assert g.allow_step(1, True, None, "")
    assert not g.allow_step(2, False, "x", "")
    assert not g.allow_step(3, False, "x", "")
    assert g.allow_step(4, True, None, "") and g.consecutive == 0 and g.total == 2
    with pytest.raises(ValueError, match="max_consecutive_nonfinite_steps"):
        NonFiniteGuard(0)


def test_weight_sync_tells_nonfinite_trainer_weights_from_a_copy_that_did_not_land(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, max_steps=4)
    trainer.step()
    emb = trainer.model.get_input_embeddings().weight
    with torch.no_grad():
        emb[3, 1] = float("nan")
    trainer.generator.mark_stale()
    with pytest.raises(RuntimeError, match="trainer's weights are not finite .*1 NaN/inf.*copy itself landed"):
        trainer.generator.sync()

    with torch.no_grad():
        emb[3, 1] = 0.5
    engine = trainer.llm.llm_engine

    def bump_only(model):  # a sync that reports success and copies nothing
        engine.worker.weights_version += 1

    monkeypatch.setattr(trainer.llm, "update_weights_from_model", bump_only)
    trainer.generator.mark_stale()
    with pytest.raises(RuntimeError, match="weight sync did not land"):
        trainer.generator.sync()
