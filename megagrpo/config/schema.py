"""Experiment configuration: typed sections, YAML plus `key.sub=value` overrides, validation.

Everything is checked here, before any model is built. Every error names the key, the value
and the fix. The seed's TRL-style names (num_generations, learning_rate, kl_coef, ...) are
accepted at the top level of the YAML and on the command line and land in their section.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message names the key, the value and the fix."""


@dataclass
class ModelConfig:
    name_or_path: str = ""
    """HF model folder (config.json + safetensors + tokenizer) or hub name."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Training and rollout dtype. float32 on CPU for exact comparisons."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (transformers' gradient_checkpointing_enable)."""
    ref_offload: bool = False
    """Keep the frozen reference model's ZeRO-3 partitions in CPU memory (ZeRO-3 only)."""


@dataclass
class DataConfig:
    train_file: str = ""
    """Local JSONL/JSON/Parquet/CSV file, or a hub dataset name when online."""
    eval_file: Optional[str] = None
    """Held-out file for accuracy before/after training and every eval_steps."""
    split: str = "train"
    """Split name of train_file when it is a hub dataset."""
    eval_split: str = "test"
    """Split name of eval_file when it is a hub dataset."""
    prompt_field: str = "prompt"
    """Row field holding the prompt text (rows with `messages` need no prompt field)."""
    system_prompt: Optional[str] = None
    """System prompt for every row that has none of its own."""
    max_prompt_length: int = 512
    """Prompts longer than this (in tokens, after the chat template) are dropped and counted."""
    shuffle: bool = True
    """Reshuffle the prompts every epoch (seeded)."""
    reference_field: str = "reference"
    """Row field holding a reference answer text for eval's BLEU, ROUGE and perplexity."""


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Ranks that split every layer (DeepSpeed AutoTP, vocab-parallel LM head); dp is what
    is left of the world size."""
    pipeline_parallel_size: int = 1
    """Pipeline stages (DeepSpeed PipelineModule from the HF layers, Llama/Qwen2/Mistral); ZeRO
    stage 0 or 1, grpo.packing on, not with tensor_parallel_size > 1 in this version."""


@dataclass
class GRPOConfig:
    num_generations: int = 8
    """G: completions sampled per prompt; advantages are computed inside each group."""
    per_device_train_batch_size: int = 8
    """Completions per rank per micro-batch when max_tokens_per_microbatch is 0. Completions
    per rank per step = this x gradient_accumulation_steps, whatever the micro-batching."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (with max_tokens_per_microbatch 0)."""
    learning_rate: float = 1e-6
    """Peak AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.99
    """AdamW beta2."""
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    """After warmup: constant, or cosine decay to 0 at the last step."""
    warmup_steps: int = 0
    """Linear warmup steps before the schedule."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 disables)."""
    num_train_epochs: float = 1.0
    """Passes over the prompts (used when max_steps is -1)."""
    max_steps: int = -1
    """Training steps (one generation batch each, with num_iterations optimizer steps);
    -1 derives it from num_train_epochs."""
    kl_coef: float = 0.04
    """KL(k3) coefficient to the frozen reference model; 0 builds no reference model."""
    epsilon: float = 0.2
    """Lower clip range of the ratio: 1 - epsilon."""
    epsilon_high: Optional[float] = None
    """Upper clip range: 1 + epsilon_high (DAPO clip-higher); defaults to epsilon."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the group's std, the batch's std, or not at all."""
    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo"] = "dapo"
    """grpo: per-sequence mean; bnpo: per-token mean of the rank's batch; dapo: per-token
    mean of the global batch; dr_grpo: token sum over (sequences x max_new_tokens)."""
    num_iterations: int = 1
    """mu: optimisation passes over each generated batch (old-policy logprobs when > 1)."""
    mask_truncated_completions: bool = False
    """Exclude completions cut at max_new_tokens from the loss."""
    importance_sampling_correction: bool = True
    """Truncated importance sampling between the sampler's and the trainer's logprobs."""
    importance_sampling_cap: float = 2.0
    """Cap C of the truncated importance weight min(pi_trainer / pi_sampler, C)."""
    max_tokens_per_microbatch: int = 8192
    """Token budget (prompt + completion) of a training micro-batch; sequences are spread
    over the fewest micro-batches that fit, balanced. 0: fixed micro-batches of
    per_device_train_batch_size sequences."""
    packing: bool = True
    """Pack a micro-batch's sequences into one row without padding (flash-attn varlen on GPU,
    block-diagonal SDPA on CPU); false: padded rows (the reference path)."""
    fused_logprobs: bool = True
    """Compute log-probs and entropy from hidden states in chunks, never all N x V logits;
    false: full logits (the reference path)."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk of the fused log-prob pass."""
    seed: int = 42
    """Seed of the prompt order and of the rollout sampling schedule."""


@dataclass
class RolloutConfig:
    engine: Literal["vllm", "hf"] = "vllm"
    """vllm: a vLLM engine inside each training process; hf: transformers generate."""
    max_new_tokens: int = 256
    """Longest completion (TRL: max_completion_length)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer computes logprobs at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """-1 disables top-k."""
    stop: list = field(default_factory=list)
    """Extra stop strings (the tokenizer's EOS always stops)."""
    gpu_memory_utilization: float = 0.3
    """vLLM's share of accelerator memory (of RAM on CPU) for weights and KV cache."""
    cpu_kv_cache_gb: float = 0.25
    """On CPU: GiB of RAM vLLM reserves for its KV cache (per rank)."""
    max_model_len: Optional[int] = None
    """vLLM context length; defaults to max_prompt_length + max_new_tokens."""
    sleep: bool = True
    """On GPU, put vLLM to sleep while the trainer runs (ignored on CPU)."""
    sync_bucket_mb: int = 256
    """Size of the parameter buckets gathered out of ZeRO-3 for the weight sync."""


@dataclass
class RewardFunctionConfig:
    name: str = ""
    """Built-in name (answer_match, format, length_penalty, customer_service, math_accuracy,
    think_answer_format, overlong_penalty, code, reward_model) or dotted path module:function."""
    weight: float = 1.0
    """Weight of this function in the summed reward."""
    args: dict = field(default_factory=dict)
    """Keyword arguments given to the function on every call."""


@dataclass
class RewardsConfig:
    functions: list = field(default_factory=list)
    """List of {name, weight, args}; the reward is the weighted sum."""


@dataclass
class CheckpointConfig:
    save_steps: int = 0
    """Save every N training steps (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept; the one `latest` names is never removed."""
    resume: str = "auto"
    """auto: continue from output_dir/checkpoints/latest if present; none; or a checkpoint path."""
    save_hf_at_end: bool = True
    """Write an HF model folder (safetensors, config, tokenizer) to output_dir/hf at the end."""


@dataclass
class LoggingConfig:
    logging_steps: int = 1
    """Write the training metrics every N steps."""
    report_to: Literal["tensorboard", "none"] = "tensorboard"
    """tensorboard: event files under output_dir/tensorboard; none: no logging."""
    sample_steps: int = 10
    """Log sample prompts and completions as text every N steps (0: never)."""
    eval_steps: int = 0
    """Held-out accuracy every N steps (0: only before and after training)."""
    eval_num_generations: int = 1
    """Completions per held-out prompt: 1 is greedy; n > 1 samples n for pass@k (k <= n)."""
    progress_bar: bool = True
    """A progress bar on rank 0 with step, reward and step time."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    deepspeed: Any = "configs/ds_zero3.json"
    """Path to a DeepSpeed JSON or an inline mapping. Batch, optimizer and precision keys are
    filled in from this config."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    output_dir: str = "runs/megagrpo"
    """Where TensorBoard logs, checkpoints, eval results and the final HF model go."""


# The seed's (TRL's) flat names and where they live.
ALIASES = {
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
    "save_steps": "checkpoint.save_steps",
    "max_completion_length": "rollout.max_new_tokens",
    "max_prompt_length": "data.max_prompt_length",
    "temperature": "rollout.temperature",
    "model_name_or_path": "model.name_or_path",
}


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set '{dotted}': '{part}' is {child!r}, not a section")
        node = child
    node[parts[-1]] = value


def _canonical(key: str, value: Any) -> tuple[str, Any]:
    """A seed (TRL) name -> its dotted place; use_vllm -> rollout.engine."""
    if key == "use_vllm":
        _require(isinstance(value, bool), f"use_vllm: expected true or false, got {value!r}")
        return "rollout.engine", "vllm" if value else "hf"
    return ALIASES.get(key, key), value


def _apply_aliases(raw: dict) -> dict:
    out: dict = {}
    for key, value in raw.items():
        dotted, value = _canonical(key, value)
        if dotted == key and isinstance(value, dict):  # a section: merge with aliases seen so far
            out.setdefault(key, {}).update(value)
        else:
            _set_dotted(out, dotted, value)
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """`grpo.kl_coef=0.1` -> ("grpo.kl_coef", 0.1); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not key=value (example: grpo.kl_coef=0.1)")
    key, value = text.split("=", 1)
    key = key.strip().lstrip("-")
    try:
        parsed = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    return key, parsed


def _check_type(path: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(path, value, inner[0])
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint_text = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{path}: {value!r} is not one of {list(args)}{hint_text}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    if hint in (list, dict) or origin in (list, dict):
        base = origin or hint
        if not isinstance(value, base):
            raise ConfigError(f"{path}: expected a {base.__name__}, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported type {hint}")


def _build(cls, raw: Any, path: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        where = f"{path}.{key}" if path else key
        if key not in names:
            candidates = names + ([a for a in ALIASES] + ["use_vllm"] if not path else [])
            close = difflib.get_close_matches(key, candidates, n=1)
            fix = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key '{where}' ({fix})")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, where)
        else:
            kwargs[key] = _check_type(where, value, hint)
    return cls(**kwargs)


def load_config(path: Optional[str], overrides: list[str] = (), training: bool = True) -> Config:
    """Read a YAML file, apply `key.sub=value` overrides, build and validate the Config
    (training=False: for `megagrpo eval`, which needs no reward function)."""
    raw: dict = {}
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file '{path}' does not exist")
        with open(path) as f:
            try:
                raw = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections")
    raw = _apply_aliases(raw)
    for text in overrides:
        _set_dotted(raw, *_canonical(*parse_override(text)))
    rewards = raw.get("rewards")
    if isinstance(rewards, dict) and isinstance(rewards.get("functions"), list):
        rewards["functions"] = [
            _build(RewardFunctionConfig, fn if isinstance(fn, dict) else {"name": fn},
                   f"rewards.functions[{i}]")
            for i, fn in enumerate(rewards["functions"])
        ]
    cfg = _build(Config, raw, "")
    validate(cfg, training)
    return cfg


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: Config, training: bool = True) -> None:
    """Ranges, divisibility and files; relative paths are taken from the working directory."""
    g = cfg.grpo
    _require(bool(cfg.model.name_or_path),
             "model.name_or_path is empty: set it to an HF model folder, e.g. "
             "model.name_or_path=runs/tiny/model")
    if _looks_local(cfg.model.name_or_path):
        _require(os.path.isfile(os.path.join(cfg.model.name_or_path, "config.json")),
                 f"model.name_or_path: '{cfg.model.name_or_path}' has no config.json; build the "
                 "tiny model with `python tools/make_tiny_model.py` or point it at an HF folder")
    _require(bool(cfg.data.train_file), "data.train_file is empty: set it to a JSONL/JSON/"
             "Parquet/CSV file or a hub dataset name")
    for key in ("train_file", "eval_file"):
        value = getattr(cfg.data, key)
        if value and _looks_local(value):
            _require(os.path.isfile(value), f"data.{key}: file '{value}' does not exist")
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
        _require(value >= lo, f"{key}: {value} is below the minimum {lo}")
    _require(g.learning_rate > 0, f"grpo.learning_rate: {g.learning_rate} must be > 0")
    _require(g.kl_coef >= 0, f"grpo.kl_coef: {g.kl_coef} must be >= 0 (0 disables the KL term)")
    _require(0 < g.epsilon < 1, f"grpo.epsilon: {g.epsilon} must be in (0, 1), e.g. 0.2")
    _require(g.epsilon_high is None or g.epsilon_high > 0,
             f"grpo.epsilon_high: {g.epsilon_high} must be > 0, e.g. 0.28")
    _require(g.importance_sampling_cap >= 1,
             f"grpo.importance_sampling_cap: {g.importance_sampling_cap} must be >= 1")
    _require(cfg.rollout.temperature > 0,
             f"rollout.temperature: {cfg.rollout.temperature} must be > 0 for sampling")
    _require(0 < cfg.rollout.top_p <= 1, f"rollout.top_p: {cfg.rollout.top_p} must be in (0, 1]")
    _require(0 < cfg.rollout.gpu_memory_utilization < 1,
             f"rollout.gpu_memory_utilization: {cfg.rollout.gpu_memory_utilization} must be in "
             "(0, 1), e.g. 0.3 (on CPU rollout.cpu_kv_cache_gb sizes the KV cache instead)")
    _require(cfg.rollout.cpu_kv_cache_gb > 0,
             f"rollout.cpu_kv_cache_gb: {cfg.rollout.cpu_kv_cache_gb} must be > 0, e.g. 0.25")
    _require(g.max_steps == -1 or g.max_steps >= 1,
             f"grpo.max_steps: {g.max_steps} must be -1 (use num_train_epochs) or >= 1")
    _require(g.num_train_epochs > 0, f"grpo.num_train_epochs: {g.num_train_epochs} must be > 0")
    for key in ("checkpoint.save_steps", "logging.sample_steps", "logging.eval_steps"):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        _require(value >= 0, f"{key}: {value} must be >= 0 (0 turns it off)")
    max_len = cfg.rollout.max_model_len
    _require(max_len is None or max_len >= cfg.data.max_prompt_length + cfg.rollout.max_new_tokens,
             f"rollout.max_model_len: {max_len} is shorter than data.max_prompt_length + "
             f"rollout.max_new_tokens = {cfg.data.max_prompt_length + cfg.rollout.max_new_tokens}")
    per_rank = g.per_device_train_batch_size * g.gradient_accumulation_steps
    _require(per_rank % g.num_generations == 0,
             f"grpo.per_device_train_batch_size x grpo.gradient_accumulation_steps = {per_rank} "
             f"completions per rank per step is not divisible by grpo.num_generations = "
             f"{g.num_generations}: whole groups must stay on one rank; use a multiple of "
             f"{g.num_generations}")
    _require(len(cfg.rewards.functions) > 0 or not training,
             "rewards.functions is empty: add at least one, e.g. "
             "[{name: answer_match, weight: 1.0}]")
    from megagrpo.rewards import RewardError, resolve
    for i, fn in enumerate(cfg.rewards.functions):
        _require(bool(fn.name), f"rewards.functions[{i}].name is empty")
        try:
            resolve(fn.name)
        except RewardError as e:
            raise ConfigError(f"rewards.functions[{i}].name: {e}") from None
    if isinstance(cfg.deepspeed, str):
        _require(os.path.isfile(cfg.deepspeed),
                 f"deepspeed: file '{cfg.deepspeed}' does not exist; use one of configs/ds_*.json "
                 "or an inline mapping")
        with open(cfg.deepspeed) as f:
            try:
                json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"deepspeed: '{cfg.deepspeed}' is not valid JSON: {e}") from None
    else:
        _require(isinstance(cfg.deepspeed, dict),
                 f"deepspeed: expected a path or a mapping, got {cfg.deepspeed!r}")
    _validate_parallel(cfg)
    _require(cfg.checkpoint.resume in ("auto", "none") or os.path.isdir(cfg.checkpoint.resume),
             f"checkpoint.resume: '{cfg.checkpoint.resume}' is not auto, none or an existing "
             "checkpoint folder")


PIPELINE_ARCHITECTURES = ("llama", "qwen2", "mistral")


def _validate_parallel(cfg: Config) -> None:
    """Layouts DeepSpeed or the model cannot run are refused here, before anything is built."""
    tp, pp = cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size
    _require(tp >= 1, f"parallel.tensor_parallel_size: {tp} must be >= 1")
    _require(pp >= 1, f"parallel.pipeline_parallel_size: {pp} must be >= 1")
    if pp > 1:
        stage = deepspeed_zero_stage(cfg)
        _require(stage <= 1, f"parallel.pipeline_parallel_size={pp} with ZeRO stage {stage}: DeepSpeed "
                 "runs pipelines with ZeRO stage 0 or 1 only; use configs/ds_zero0.json or a "
                 "stage-1 config, or pipeline_parallel_size=1")
    world = os.environ.get("WORLD_SIZE")
    if world is not None:
        _require(int(world) % (tp * pp) == 0,
                 f"world size {world} is not divisible by tensor_parallel_size x "
                 f"pipeline_parallel_size = {tp} x {pp}; launch a multiple of {tp * pp} ranks")
    model_config = os.path.join(cfg.model.name_or_path, "config.json")
    if (tp > 1 or pp > 1) and os.path.isfile(model_config):
        with open(model_config) as f:
            model = json.load(f)
        heads = model.get("num_attention_heads")
        kv_heads = model.get("num_key_value_heads", heads)
        for name, count in (("attention heads", heads), ("key-value heads", kv_heads)):
            _require(count is None or count % tp == 0,
                     f"parallel.tensor_parallel_size={tp} does not divide the model's {count} "
                     f"{name}; use a divisor of {count}")
        _require(pp == 1 or model.get("model_type") in PIPELINE_ARCHITECTURES,
                 f"parallel.pipeline_parallel_size={pp}: no pipeline layer map for model_type "
                 f"'{model.get('model_type')}' (supported: {', '.join(PIPELINE_ARCHITECTURES)})")
        layers = model.get("num_hidden_layers", pp)
        _require(layers >= pp, f"parallel.pipeline_parallel_size={pp} exceeds the model's "
                 f"{layers} layers")
    if pp > 1:
        _require(tp == 1, f"parallel.pipeline_parallel_size={pp} with tensor_parallel_size={tp}: "
                 "tensor and pipeline parallelism together are not in this version; use one of them "
                 "(with data parallelism)")
        _require(cfg.grpo.packing, f"parallel.pipeline_parallel_size={pp} needs grpo.packing=true "
                 "(the stages pass packed rows, not padded ones)")
        _require(not cfg.model.gradient_checkpointing, f"parallel.pipeline_parallel_size={pp} with "
                 "model.gradient_checkpointing=true is not in this version: a stage holds only its "
                 "own layers' activations; set model.gradient_checkpointing=false")


def deepspeed_zero_stage(cfg: Config) -> int:
    ds = cfg.deepspeed
    if isinstance(ds, str):
        with open(ds) as f:
            ds = json.load(f)
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def _looks_local(path: str) -> bool:
    """Hub names look like `org/name`; anything else that names a file system path is local."""
    data_file = path.lower().endswith((".jsonl", ".json", ".parquet", ".csv"))
    return (os.path.exists(path) or data_file or path.startswith((".", "/", "~"))
            or path.count("/") != 1)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
