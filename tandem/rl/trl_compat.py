"""The fields of TRL's GRPOConfig (a transformers `TrainingArguments`) that tandem does not keep.

A TRL script passes many of them. Each name here is accepted: given its default it is silent;
given another value it is either ignored with a warning (shown once per field, by Python's own
warnings filter) when ignoring it cannot change what is trained, or refused with an error naming
the field and what to do instead. Fields tandem honours are ordinary `GRPOConfig` fields; the
table in docs/compatibility.md lists both kinds. Every accepted name is readable on the config
as an attribute, so transformers callbacks that read `args.<field>` work.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import warnings
from typing import Any

IGNORE, REFUSE = "ignore", "refuse"

_HUB = "call trainer.save_model(dir), then huggingface_hub.upload_folder(repo_id=..., folder_path=dir)"
_NO_EVAL_METRIC = (
    "tandem's evaluation is greedy completions scored by the reward functions (eval/reward); "
    "keep checkpoints with save_strategy and pick one, or stop from a TrainerCallback by setting "
    "control.should_training_stop"
)

# name -> (default, what happens to another value, why / what to do instead)
FIELDS: dict[str, tuple[Any, str, str]] = {
    # ---- transformers TrainingArguments --------------------------------------------------------
    "optim_args": (None, REFUSE, "pass the optimizer yourself: GRPOTrainer(optimizers=(opt, None))"),
    "optim_target_modules": (None, REFUSE, ("GaLore/APOLLO optimizers are not supported; use optim="
                             "'adamw_torch' or optimizers=(opt, None)")),
    "average_tokens_across_devices": (True, IGNORE, "the dapo loss always counts every rank's tokens"),
    "label_smoothing_factor": (0.0, REFUSE, "label smoothing has no meaning for a policy-gradient loss"),
    "bf16_full_eval": (False, IGNORE, "evaluation generates with the engine in its own dtype"),
    "fp16_full_eval": (False, IGNORE, "evaluation generates with the engine in its own dtype"),
    "fp16": (False, REFUSE, "use bf16=True: bf16 autocast over fp32 master weights, no loss scaling"),
    "half_precision_backend": ("auto", IGNORE, "mixed precision is torch.autocast"),
    "tf32": (None, IGNORE, "set torch.backends.cuda.matmul.allow_tf32 yourself"),
    "activation_checkpointing": (None, IGNORE, "use gradient_checkpointing"),
    "activation_checkpointing_kwargs": (None, IGNORE, "use gradient_checkpointing"),
    "gradient_checkpointing_kwargs": (None, IGNORE, "checkpointing is always non-reentrant"),
    "torch_compile": (False, IGNORE, "the trainer's model runs eagerly; the engine has CUDA graphs"),
    "torch_compile_backend": (None, IGNORE, "the trainer's model runs eagerly"),
    "torch_compile_mode": (None, IGNORE, "the trainer's model runs eagerly"),
    "liger_kernel_config": (None, IGNORE, "tandem's loss is its own chunked logprob kernel"),
    "use_cache": (False, IGNORE, "the engine keeps its own KV cache"),
    "neftune_noise_alpha": (None, REFUSE, "NEFTune is for supervised fine-tuning, not GRPO"),
    "torch_empty_cache_steps": (None, IGNORE, "the memory plan decides; a sleeping engine empties torch's cache each step"),
    "auto_find_batch_size": (False, REFUSE, "set per_device_train_batch_size yourself"),
    "log_on_each_node": (True, IGNORE, "rank 0 logs"),
    "logging_nan_inf_filter": (True, IGNORE, "non-finite values are logged as null"),
    "logging_dir": (None, IGNORE, "TensorBoard logs go to output_dir/tensorboard"),
    "include_num_input_tokens_seen": ("no", IGNORE, "completions/num_tokens is logged every step"),
    "log_level": ("passive", IGNORE, "use the logging module"),
    "log_level_replica": ("warning", IGNORE, "use the logging module"),
    "disable_tqdm": (None, IGNORE, "the trainer prints one line per logged step"),
    "project": ("huggingface", IGNORE, "used by trackio, which tandem does not report to"),
    "trackio_space_id": (None, IGNORE, "tandem does not report to trackio"),
    "trackio_bucket_id": (None, IGNORE, "tandem does not report to trackio"),
    "trackio_static_space_id": (None, IGNORE, "tandem does not report to trackio"),
    "per_device_eval_batch_size": (8, IGNORE, "evaluation sends every prompt to the engine at once"),
    "prediction_loss_only": (False, IGNORE, "evaluation reports rewards"),
    "eval_do_concat_batches": (True, IGNORE, "evaluation reports rewards"),
    "eval_use_gather_object": (False, IGNORE, "evaluation reports rewards"),
    "eval_accumulation_steps": (None, IGNORE, "evaluation reports rewards"),
    "include_for_metrics": ([], IGNORE, "evaluation reports rewards"),
    "include_inputs_for_metrics": (False, IGNORE, "evaluation reports rewards"),
    "batch_eval_metrics": (False, IGNORE, "evaluation reports rewards"),
    "save_only_model": (False, IGNORE, "checkpoints always hold the optimizer state, for resume"),
    "save_on_each_node": (False, IGNORE, "rank 0 writes checkpoints"),
    "save_safetensors": (True, IGNORE, "weights are always written as safetensors"),
    "enable_jit_checkpoint": (False, IGNORE, "checkpoints are written at save_steps"),
    "push_to_hub": (False, REFUSE, _HUB),
    "hub_token": (None, REFUSE, _HUB),
    "hub_private_repo": (None, REFUSE, _HUB),
    "hub_model_id": (None, REFUSE, _HUB),
    "hub_strategy": ("every_save", REFUSE, _HUB),
    "hub_always_push": (False, REFUSE, _HUB),
    "hub_revision": (None, REFUSE, _HUB),
    "load_best_model_at_end": (False, REFUSE, _NO_EVAL_METRIC),
    "metric_for_best_model": (None, REFUSE, _NO_EVAL_METRIC),
    "greater_is_better": (None, REFUSE, _NO_EVAL_METRIC),
    "ignore_data_skip": (False, IGNORE, "resume restores the sampler's position, it skips nothing"),
    "restore_callback_states_from_checkpoint": (False, IGNORE, "callbacks keep no saved state"),
    "full_determinism": (False, IGNORE, "rollouts are seeded per step from seed"),
    "accelerator_config": (None, IGNORE, "tandem does not use accelerate"),
    "parallelism_config": (None, REFUSE, "use torchrun with fsdp=True (or False: replicas)"),
    "dataloader_drop_last": (False, IGNORE, "an incomplete last generation batch is always dropped"),
    "dataloader_num_workers": (0, IGNORE, "prompts are read in the training process"),
    "dataloader_pin_memory": (True, IGNORE, "prompts are read in the training process"),
    "dataloader_persistent_workers": (False, IGNORE, "prompts are read in the training process"),
    "dataloader_prefetch_factor": (None, IGNORE, "prompts are read in the training process"),
    "dataloader_multiprocessing_context": (None, IGNORE, "prompts are read in the training process"),
    "dataloader_in_order": (True, IGNORE, "prompts are read in the training process"),
    "remove_unused_columns": (False, IGNORE, "every dataset column goes to the reward functions"),
    # (TrainingArguments' default is True, TRL's False: both are silent, see _same)
    "label_names": (None, IGNORE, "GRPO has no labels"),
    "train_sampling_strategy": ("random", IGNORE, "use shuffle_dataset"),
    "group_by_length": (False, IGNORE, "use shuffle_dataset"),
    "length_column_name": ("length", IGNORE, "use shuffle_dataset"),
    "ddp_find_unused_parameters": (None, IGNORE, "gradients are all-reduced by the trainer itself"),
    "ddp_bucket_cap_mb": (None, IGNORE, "gradients are all-reduced by the trainer itself"),
    "ddp_broadcast_buffers": (None, IGNORE, "gradients are all-reduced by the trainer itself"),
    "ddp_static_graph": (None, IGNORE, "gradients are all-reduced by the trainer itself"),
    "ddp_backend": (None, IGNORE, "nccl on GPUs, gloo on CPUs"),
    "ddp_timeout": (1800, IGNORE, "torchrun's default timeout applies"),
    "fsdp_config": (None, IGNORE, "fsdp=True always wraps each decoder layer (FSDP2)"),
    "deepspeed": (None, REFUSE, ("use torchrun with fsdp=True (FSDP2 shards parameters, gradients "
                  "and optimizer state like ZeRO-3)")),
    "debug": ("", IGNORE, "no debug modes"),
    "skip_memory_metrics": (True, IGNORE, "memory is measured by `tandem bench rl`"),
    "do_train": (False, IGNORE, "not used by the Trainer itself"),
    "do_eval": (False, IGNORE, "not used by the Trainer itself"),
    "do_predict": (False, IGNORE, "not used by the Trainer itself"),
    "resume_from_checkpoint": (None, IGNORE, "pass it to trainer.train(resume_from_checkpoint=...)"),
    "local_rank": (-1, IGNORE, "read from torchrun's environment"),
    "use_mps_device": (False, IGNORE, "the device is CUDA when present, else the CPU"),
    "no_cuda": (False, IGNORE, "use use_cpu"),
    "dispatch_batches": (None, IGNORE, "tandem does not use accelerate"),
    "split_batches": (None, IGNORE, "tandem does not use accelerate"),
    "include_tokens_per_second": (False, IGNORE, "completions/num_tokens and times are logged"),
    "past_index": (-1, IGNORE, "not used by causal LMs"),
    "jit_mode_eval": (False, IGNORE, "evaluation generates with the engine"),
    "use_ipex": (False, IGNORE, "not supported"),
    "ray_scope": ("last", IGNORE, "no hyperparameter search"),
    "mp_parameters": ("", IGNORE, "not used"),
    # ---- transformers 4's TrainingArguments only (removed in 5.0; pyproject admits 4.56) --------
    "per_gpu_train_batch_size": (None, REFUSE, ("transformers 4's deprecated name: set "
                                 "per_device_train_batch_size")),
    "per_gpu_eval_batch_size": (None, IGNORE, "evaluation sends every prompt to the engine at once"),
    "fp16_opt_level": ("O1", IGNORE, "Apex AMP is not used (fp16 is refused: use bf16=True)"),
    "fp16_backend": ("auto", IGNORE, "mixed precision is torch.autocast"),
    "adafactor": (False, REFUSE, ("Adafactor is not supported; use optim='adamw_torch' or "
                  "optimizers=(opt, None)")),
    "fsdp_min_num_params": (0, IGNORE, "fsdp=True always wraps each decoder layer (FSDP2)"),
    "fsdp_transformer_layer_cls_to_wrap": (None, IGNORE, ("fsdp=True always wraps each decoder "
                                           "layer (FSDP2)")),
    "torchdynamo": (None, IGNORE, "the trainer's model runs eagerly"),
    "use_legacy_prediction_loop": (False, IGNORE, "evaluation generates with the engine"),
    "tpu_num_cores": (None, IGNORE, "the device is CUDA when present, else the CPU"),
    "tpu_metrics_debug": (False, IGNORE, "no TPU metrics"),
    "push_to_hub_model_id": (None, REFUSE, _HUB),
    "push_to_hub_organization": (None, REFUSE, _HUB),
    "push_to_hub_token": (None, REFUSE, _HUB),
    # ---- TRL's GRPOConfig -----------------------------------------------------------------------
    "router_aux_loss_coef": (None, IGNORE, "mixture-of-experts router losses are not added"),
    "cast_lm_head_to_fp32": (False, IGNORE, "master weights are fp32; logprobs are fp32 chunks"),
    "num_generations_eval": (None, IGNORE, "evaluation scores one greedy completion per prompt"),
    "ds3_gather_for_generation": (True, IGNORE, "FSDP gathers one layer at a time for the engine"),
    "pad_to_multiple_of": ("auto", IGNORE, "the engine packs sequences without padding"),
    "cache_implementation": (None, IGNORE, "the engine keeps its own paged KV cache"),
    "vllm_model_impl": ("vllm", IGNORE, "the engine is tandem's"),
    "vllm_guided_decoding_regex": (None, REFUSE, ("TRL's older name: set vllm_structured_outputs_regex, "
                                   "which tandem honours")),
    "vllm_server_timeout": (240.0, IGNORE, "the server client waits for the server's own answer"),
    "vllm_group_port": (51216, IGNORE, "the weight-push group rendezvous is chosen by the server"),
    "delta": (None, REFUSE, ("two-sided clipping (INTELLECT-2's delta) is not implemented; use "
              "epsilon / epsilon_high")),
    "sapo_temperature_neg": (1.05, IGNORE, "only used by loss_type='sapo', which tandem lacks"),
    "sapo_temperature_pos": (1.0, IGNORE, "only used by loss_type='sapo', which tandem lacks"),
    "vespo_k_pos": (2.0, IGNORE, "only used by loss_type='vespo', which tandem lacks"),
    "vespo_lambda_pos": (3.0, IGNORE, "only used by loss_type='vespo', which tandem lacks"),
    "vespo_k_neg": (3.0, IGNORE, "only used by loss_type='vespo', which tandem lacks"),
    "vespo_lambda_neg": (2.0, IGNORE, "only used by loss_type='vespo', which tandem lacks"),
    "multi_objective_aggregation": ("sum_then_normalize", REFUSE, ("tandem sums the weighted "
                                    "rewards, then normalises (sum_then_normalize)")),
    "sync_ref_model": (False, REFUSE, ("TR-DPO reference syncing is not implemented; beta > 0 keeps "
                       "the initial model as reference")),
    "ref_model_mixup_alpha": (0.6, IGNORE, "only used with sync_ref_model=True"),
    "ref_model_sync_steps": (512, IGNORE, "only used with sync_ref_model=True"),
    "top_entropy_quantile": (1.0, REFUSE, "entropy masking is not implemented; leave it at 1.0"),
    "entropy_coef": (0.0, REFUSE, "an entropy bonus is not implemented; leave it at 0.0"),
    "use_adaptive_entropy": (False, REFUSE, "an entropy bonus is not implemented"),
    "entropy_coef_min": (0.0, IGNORE, "only used with use_adaptive_entropy=True"),
    "entropy_coef_max": (1.0, IGNORE, "only used with use_adaptive_entropy=True"),
    "entropy_coef_delta": (0.005, IGNORE, "only used with use_adaptive_entropy=True"),
    "entropy_target": (0.2, IGNORE, "only used with use_adaptive_entropy=True"),
    "max_tool_calling_iterations": (None, REFUSE, "tool calling during rollouts is not supported"),
    "off_policy_mask_threshold": (None, REFUSE, ("off-policy sequence masking is not implemented; "
                                  "vllm_importance_sampling_mode='sequence_mask' masks by the "
                                  "engine/trainer ratio")),
    "use_bias_correction_kl": (True, IGNORE, "the KL term is k3 on the trainer's own samples"),
    "log_multimodal": (True, IGNORE, "text-only"),
    "log_unique_prompts": (False, IGNORE, "completions.jsonl holds every prompt"),
    "wandb_log_unique_prompts": (False, IGNORE, "tandem does not report to wandb"),
    "log_completions_hub_repo": (None, REFUSE, ("completions are written to "
                                 "output_dir/completions.jsonl; upload that file yourself")),
    "use_transformers_continuous_batching": (False, IGNORE, "the engine generates"),
    "transformers_continuous_batching_config": (None, IGNORE, "the engine generates"),
    "use_transformers_paged": (False, IGNORE, "the engine generates"),
    "ref_model_init_kwargs": (None, IGNORE, "the reference model is a copy of the initial model"),
}

# Integrations transformers' report_to names that tandem does not write to (it writes jsonl and
# TensorBoard); asking for one is not worth stopping a run for.
FOREIGN_REPORTERS = ("wandb", "trackio", "mlflow", "comet_ml", "clearml", "neptune", "dvclive",
                     "swanlab", "azure_ml", "codecarbon", "dagshub", "flyte")


def accepts_trl_fields(cls):
    """Class decorator for a dataclass config: its __init__ also takes the names in FIELDS."""
    init = cls.__init__
    names = {f.name for f in dataclasses.fields(cls)}

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Set before the dataclass __init__ so __post_init__'s checks can read them too.
        self.__dict__.update(split_kwargs(kwargs, names))
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def split_kwargs(kwargs: dict[str, Any], field_names: set[str]) -> dict[str, Any]:
    """Take the TRL-only names out of `kwargs` (in place) and check them; returns every TRL-only
    name that is not a field, with its value (given or default)."""
    foreign = {k: kwargs.pop(k) for k in list(kwargs) if k not in field_names}
    for name, value in foreign.items():
        if name not in FIELDS:
            close = difflib.get_close_matches(name, list(field_names) + list(FIELDS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"GRPOConfig got an unexpected keyword argument {name!r}{hint}; "
                            "neither tandem's nor TRL's GRPOConfig has that field")
        default, kind, note = FIELDS[name]
        if _same(value, default, name):
            continue
        if kind == REFUSE:
            raise ValueError(f"GRPOConfig: {name}={value!r} is not supported by tandem: {note}")
        warnings.warn(f"GRPOConfig: {name}={value!r} is ignored by tandem ({note})",
                      UserWarning, stacklevel=4)
    return {name: foreign.get(name, default) for name, (default, _, _) in FIELDS.items()
            if name not in field_names}


_EMPTY = (None, "", (), [], {})


# Fields with two defaults (TrainingArguments' and TRL's, or transformers 5's and 4's): either
# is silent.
_BOTH_DEFAULTS = {
    "remove_unused_columns": (True, False),
    "include_num_input_tokens_seen": ("no", False),
}


def _same(value: Any, default: Any, name: str = "") -> bool:
    """Is `value` the default (None, "", [] and {} all mean "unset")?"""
    if name in _BOTH_DEFAULTS and value in _BOTH_DEFAULTS[name]:
        return True
    try:
        if value == default:
            return True
    except Exception:  # noqa: BLE001 - a value that does not compare is not the default
        return False
    return any(value is e or (type(value) is type(e) and value == e) for e in _EMPTY) and any(
        default is e or (type(default) is type(e) and default == e) for e in _EMPTY)
