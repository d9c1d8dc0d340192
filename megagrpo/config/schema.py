"""The configuration schema: one dataclass per section, a docstring per field (the source of
docs/configuration.md), and the TRL-style names accepted at the top level (aliases.py maps them).

Loading and overrides live in loading.py, checks in validation.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional


class ConfigError(ValueError):
    """A configuration problem; the message names the key, the value and the fix."""


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ok."""
    if not ok:
        raise ConfigError(message)


SINKS = ("tensorboard", "jsonl", "wandb")  # where logging.report_to can send metrics


@dataclass
class LoraConfig:
    """LoRA adapters on the frozen base model, built with peft (docs/lora.md)."""

    r: int = 0
    """Adapter rank; 0 trains full weights (no adapters). TRL: lora_r."""
    alpha: Optional[float] = None
    """Scaling numerator: the update is (alpha / r) B A. Default 2 x r. TRL: lora_alpha."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (0 keeps the update pass deterministic,
    so the first pass's ratio to the old policy is exactly 1)."""
    target_modules: list = field(default_factory=lambda: ["all-linear"])
    """Linear layers that get adapters: short names (q_proj, v_proj, ...) or all-linear (every
    linear layer but the output head)."""
    modules_to_save: list = field(default_factory=list)
    """Modules trained in full beside the adapters (e.g. a norm); not the output head."""


@dataclass
class ModelConfig:
    """The policy model (and, when kl_coef > 0, the frozen reference: the same weights)."""

    name_or_path: str = ""
    """HF model folder (config.json + safetensors + tokenizer) or hub name."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Training and rollout dtype. float32 on CPU for exact comparisons."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: transformers' gradient_checkpointing_enable, or under
    pipeline parallelism DeepSpeed's pipeline activation checkpointing (every decoder layer)."""
    ref_offload: bool = False
    """Keep the frozen reference model's ZeRO-3 partitions in CPU memory (ZeRO-3 only)."""
    tiled_mlp: bool = False
    """DeepSpeed's TiledMLP in every decoder layer: the MLP runs on tiles of ~hidden-size tokens,
    recomputed in backward, so its intermediates never exist for a whole long row. ZeRO 0 or 3."""
    freeze_vision_tower: bool = True
    """A vision-language model's image encoder stays as loaded (no gradients, not synced to the
    generator after the first load); the connector and the language model train. false: the
    tower trains too (docs/multimodal.md)."""
    router_aux_loss_coef: float = 0.0
    """A mixture-of-experts policy: the router's load-balancing loss (the Switch
    Transformer's, as transformers computes it, summed over the layers) is added to the GRPO
    loss with this coefficient (e.g. 0.001, what Qwen3-MoE and Mixtral were trained with;
    0: off, the RL objective alone)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA policy: train adapters only; the KL reference is the base model with the adapters
    disabled (no second model). Off while lora.r is 0."""


@dataclass
class DataConfig:
    """Training and held-out prompts: files, fields, chat template inputs."""

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
    target_field: str = "reference"
    """Row field holding the gold text that eval's BLEU, ROUGE and perplexity compare with
    (formerly `data.reference_field`)."""


@dataclass
class ImagesConfig:
    """Images in prompts, for vision-language models (docs/multimodal.md): where rows keep them,
    the resolution they reach the processor at, and what a bad one does."""

    field: str = "images"
    """Row field listing a row's images (paths relative to the data file, data URIs or base64);
    rows may instead hold them as image parts of their `messages`."""
    longest_edge: Optional[int] = None
    """Images larger than this on their longer side are shrunk to it (aspect kept) before the
    processor, which then applies its own bounds (Idefics3's size.longest_edge, Qwen-VL's
    min_pixels/max_pixels); None: as stored."""
    max_source_pixels: int = 40_000_000
    """An image of more pixels (width x height, as stored) is refused before it is decoded."""
    max_per_prompt: int = 4
    """A row with more images than this is bad."""
    on_bad_image: Literal["refuse", "drop"] = "refuse"
    """A missing, unreadable, damaged or oversized image: refuse the run with a one-line error
    naming the file, row and image, or drop its row, count it and name it on the console."""


@dataclass
class ParallelConfig:
    """The parallel layout; data parallelism takes the rest of the world size."""

    tensor_parallel_size: int = 1
    """Ranks that split the decoder layers' weights (DeepSpeed AutoTP; embeddings, norms and
    the LM head stay replicated); dp is what is left of the world size."""
    pipeline_parallel_size: int = 1
    """Pipeline stages (DeepSpeed PipelineModule from the HF layers, Llama/Qwen2/Mistral); ZeRO
    stage 0 or 1, grpo.packing on, not with tensor_parallel_size > 1 in this version."""
    sequence_parallel_size: int = 1
    """Ranks that split each packed row along the sequence (DeepSpeed Ulysses), for trajectories
    too long for one rank; any ZeRO stage, grpo.packing on, no tensor or pipeline parallelism."""
    expert_parallel_size: int = 1
    """A mixture-of-experts policy: ranks that split each layer's experts (DeepSpeed AutoEP;
    tokens travel to their experts' ranks by all-to-all), inside the data-parallel ranks: dp
    must be a multiple of it. Any ZeRO stage (docs/moe.md)."""


@dataclass
class GRPOConfig:
    """The GRPO algorithm, its batch sizes and its optimiser."""

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
    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo"] = "dapo"
    """grpo: per-sequence mean; bnpo: per-token mean of the rank's batch (TRL: of each
    micro-batch); dapo: per-token mean of the global batch; dr_grpo: token sum over (sequences x
    max_new_tokens x max_turns); cispo: clipped, stop-gradient importance weight x A x logp
    (MiniMax-M1), global token mean; sapo: a soft sigmoid gate instead of the hard clip
    (sapo_temperature_pos/neg), per-sequence mean. docs/objectives.md."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: a ratio pi/pi_old per token; sequence: GSPO's one ratio per sequence,
    exp(mean_t log(pi/pi_old)), clipped per sequence (with loss_type grpo or sapo)."""
    delta: Optional[float] = None
    """Two-sided clipping: the unclipped ratio is capped at delta too, bounding the loss of
    negative advantages (> 1 + epsilon_high, e.g. 4; TRL's delta)."""
    sapo_temperature_pos: float = 1.0
    """SAPO's gate temperature for positive advantages."""
    sapo_temperature_neg: float = 1.05
    """SAPO's gate temperature for negative advantages."""
    use_bias_correction_kl: bool = True
    """Weight the k3 KL term by the ratio pi/pi_old, so that its gradient is the gradient of
    KL(pi || pi_ref) (it adds the score-function term k3 x grad log pi); false: the plain k3
    term, whose gradient misses that term (TRL's use_bias_correction_kl; docs/objectives.md)."""
    off_policy_mask_threshold: Optional[float] = None
    """Leave out of the policy term each sequence with a negative advantage whose mean
    KL(sampler || policy) per token is above this (DeepSeek-V3.2's off-policy sequence mask)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus entropy_coef x the mean entropy of the step's completion
    tokens (those the entropy quantile keeps), which pushes towards exploration."""
    top_entropy_quantile: float = 1.0
    """Share of each micro-batch's tokens, the highest-entropy ones, that the policy term
    covers (0.2: the "80/20" result); 1: all."""
    num_iterations: int = 1
    """Optimisation passes (GRPO's mu) over each generated batch (old-policy logprobs when > 1)."""
    sync_ref_model: bool = False
    """A moving reference (TR-DPO; TRL's sync_ref_model): every ref_model_sync_steps steps the
    reference becomes ref_model_mixup_alpha x policy + (1 - alpha) x reference. Needs kl_coef > 0."""
    ref_model_sync_steps: int = 512
    """Steps between two updates of the moving reference."""
    ref_model_mixup_alpha: float = 0.6
    """The policy's share in each update of the moving reference (1: a copy)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop the groups whose rewards are all equal (no advantage, no
    policy gradient) and sample more prompts until every rank has its share of informative
    groups, or max_sampling_rounds; then train on what they have (docs/objectives.md)."""
    max_sampling_rounds: int = 3
    """Most sampling rounds per step with dynamic_sampling."""
    mask_truncated_completions: bool = False
    """Exclude completions cut at max_new_tokens from the loss."""
    importance_sampling_correction: Literal[True, False, "token_truncate", "sequence_truncate",
                                            "sequence_mask", "none"] = "token_truncate"
    """The correction between the sampler's and the trainer's log-probs: token_truncate,
    min(pi_trainer / pi_sampler, C) per token (true means this); sequence_truncate, one weight
    per sequence (the product of its tokens'), capped at C; sequence_mask, that weight, or 0
    for a sequence past C; none (false)."""
    importance_sampling_cap: float = 2.0
    """Cap C of the importance weight (importance_sampling_correction)."""
    max_tokens_per_microbatch: int = 8192
    """Token budget (prompt + completion) of a training micro-batch; sequences are spread
    over the fewest micro-batches that fit, balanced. 0: fixed micro-batches of
    per_device_train_batch_size sequences."""
    packing: bool = True
    """Pack a micro-batch's sequences into one row without padding (flash-attn varlen on GPU,
    block-diagonal SDPA on CPU); false: padded rows (the plain path)."""
    fused_logprobs: bool = True
    """Compute log-probs and entropy from hidden states in chunks, never all N x V logits;
    false: full logits (the plain path)."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk of the fused log-prob pass."""
    seed: int = 42
    """Seed of the prompt order and of the rollout sampling schedule."""


@dataclass
class ToolConfig:
    """One tool the model may call in a multi-turn rollout (docs/agents.md)."""

    name: str = ""
    """`python` (built-in: runs the call's code in the sandbox, returns its stdout or error) or
    a dotted path module:function (its schema from its type hints and docstring)."""
    args: dict = field(default_factory=dict)
    """For python: sandbox limits (timeout_s, cpu_s, memory_mb, file_size_mb, open_files,
    processes, output_bytes) and mode (auto, strict, rlimits)."""


@dataclass
class RolloutConfig:
    """Generation: the engine and its sampling settings, and the weight sync."""

    engine: Literal["vllm", "hf"] = "vllm"
    """vllm: a vLLM engine inside each training process; hf: transformers generate."""
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """colocated: every rank trains and generates, one after the other (a vLLM engine inside
    each training process). disaggregated: the last rollout.ranks ranks of the launch only
    generate, each block of rollout.tensor_parallel_size of them running one `vllm serve` of
    the policy, and the others train, sending their weights after every step as to
    rollout.servers (docs/async.md)."""
    ranks: int = 0
    """rollout.placement=disaggregated: how many of the launch's ranks generate (the last ones;
    a whole number of servers of rollout.tensor_parallel_size ranks, each server's ranks on one
    node)."""
    servers: list = field(default_factory=list)
    """URLs of `vllm serve` processes started apart from the job (e.g. [http://node7:8000]):
    they generate instead of an engine in each training process, and take the new weights
    from rank 0 after every step (vLLM's weight-transfer API). Start each with
    VLLM_SERVER_DEV_MODE=1, --weight-transfer-config '{"backend": "gloo"}' and
    --logprobs-mode processed_logprobs (docs/async.md)."""
    server_timeout_s: float = 300.0
    """rollout.servers (and the servers of placement disaggregated): how long one request (and
    the wait for a server to start) may take."""
    server_retries: int = 3
    """rollout.servers (and placement disaggregated): a request that gets no answer (or a 5xx)
    is tried this many more times; then the job stops, naming the server."""
    max_staleness: int = 0
    """rollout.servers or placement disaggregated: the batches of the next k steps are sampled
    while the trainer trains this one (generation and training overlap); a batch is trained on
    at most k steps after the weights that sampled it. 0: each batch is sampled with the
    current weights, as the co-located engine does. Keep grpo.importance_sampling_correction on
    with k > 0 (docs/async.md)."""
    partial_rollouts: bool = False
    """With rollout.max_staleness > 0: at a weight update the requests in flight pause and go on
    with the new weights (vLLM's pause mode keep) instead of finishing first, so no update waits
    for the longest generation; each token keeps its weights' version and sampler log-prob
    (servers: --enable-scale-out)."""
    tensor_parallel_size: Optional[int] = None
    """vLLM tensor parallelism: each group of this many consecutive ranks holds one engine
    sharded between them (1/t of the weights and KV cache per rank), all of them sampling.
    Default: parallel.tensor_parallel_size (1 under pipeline parallelism). It must divide the
    trainer's tp or be a multiple of it (a group then pools the prompts of several dp replicas);
    1 under pipeline parallelism and with engine hf (docs/parallelism.md). With placement
    disaggregated: each server's tensor parallelism over its generating ranks (default 1)."""
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
    """On GPU, vLLM's share of accelerator memory for weights and KV cache (on CPU the KV cache
    is sized by cpu_kv_cache_gb instead). Co-located it shares the device with the trainer;
    with placement disaggregated the generating ranks hold vLLM alone: raise it (e.g. 0.9)."""
    cpu_kv_cache_gb: float = 0.25
    """On CPU: GiB of RAM vLLM reserves for its KV cache (per rank)."""
    max_model_len: Optional[int] = None
    """vLLM context length and a trajectory's token budget (prompt + every turn + tool
    messages); defaults to max_prompt_length + max_new_tokens, and with max_turns > 1 to
    max_prompt_length + max_turns x max_new_tokens + (max_turns - 1) x
    (max_tool_response_tokens + 32)."""
    sleep: bool = True
    """On GPU, put vLLM to sleep while the trainer runs (ignored on CPU)."""
    sync_bucket_mb: int = 256
    """Size of the parameter buckets gathered out of ZeRO-3 for the weight sync."""
    routing_replay: Literal["none", "r2", "r3"] = "r2"
    """A mixture-of-experts policy's routing replay (docs/moe.md). r2: with grpo.num_iterations
    > 1, the experts the old-policy pass chose for each token are used again in every update
    pass, so an update never moves a token to other experts than its old log-prob was computed
    with; with one iteration (or a dense model) nothing to replay. none: each pass routes
    afresh. r3: the experts the generator chose for every token it fed come with the
    completion and are replayed in every trainer pass (reference, old-policy, update): vLLM
    returns them on GPU only (its Model Runner V2), rollout.engine hf everywhere; not through
    `vllm serve` (rollout.servers, disaggregated placement)."""
    max_turns: int = 1
    """Model turns per trajectory. 1: single-turn completions (no tools). > 1: the model may
    call tools (rollout.tools, rollout.environment) and continues after their results until a
    turn without a tool call, max_turns, or the token budget (max_model_len). With
    rollout.agent: the model calls one episode may make."""
    tools: list[ToolConfig] = field(default_factory=list)
    """Tools offered to the model (rendered by the chat template), e.g. [{name: python},
    {name: my_pkg.tools:lookup}]; needs max_turns > 1."""
    environment: Optional[str] = None
    """module:Class: one instance per trajectory; its public methods are tools; optional
    reset(**row_fields), get_reward() (the `environment` reward) and close(). Or a hub's
    environment by name: textarena:GAME, e.g. textarena:GuessTheNumber-v0, run in the built-in
    loop; verifiers:TASKSET, run by verifiers itself as an outside agent, scored by the `agent`
    reward (docs/environments.md)."""
    environment_config: dict = field(default_factory=dict)
    """With environment verifiers:TASKSET: verifiers' EnvConfig as a mapping (vf-eval's --env.*
    options, nested), e.g. {taskset: {seed: 3}, player: {max_turns: 4}}. Every agent role
    defaults to the null harness on the subprocess runtime (no container, no cloud)."""
    verifiers_python: Optional[str] = None
    """With environment verifiers:TASKSET: the python of the venv that holds verifiers and the
    environment's package (a relative path is taken from the repository); default
    .venv-verifiers/bin/python, which `bash launch/install_hub.sh verifiers` makes."""
    tool_call_parser: str = "hermes"
    """How tool calls are read from a turn: hermes (<tool_call>{"name", "arguments"}</tool_call>,
    Qwen/Hermes templates) or module:function(text) -> list of rollout.tools.ParsedCall."""
    tool_timeout_s: float = 10.0
    """Wall-clock limit of one function or environment call (python: its sandbox timeout_s)."""
    max_tool_response_tokens: int = 256
    """A tool result longer than this many tokens is cut, with a marker the model sees."""
    max_tool_calls_per_turn: int = 4
    """Calls beyond this in one turn are not run; each gets an error message."""
    tool_workers: int = 2
    """Sandboxed python calls running at once (per rank)."""
    agent: Optional[str] = None
    """module:function of an agent program megagrpo did not write, run once per episode and
    generating through megagrpo's OpenAI-compatible endpoint: called as fn(base_url=,
    api_key=, model=, task=) in a thread; it returns the episode's result (a number or
    {"reward": number}, for the `agent` reward). rollout.max_turns caps its model calls
    (docs/agents.md)."""
    agent_command: Optional[str] = None
    """A command run once per episode instead of rollout.agent, e.g. "python my_agent.py": it
    gets OPENAI_BASE_URL, OPENAI_API_KEY, MEGAGRPO_MODEL and MEGAGRPO_TASK (JSON; also on
    stdin), and its last line of output is its result."""
    agent_timeout_s: float = 300.0
    """An episode's program running longer fails (scores 0, reason "timeout"); a command is killed."""
    agent_concurrency: int = 64
    """Episodes running at once per rank; their requests reach the generator in one batch."""
    agent_batch_window_s: float = 0.05
    """The longest a request waits for the other running episodes' requests before the batch
    goes to the generator (it goes at once when every running episode has one in)."""
    agent_model_name: str = "policy"
    """The model name the endpoint serves; a request for any other gets OpenAI's 404."""


@dataclass
class RewardFunctionConfig:
    """One reward function of the weighted sum."""

    name: str = ""
    """Built-in name (answer_match, format, length_penalty, environment, agent, customer_service, math_accuracy,
    think_answer_format, overlong_penalty, code, reward_model, reasoning_gym, judge) or dotted path module:function."""
    weight: float = 1.0
    """Weight of this function in the summed reward."""
    args: dict = field(default_factory=dict)
    """Keyword arguments given to the function on every call."""
    pass_threshold: Optional[float] = None
    """Held-out pass@k: a completion passes when this function gives it at least this. Unset:
    pass@k is reported only when every reward the function gave is 0 or 1 (pass/fail)."""


@dataclass
class RewardsConfig:
    """The reward: a weighted sum of reward functions."""

    functions: list[RewardFunctionConfig] = field(default_factory=list)
    """List of {name, weight, args}; the reward is the weighted sum."""


@dataclass
class TeacherConfig:
    """On-policy distillation (docs/distillation.md): a teacher scores every token the policy
    sampled, and coef x (log p_teacher - log p_policy), the negative per-token reverse KL, joins
    each token's advantage. Unset (no model, no url): no teacher."""

    model: Optional[str] = None
    """HF folder of the teacher, run in the job beside the frozen reference (ZeRO-3 partitioned
    like the policy when it uses ZeRO-3). Its tokenizer must be the policy's: the teacher scores
    the policy's token ids."""
    url: Optional[str] = None
    """Or the base URL of an OpenAI-compatible server of the teacher (`vllm serve`, which
    returns prompt log-probs), e.g. http://node7:8001."""
    coef: float = 1.0
    """Weight of the teacher's per-token advantage, log p_teacher - log p_policy."""
    task_weight: float = 1.0
    """Weight of the task reward's group advantage beside it; 0: distillation alone (the rewards
    are still computed and logged)."""
    offload: bool = False
    """ZeRO-3: keep the teacher's parameters in host memory (as model.ref_offload does the
    reference's)."""
    disagreement_nats: float = 2.3
    """teacher/disagreement counts the sampled tokens the teacher finds this many nats less
    likely than the policy does (2.3: ten times less likely)."""
    timeout_s: float = 300.0
    """teacher.url: seconds to wait for the server to be ready, and for each request."""
    retries: int = 3
    """teacher.url: tries again when the server does not answer or answers 5xx, then stops the
    run naming the server."""


@dataclass
class CheckpointConfig:
    """Checkpoints, resume and the final HF export."""

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
    """Metrics, samples, held-out evaluation and the progress bar."""

    logging_steps: int = 1
    """Write the training metrics every N steps."""
    report_to: Any = field(default_factory=lambda: ["tensorboard", "jsonl"])
    """Where metrics go (TRL's list): tensorboard (output_dir/tensorboard), jsonl (one JSON object
    per logged step in output_dir/metrics.jsonl), wandb (Weights & Biases; WANDB_MODE=offline
    works without an account); none, or all. A single name is a list of one."""
    run_name: Optional[str] = None
    """The run's name in W&B (default: the output_dir's folder name)."""
    wandb_project: str = "megagrpo"
    """The W&B project."""
    wandb_tags: list = field(default_factory=list)
    """Tags of the W&B run."""
    sample_steps: int = 10
    """Log sample prompts and completions as text every N steps (0: never)."""
    eval_steps: int = 0
    """Held-out accuracy every N steps (0: only before and after training)."""
    eval_num_generations: int = 1
    """Completions per held-out prompt: 1 is greedy; n > 1 samples n for pass@k (k <= n)."""
    progress_bar: bool = True
    """Progress on rank 0: a bar with step, reward and step time on a terminal; where stdout is
    not a terminal (SLURM, nohup), one line every logging_steps (step, reward, KL, step time,
    tokens/s, time left)."""


@dataclass
class DoctorConfig:
    """The run doctor (docs/monitoring.md): checks on the logged metrics during training (and
    `megagrpo doctor RUN_DIR` afterwards), each a console line with the step, the likely cause
    and the fix, once per episode of trouble; also in every sink and `megagrpo report`."""

    enabled: bool = True
    """Run the checks during training (false: none; `megagrpo doctor` still reads the run)."""
    window: int = 5
    """Logged steps a trend check looks back over (entropy, zero-advantage groups, reward swings,
    repetition, the grad-norm median); an episode of trouble ends after this many clear steps."""
    kl_max: float = 0.8
    """KL to the reference above this: the policy has drifted too far (the seed's 0.8)."""
    entropy_min: float = 0.02
    """Mean entropy of the sampled tokens (nats) over the window below this: collapse."""
    entropy_fraction: float = 0.1
    """Entropy still falling over the window and below this share of its start: collapse ahead."""
    max_zero_advantage: float = 0.9
    """Share of groups whose completions all scored the same (no advantage, nothing to learn),
    averaged over the window, above this."""
    reward_swing: float = 0.15
    """The mean reward's swings around its trend over the window (their standard deviation), as
    a share of the reward's range so far: above this, and larger than the trend itself."""
    max_repeated_ngrams: float = 0.3
    """Share of a completion's 4-grams that repeat an earlier one in it (mean over the window)."""
    min_distinct_2: float = 0.05
    """Distinct bigrams among a group's completions, as a share of all their bigrams (mean over
    the window), below this."""
    grad_norm_spike: float = 10.0
    """Gradient norm above this multiple of its median over the previous 4 x window steps."""
    max_sampler_gap: float = 0.1
    """Mean |log p sampler - log p trainer| per sampled token (nats) above this."""
    max_node_memory: float = 0.9
    """Share of the node's memory in use (on CUDA: of the GPU's), the largest over the ranks."""
    max_plan_memory: float = 1.2
    """A rank's peak memory as a multiple of `megagrpo plan`'s peak per rank (CPU runs): above
    it, the plan no longer describes the run."""


@dataclass
class Config:
    """One experiment."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    deepspeed: Any = "configs/ds_zero3.json"
    """Path to a DeepSpeed JSON or an inline mapping. Batch, optimizer and precision keys are
    filled in from this config."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    doctor: DoctorConfig = field(default_factory=DoctorConfig)
    output_dir: str = "runs/megagrpo"
    """Where TensorBoard logs, checkpoints, eval results and the final HF model go."""


def has_teacher(cfg: Config) -> bool:
    """Whether the run distils from a teacher (teacher.model or teacher.url)."""
    return bool(cfg.teacher.model or cfg.teacher.url)


def max_sequence_length(cfg: Config) -> int:
    """The longest prompt + completion a rollout can make: prompt + max_new_tokens; with
    max_turns > 1 the trajectory budget (every turn and tool message), rollout.max_model_len
    or its default."""
    r = cfg.rollout
    if r.max_turns == 1:
        return cfg.data.max_prompt_length + r.max_new_tokens
    if r.max_model_len:
        return r.max_model_len
    tool_room = (r.max_turns - 1) * (r.max_tool_response_tokens + 32)  # 32: the template's own tokens
    return cfg.data.max_prompt_length + r.max_turns * r.max_new_tokens + tool_room
