"""Other names for settings: TRL-style flat names (GRPOConfig's) and former names. config/loading.py
applies them; docs/configuration.md lists them."""

# Former names of settings, still accepted with a line saying so (docs/configuration.md).
RENAMED = {
    "data.reference_field": "data.target_field",
}

# TRL-style flat names (GRPOConfig's) and where they live.
ALIASES = {
    "epsilon": "grpo.epsilon",
    "epsilon_high": "grpo.epsilon_high",
    "delta": "grpo.delta",
    "scale_rewards": "grpo.scale_rewards",
    "importance_sampling_level": "grpo.importance_sampling_level",
    "sapo_temperature_pos": "grpo.sapo_temperature_pos",
    "sapo_temperature_neg": "grpo.sapo_temperature_neg",
    "use_bias_correction_kl": "grpo.use_bias_correction_kl",
    "off_policy_mask_threshold": "grpo.off_policy_mask_threshold",
    "top_entropy_quantile": "grpo.top_entropy_quantile",
    "entropy_coef": "grpo.entropy_coef",
    "sync_ref_model": "grpo.sync_ref_model",
    "ref_model_sync_steps": "grpo.ref_model_sync_steps",
    "ref_model_mixup_alpha": "grpo.ref_model_mixup_alpha",
    "mask_truncated_completions": "grpo.mask_truncated_completions",
    "vllm_importance_sampling_correction": "grpo.importance_sampling_correction",
    "vllm_importance_sampling_mode": "grpo.importance_sampling_correction",
    "vllm_importance_sampling_cap": "grpo.importance_sampling_cap",
    "num_generations": "grpo.num_generations",
    "learning_rate": "grpo.learning_rate",
    "kl_coef": "grpo.kl_coef",
    "beta": "grpo.kl_coef",
    "per_device_train_batch_size": "grpo.per_device_train_batch_size",
    "gradient_accumulation_steps": "grpo.gradient_accumulation_steps",
    "num_train_epochs": "grpo.num_train_epochs",
    "max_steps": "grpo.max_steps",
    "num_iterations": "grpo.num_iterations",
    "loss_type": "grpo.loss_type",
    "seed": "grpo.seed",
    "logging_steps": "logging.logging_steps",
    "report_to": "logging.report_to",
    "run_name": "logging.run_name",
    "save_steps": "checkpoint.save_steps",
    "max_completion_length": "rollout.max_new_tokens",
    "max_prompt_length": "data.max_prompt_length",
    "temperature": "rollout.temperature",
    "model_name_or_path": "model.name_or_path",
    "lora_r": "model.lora.r",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "lora_target_modules": "model.lora.target_modules",
    "lora_modules_to_save": "model.lora.modules_to_save",
}
