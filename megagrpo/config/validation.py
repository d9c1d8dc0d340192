"""The configuration's own checks, before any model is built: ranges, files, divisibility, the
objective's options. Rules that belong to a part of the system live beside it (the layout in
cluster/layout.py, LoRA in policy/lora.py, reward names in rewards/, tools in rollout/tools.py);
megagrpo/validation.py calls them all."""
from __future__ import annotations

import json
import os
import sys

from megagrpo.config.schema import Config, ConfigError, require


def check_config(cfg: Config, training: bool = True, planning: bool = False) -> None:
    """Ranges, divisibility and files; relative paths are taken from the working directory.
    planning (a dry run, `megagrpo plan`): data files not prepared yet are a warning."""
    g = cfg.grpo
    require(bool(cfg.model.name_or_path),
            "model.name_or_path is empty: set it to an HF model folder, e.g. "
            "model.name_or_path=runs/tiny/model")
    if _looks_local(cfg.model.name_or_path):
        require(os.path.isfile(os.path.join(cfg.model.name_or_path, "config.json")),
                f"model.name_or_path: '{cfg.model.name_or_path}' has no config.json; build the "
                "tiny model with `python tools/make_tiny_model.py` or point it at an HF folder")
        check_vision_language(cfg)
    require(bool(cfg.data.train_file), "data.train_file is empty: set it to a JSONL/JSON/"
            "Parquet/CSV file or a hub dataset name")
    for key in ("train_file", "eval_file"):
        value = getattr(cfg.data, key)
        if value and _looks_local(value) and not os.path.isfile(value):
            message = f"data.{key}: file '{value}' does not exist"
            if not planning:
                raise ConfigError(message)
            print(f"megagrpo: warning: {message} (yet: the plan needs no data; tools/prepare_data.py writes "
                  "the shipped configs' files)", file=sys.stderr)
    for key, value, lo in [("grpo.num_generations", g.num_generations, 2),
                           ("grpo.per_device_train_batch_size", g.per_device_train_batch_size, 1),
                           ("grpo.gradient_accumulation_steps", g.gradient_accumulation_steps, 1),
                           ("grpo.num_iterations", g.num_iterations, 1),
                           ("rollout.max_new_tokens", cfg.rollout.max_new_tokens, 1),
                           ("data.max_prompt_length", cfg.data.max_prompt_length, 1),
                           ("grpo.max_tokens_per_microbatch", g.max_tokens_per_microbatch, 0),
                           ("grpo.logprob_chunk_size", g.logprob_chunk_size, 1),
                           ("logging.logging_steps", cfg.logging.logging_steps, 1),
                           ("logging.eval_num_generations", cfg.logging.eval_num_generations, 1),
                           ("checkpoint.keep_last", cfg.checkpoint.keep_last, 1)]:
        require(value >= lo, f"{key}: {value} is below the minimum {lo}")
    require(g.learning_rate > 0, f"grpo.learning_rate: {g.learning_rate} must be > 0")
    require(g.kl_coef >= 0, f"grpo.kl_coef: {g.kl_coef} must be >= 0 (0 disables the KL term)")
    require(0 < g.epsilon < 1, f"grpo.epsilon: {g.epsilon} must be in (0, 1), e.g. 0.2")
    require(g.epsilon_high is None or g.epsilon_high > 0,
            f"grpo.epsilon_high: {g.epsilon_high} must be > 0, e.g. 0.28")
    require(g.importance_sampling_cap >= 1,
            f"grpo.importance_sampling_cap: {g.importance_sampling_cap} must be >= 1")
    check_objective(g)
    require(cfg.rollout.temperature > 0,
            f"rollout.temperature: {cfg.rollout.temperature} must be > 0 for sampling")
    require(0 < cfg.rollout.top_p <= 1, f"rollout.top_p: {cfg.rollout.top_p} must be in (0, 1]")
    require(0 < cfg.rollout.gpu_memory_utilization < 1,
            f"rollout.gpu_memory_utilization: {cfg.rollout.gpu_memory_utilization} must be in "
            "(0, 1), e.g. 0.3 (on CPU rollout.cpu_kv_cache_gb sizes the KV cache instead)")
    require(cfg.rollout.cpu_kv_cache_gb > 0,
            f"rollout.cpu_kv_cache_gb: {cfg.rollout.cpu_kv_cache_gb} must be > 0, e.g. 0.25")
    require(g.max_steps == -1 or g.max_steps >= 1,
            f"grpo.max_steps: {g.max_steps} must be -1 (use num_train_epochs) or >= 1")
    require(g.num_train_epochs > 0, f"grpo.num_train_epochs: {g.num_train_epochs} must be > 0")
    for key in ("checkpoint.save_steps", "logging.sample_steps", "logging.eval_steps"):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        require(value >= 0, f"{key}: {value} must be >= 0 (0 turns it off)")
    max_len = cfg.rollout.max_model_len
    require(max_len is None or max_len >= cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
            f"rollout.max_model_len: {max_len} is shorter than data.max_prompt_length + "
            f"rollout.max_new_tokens = {cfg.data.max_prompt_length + cfg.rollout.max_new_tokens}")
    completions_per_rank = g.per_device_train_batch_size * g.gradient_accumulation_steps
    require(completions_per_rank % g.num_generations == 0,
            f"grpo.per_device_train_batch_size x grpo.gradient_accumulation_steps = {completions_per_rank} "
            f"completions per rank per step is not divisible by grpo.num_generations = "
            f"{g.num_generations}: whole groups must stay on one rank; use a multiple of "
            f"{g.num_generations}")
    require(len(cfg.rewards.functions) > 0 or not training,
            "rewards.functions is empty: add at least one, e.g. "
            "[{name: answer_match, weight: 1.0}]")
    verifiers = (cfg.rollout.environment or "").startswith("verifiers:")  # an outside agent (megagrpo/hubs)
    require(not any(fn.name == "environment" for fn in cfg.rewards.functions)
            or bool(cfg.rollout.environment and not verifiers),
            "rewards.functions: the 'environment' reward reads the get_reward() of rollout.environment, "
            + ("which a verifiers environment does not have: its reward is the 'agent' reward"
               if verifiers else "which is not set; set rollout.environment=module:Class or remove the reward"))
    require(verifiers or not (cfg.rollout.environment_config or cfg.rollout.verifiers_python),
            "rollout.environment_config and rollout.verifiers_python are a verifiers environment's "
            "(rollout.environment: verifiers:TASKSET), which is not set; remove them")
    require(not any(fn.name == "agent" for fn in cfg.rewards.functions)
            or bool(cfg.rollout.agent or cfg.rollout.agent_command or verifiers),
            "rewards.functions: the 'agent' reward is an outside agent's result, and neither rollout.agent nor "
            "rollout.agent_command (nor a verifiers rollout.environment) is set; set one or remove the reward")
    if isinstance(cfg.deepspeed, str):
        require(os.path.isfile(cfg.deepspeed),
                 f"deepspeed: file '{cfg.deepspeed}' does not exist; use one of configs/ds_*.json "
                 "or an inline mapping")
        with open(cfg.deepspeed) as f:
            try:
                json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"deepspeed: '{cfg.deepspeed}' is not valid JSON: {e}") from None
    else:
        require(isinstance(cfg.deepspeed, dict),
                 f"deepspeed: expected a path or a mapping, got {cfg.deepspeed!r}")
    require(cfg.checkpoint.resume in ("auto", "none") or os.path.isdir(cfg.checkpoint.resume),
            f"checkpoint.resume: '{cfg.checkpoint.resume}' is not auto, none or an existing "
            "checkpoint folder")


def check_objective(g) -> None:
    """The objective's options fit together (docs/objectives.md)."""
    require(g.importance_sampling_level == "token" or g.loss_type in ("grpo", "sapo"),
            f"grpo.importance_sampling_level: sequence with loss_type {g.loss_type}, which sums per-token "
            "terms and so weights each sequence by its length instead of optimising GSPO's per-sequence "
            "objective; use grpo.loss_type=grpo (or sapo)")
    epsilon_high = g.epsilon_high if g.epsilon_high is not None else g.epsilon
    require(g.delta is None or g.delta > 1 + epsilon_high,
            f"grpo.delta: {g.delta} must be above 1 + epsilon_high = {1 + epsilon_high:g} (e.g. 4), or null")
    require(g.delta is None or g.loss_type not in ("cispo", "sapo"),
            f"grpo.delta: two-sided clipping applies to the clipped objectives, not loss_type {g.loss_type}")
    require(g.sapo_temperature_pos > 0 and g.sapo_temperature_neg > 0,
            "grpo.sapo_temperature_pos/neg must be > 0 (defaults 1.0 and 1.05)")
    require(g.off_policy_mask_threshold is None or g.off_policy_mask_threshold >= 0,
            f"grpo.off_policy_mask_threshold: {g.off_policy_mask_threshold} must be >= 0, or null")
    require(not g.sync_ref_model or g.kl_coef > 0,
            "grpo.sync_ref_model: there is no reference model with kl_coef 0; set grpo.kl_coef > 0 or "
            "grpo.sync_ref_model=false")
    require(g.ref_model_sync_steps >= 1, f"grpo.ref_model_sync_steps: {g.ref_model_sync_steps} must be >= 1")
    require(0 < g.ref_model_mixup_alpha <= 1,
            f"grpo.ref_model_mixup_alpha: {g.ref_model_mixup_alpha} must be in (0, 1], e.g. 0.6")
    require(g.max_sampling_rounds >= 1, f"grpo.max_sampling_rounds: {g.max_sampling_rounds} must be >= 1")
    require(not (g.dynamic_sampling and g.scale_rewards == "batch"),
            "grpo.dynamic_sampling: the dropped groups would leave the batch's reward std measured on what "
            "remains; use grpo.scale_rewards=group (or none) with dynamic sampling")
    require(g.entropy_coef >= 0, f"grpo.entropy_coef: {g.entropy_coef} must be >= 0 (0: no entropy bonus)")
    require(0 < g.top_entropy_quantile <= 1,
            f"grpo.top_entropy_quantile: {g.top_entropy_quantile} must be in (0, 1], e.g. 0.2; 1 keeps every token")


TESTED_VISION_MODELS = ("idefics3", "smolvlm")
"""Vision-language architectures trained end to end here (docs/multimodal.md)."""


def check_vision_language(cfg: Config) -> None:
    """A vision-language model goes where its path is tested, or is refused with the reason."""
    with open(os.path.join(cfg.model.name_or_path, "config.json")) as f:
        model = json.load(f)
    if "vision_config" not in model:
        return
    kind, r = model.get("model_type"), cfg.rollout
    where = f"model.name_or_path: '{cfg.model.name_or_path}' is a vision-language model ({kind})"
    require(kind in TESTED_VISION_MODELS,
            f"{where}; megagrpo trains {', '.join(TESTED_VISION_MODELS)} so far (Qwen-VL's 3-D positions "
            "are not packed yet, and on the CPU stack vLLM's Qwen-VL needs torchvision: docs/multimodal.md)")
    p = cfg.parallel
    for key, value, why in [
            ("parallel.tensor_parallel_size", p.tensor_parallel_size, "AutoTP has no split plan for the vision tower"),
            ("parallel.pipeline_parallel_size", p.pipeline_parallel_size,
             "the pipeline's layer map holds decoder layers only"),
            ("parallel.sequence_parallel_size", p.sequence_parallel_size, "a row's image features would span sp ranks"),
            ("rollout.max_turns", r.max_turns, "tool results are text; no multi-turn loop carries images yet")]:
        require(value == 1, f"{key}: {value} with {where}: not supported ({why}); use 1")
    require(not r.servers and r.placement == "colocated",
            f"rollout.servers / rollout.placement=disaggregated with {where}: not supported (the servers' requests "
            "carry token ids, not images, so far); use a co-located engine")


def _looks_local(path: str) -> bool:
    """Hub names look like `org/name`; anything else that names a file system path is local."""
    data_file = path.lower().endswith((".jsonl", ".json", ".parquet", ".csv"))
    return (os.path.exists(path) or data_file or path.startswith((".", "/", "~"))
            or path.count("/") != 1)
