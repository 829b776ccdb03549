"""Top-p / top-k rollouts: the trainer scores under the distribution the engine sampled from, so
the engine/trainer importance ratio stays at 1 and the run learns (fp32, CPU)."""

import pytest

from tests.rl.test_trainer import make_trainer

TOP = {"top_p": 0.8, "top_k": 20}


def test_top_p_top_k_rollouts_agree_with_the_trainer(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2, bf16=False, **TOP)
    for _ in range(2):
        m = trainer.step()
        assert m["sampling/sampling_logp_difference/max"] < 1e-4, m
        assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, rel=0.01)
        assert m["sampling/is_dropped_fraction"] == 0.0


def test_without_the_filter_the_trainer_would_disagree(tmp_path):
    """The check above has teeth: scored over the full vocabulary, the same rollouts are off."""
    trainer = make_trainer(tmp_path, max_steps=1, bf16=False, **TOP)
    trainer.update.sampling_filter = None
    with pytest.warns(UserWarning, match="masked or weighted below"):
        m = trainer.step()
    assert m["sampling/sampling_logp_difference/mean"] > 0.1


def test_tiny_model_learns_with_top_p_on(tmp_path):
    trainer = make_trainer(tmp_path, bf16=False, **TOP)
    rewards = [trainer.step()["reward"] for _ in range(12)]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.25 and last > 0.4, rewards
