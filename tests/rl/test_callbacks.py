"""transformers' TrainerCallback protocol in GRPOTrainer.train(): every optimizer step's
on_step_end, stopping from a callback, on_log / on_save / on_evaluate, and save_model."""

from datasets import Dataset
from model_fixtures import make_tiny_model, make_tokenizer
from transformers import TrainerCallback

from tandem.rl import GRPOConfig, GRPOTrainer

PROMPTS = ["Hello, my name is", "The capital of France is", "Once upon a time", "one two three"]


def reward_len(completions, **kwargs):
    return [-abs(4 - len(c)) / 4 for c in completions]


class Recorder(TrainerCallback):
    def __init__(self, stop_at=None):
        self.events, self.stop_at = [], stop_at

    def on_train_begin(self, args, state, control, **kw):
        self.events.append(("train_begin", state.global_step))

    def on_step_begin(self, args, state, control, **kw):
        self.events.append(("step_begin", state.global_step))

    def on_step_end(self, args, state, control, **kw):
        assert kw["model"] is not None and kw["optimizer"] is not None
        self.events.append(("step_end", state.global_step))
        if state.global_step == self.stop_at:
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kw):
        self.events.append(("log", state.global_step, "loss" in logs))

    def on_save(self, args, state, control, **kw):
        self.events.append(("save", state.global_step))

    def on_evaluate(self, args, state, control, metrics=None, **kw):
        self.events.append(("evaluate", state.global_step, "eval/reward" in metrics))

    def on_train_end(self, args, state, control, **kw):
        self.events.append(("train_end", state.global_step))


def make(tmp_path, callbacks, **cfg):
    args = GRPOConfig(**{
        "output_dir": str(tmp_path), "num_generations": 4, "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1, "max_completion_length": 4, "max_prompt_length": 16,
        "max_steps": 8, "report_to": "none", "learning_rate": 1e-3, "seed": 0, **cfg})
    return GRPOTrainer(make_tiny_model("llama", seed=3), reward_len, args,
                       train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                       eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}),
                       processing_class=make_tokenizer(), callbacks=[Recorder(stop_at=3)],
                       engine_kwargs={"device": "cpu"})


def test_every_step_is_seen_and_a_callback_stops_training(tmp_path):
    # steps_per_generation=2: each round feeds two optimizer steps, each with its on_step_end
    trainer = make(tmp_path, None, steps_per_generation=2, save_strategy="steps", save_steps=2,
                   eval_strategy="steps", eval_steps=2, logging_steps=1)
    rec = trainer.callback_handler.callbacks[-1]
    trainer.train()
    ends = [e[1] for e in rec.events if e[0] == "step_end"]
    assert ends == [1, 2, 3, 4] and trainer.global_step == 4  # stopped after the round with step 3
    assert [e[0] for e in rec.events].count("step_begin") == len(ends)  # one per step, paired
    assert ("log", 2, True) in rec.events and ("log", 4, True) in rec.events
    assert ("save", 2) in rec.events and ("evaluate", 2, True) in rec.events
    assert rec.events[0] == ("train_begin", 0) and rec.events[-1] == ("train_end", 4)
    assert (tmp_path / "checkpoint-2").is_dir()
    assert (tmp_path / "model.safetensors").is_file()  # the final save_model
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [2, 4]


def test_save_strategy_no_keeps_nothing_and_save_model_saves_where_asked(tmp_path):
    trainer = make(tmp_path / "run", None, save_strategy="no", max_steps=1)
    trainer.train()
    assert not (tmp_path / "run" / "model.safetensors").exists()
    assert not list((tmp_path / "run").glob("checkpoint-*"))
    out = trainer.save_model(str(tmp_path / "kept"))
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(out)
    w = trainer.model.get_input_embeddings().weight
    assert (again.get_input_embeddings().weight == w.cpu()).all()
    assert (tmp_path / "kept" / "tokenizer.json").is_file()
