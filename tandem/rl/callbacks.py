"""transformers' TrainerCallback protocol for GRPOTrainer: a real TrainerState / TrainerControl,
and DefaultFlowCallback deciding when to log, evaluate and save, as in transformers' Trainer.

One generation round feeds several optimizer steps (num_iterations x steps_per_generation /
gradient_accumulation_steps); the callbacks see `on_step_begin` / `on_step_end` once per optimizer
step, after the round, each with its own `state.global_step`. Log, evaluate and save happen once
per round, at its last step, if any of its steps asked for them; so does a stop
(`control.should_training_stop`): the round's steps have all been taken. `on_pre_optimizer_step`,
`on_optimizer_step` and `on_substep_end` are not called.
"""

from __future__ import annotations

from typing import Any


def make_callback_handler(callbacks, model, processing_class, optimizer, scheduler):
    from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

    return CallbackHandler([DefaultFlowCallback, *(callbacks or [])], model, processing_class,
                           optimizer, scheduler)


def make_state(is_main: bool, train_batch_size: int, num_train_epochs: float):
    from transformers import TrainerState

    return TrainerState(is_local_process_zero=is_main, is_world_process_zero=is_main,
                        train_batch_size=train_batch_size, num_train_epochs=num_train_epochs)


def make_control():
    from transformers import TrainerControl

    return TrainerControl()


def steps_of_round(handler, args, state, control, first: int, last: int):
    """on_step_begin / on_step_end for optimizer steps first..last (one round, already run); the
    log / evaluate / save requests of every step are kept. Returns control."""
    keep = ("should_log", "should_evaluate", "should_save")
    for step in range(first, last + 1):
        if step > first:  # the first step's on_step_begin ran before the round
            asked = {k: getattr(control, k) for k in keep}
            control = handler.on_step_begin(args, state, control)
            for k, v in asked.items():
                setattr(control, k, getattr(control, k) or v)
        state.global_step = step
        control = handler.on_step_end(args, state, control)
    state.global_step = last
    return control


def log_record(state, metrics: dict[str, Any]) -> dict[str, Any]:
    """What on_log gets and state.log_history keeps: numbers, with the step and epoch."""
    logs = {k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}
    logs = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
    logs["epoch"] = state.epoch
    state.log_history.append({**logs, "step": state.global_step})
    return logs
