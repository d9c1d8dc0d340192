"""The layout of a run, before anything starts: which rank holds which shard, the bytes of
model state (parameters, gradients, optimizer) each rank will hold, and its peak memory.

    megagrpo plan --config X.yaml --world-size 16 [key.sub=value ...]
    python -m megagrpo.train --dry-run --config X.yaml ...   (world size from the launcher)

The model is built on the meta device (no memory, no weights read) to count its parameters.
AutoTP splits the 2-D weights of the decoder layers over the tp ranks; embeddings, norms and
the LM head are replicated. A pipeline holds one stage per tp group, partitioned by parameters
as DeepSpeed does it (the largest stage is reported; a tied head keeps a copy of the embedding
on the last stage), its decoder layers split over the stage's tp ranks. Bytes per parameter as
DeepSpeed's ZeRO optimizers hold them:
4 (weights) + 4 (gradients) + 12 (a float32 master copy and the two Adam moments) in float32
training, which bench/parallel_memory.py measures within 1% per rank; 2 + 2 + 12 in bfloat16.
ZeRO stage 1 splits the optimizer state over the ZeRO partitions (dp x sp ranks), stage 2 the
gradients too, stage 3 the weights too. Gradients are counted as held during the backward:
between steps ZeRO 1 and 2 free them, so the model state measured at rest there is lower by
the gradient bytes (bench/parallel_memory.py shows both stages). The frozen reference model
(when kl_coef > 0) holds weights only, and so does a distillation teacher (teacher.model, its
own parameters, laid out as the reference is); the co-located vLLM engine holds its share of the
weights (split over rollout.tensor_parallel_size) plus its KV cache, and nothing when
rollout.servers or a disaggregated placement generate. A LoRA policy (model.lora) trains its
adapters only: gradients and optimizer state are the adapters' (r x (in + out) per adapted
linear layer, plus the modules to save), the frozen base holds weights only (partitioned under
ZeRO-3 like the adapters), and there is no reference model (the base with its adapters
disabled is the reference). A mixture-of-experts model (Qwen3-MoE, Mixtral) holds its 3-D
expert tensors (mlp.experts.gate_up_proj, down_proj) apart: under AutoEP
(parallel.expert_parallel_size e) a rank holds E/e experts per layer, and ZeRO partitions them
(stage 3), their gradients (2) and optimizer state (1-3) over the expert-data-parallel group,
the dp/e ranks holding the same experts, while the rest (attention, routers, embeddings)
partitions over dp as a dense model does: the parameter and optimizer-state elements of each
of 2 ranks equal this count (ZeRO 1 and 3, e 1 and 2, every parameter partitioned: no
stage3_param_persistence_threshold). The reference is laid out like the policy under ZeRO-3
(AutoEP included), else a plain module holding every expert; the vLLM engine holds every
expert (split by its own tp). What ZeRO offloads (offload_optimizer, offload_param;
model.ref_offload for a ZeRO-3 reference, teacher.offload for a teacher) lives in host
memory: on GPUs the peak leaves it out, and the optimizer step, which runs there (DeepSpeed's
CPU Adam), with it. The peak's parts, each measured: docs/parallelism.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megagrpo.cluster.generator_layout import generator_layout
from megagrpo.cluster.topology import Topology
from megagrpo.config.deepspeed_json import read_deepspeed_config, zero_stage
from megagrpo.config.schema import Config, ConfigError, max_sequence_length
from megagrpo.policy.lora import count_trained_parameters

BYTES = {"float32": (4, 4, 12), "bfloat16": (2, 2, 12)}


@dataclass
class Plan:
    world_size: int
    dp: int
    tp: int
    pp: int
    zero_stage: int
    params_total: int
    params_sharded: int          # split by tensor parallelism
    params_trained: int          # with gradients and optimizer state (a LoRA policy: its adapters)
    bytes_per_rank: dict         # bytes: params, grads, optimizer, reference, teacher, rollout_weights
    ranks: list                  # (rank, dp_rank, tp_rank, pp_stage)
    peak: dict = field(default_factory=dict)  # bytes held at a rank's peak, by what holds them
    lora: bool = False
    generator_tp: int = 1        # rollout.tensor_parallel_size: the vLLM engine's shards
    servers: list = field(default_factory=list)  # rollout.servers: generation apart from the job
    max_staleness: int = 0
    generating_ranks: int = 0    # rollout.placement=disaggregated: the launch's last ranks (world_size counts them)
    generating_peak: int = 0     # bytes one generating rank holds (its server's share)
    sp: int = 1                  # parallel.sequence_parallel_size: ranks that split each row
    ep: int = 1                  # parallel.expert_parallel_size: ranks that split each layer's experts (AutoEP)
    params_experts: int = 0      # of params_total, the 3-D expert tensors (a mixture of experts)
    experts: tuple = ()          # (experts per layer, top-k, MoE layers) of a mixture of experts
    expert_bytes: dict = field(default_factory=dict)  # the experts' share of each bytes_per_rank entry
    params_held: int = 0         # parameters one rank holds before ZeRO-3 partitions them
    trained_partition: int = 0   # trained parameters in this rank's ZeRO partition (its optimizer state)
    offloaded: dict = field(default_factory=dict)  # bytes_per_rank keys ZeRO offloads to host memory: the setting

    @property
    def zero_partitions(self) -> int:
        """Ranks a ZeRO stage partitions the state over: DeepSpeed's sequence-data-parallel group."""
        return self.dp * self.sp


def model_config(model_path: str):
    """The model's config.json (all a plan reads); ConfigError in one line when it cannot be read."""
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"model.name_or_path: cannot read the config of '{model_path}' ({why}). The plan needs "
                          "only its config.json: point model.name_or_path at a local model folder, download it "
                          f"into the HF cache (`huggingface-cli download {model_path} config.json`), or with a "
                          "cached copy set HF_HUB_OFFLINE=1") from None


def parameter_counts(model_path: str) -> dict:
    """From the model's config, on the meta device: all parameters (a vision-language model's
    image encoder and connector included), those AutoTP splits, the image encoder's, and a
    mixture of experts' 3-D expert tensors (experts; their router is 2-D and counts as dense)."""
    from megagrpo.multimodal.models import auto_model_class_of, in_vision_tower

    config = model_config(model_path)
    with torch.device("meta"):
        model = auto_model_class_of(config).from_config(config)
    counts = {"total": 0, "sharded": 0, "vision_tower": 0, "experts": 0}
    for name, param in model.named_parameters():
        counts["total"] += param.numel()
        if ".layers." in name and param.dim() == 2:
            counts["sharded"] += param.numel()
        if is_expert_parameter(name, param):
            counts["experts"] += param.numel()
        if in_vision_tower(name):
            counts["vision_tower"] += param.numel()
    return counts


def is_expert_parameter(name: str, param) -> bool:
    """A mixture of experts' expert tensor: transformers keeps each MoE layer's experts as 3-D
    parameters [E, ...] (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]), which AutoEP
    splits over the ep ranks."""
    return ".experts." in name and param.dim() == 3


def moe_shape(config) -> Optional[tuple[int, int, int, int]]:
    """(experts per layer, top-k, each expert's intermediate size, MoE layers) of a mixture of
    experts' (text) config, None for a dense model. Qwen3-MoE: every decoder_sparse_step-th
    layer not in mlp_only_layers; Mixtral: every layer."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    top_k = getattr(config, "num_experts_per_tok", None) or 0
    if not experts or not top_k:
        return None
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    step, dense = getattr(config, "decoder_sparse_step", 1) or 1, set(getattr(config, "mlp_only_layers", None) or ())
    layers = sum(1 for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return int(experts), int(top_k), int(width), layers


def count_parameters(model_path: str) -> tuple[int, int]:
    """(all parameters, those AutoTP splits): parameter_counts' first two."""
    counts = parameter_counts(model_path)
    return counts["total"], counts["sharded"]


def planned_host_peak_gib(cfg: Config, world_size: int) -> Optional[float]:
    """The plan's peak per rank in GiB where it is host memory (no CUDA), for the memory watch
    (monitoring.MemoryWatch); None on GPUs or where the planner cannot read the config."""
    if torch.cuda.is_available():
        return None
    try:
        return peak_total(make_plan(cfg, world_size).peak) / 2**30
    except (ConfigError, OSError, ValueError, KeyError):
        return None


def make_plan(cfg: Config, world_size: int) -> Plan:
    """world_size: the launch's (with placement disaggregated, its generating ranks included)."""
    tp, pp = cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size
    sp, r = cfg.parallel.sequence_parallel_size, cfg.rollout
    generating = r.ranks if r.placement == "disaggregated" else 0
    trainers = world_size - generating
    dp = trainers // (tp * pp * sp)
    parts = dp * sp  # ZeRO partitions
    stage = zero_stage(cfg.deepspeed)
    counts = parameter_counts(cfg.model.name_or_path)
    total, sharded, experts = counts["total"], counts["sharded"], counts["experts"]
    local = sharded // tp + (total - sharded)  # one rank's share before ZeRO
    if pp > 1:  # the largest stage (DeepSpeed's partition by parameters)
        from megagrpo.policy.pipeline_module import ModelParts
        local = max(ModelParts(cfg.model.name_or_path, torch.float32, "sdpa").stage_parameters(pp, tp))
    # a mixture of experts (tp and pp 1): this rank's E/ep experts per layer, apart from the rest
    ep = cfg.parallel.expert_parallel_size if experts else 1
    expert_parts = dp // ep if ep > 1 else parts  # the ranks holding the same experts
    rank_experts = experts // ep
    lora = cfg.model.lora.r > 0
    dense = local - experts
    if lora:  # the adapters train; the base, experts included, is frozen
        trained_dense, trained_experts = count_trained_parameters(cfg.model.name_or_path, cfg.model.lora), 0
        held_dense = dense + trained_dense  # the frozen base and its adapters
    else:
        trained_dense = dense - (counts["vision_tower"] if cfg.model.freeze_vision_tower else 0)
        trained_experts, held_dense = rank_experts, dense
    trained = trained_dense + trained_experts

    def split(dense_n: int, experts_n: int, b: int, partitioned: bool, over: int = expert_parts) -> tuple[int, int]:
        """(all, experts') bytes per rank: ZeRO partitions the rest over dp x sp and the
        experts over `over` ranks (by default those that hold the same ones)."""
        expert_bytes = experts_n * b // (over if partitioned else 1)
        return dense_n * b // (parts if partitioned else 1) + expert_bytes, expert_bytes

    weight_b, grad_b, optim_b = BYTES[cfg.model.dtype]
    generator_tp = generator_layout(cfg).generator_tp
    reference = cfg.grpo.kl_coef > 0 and not lora
    teacher_local = 0
    if cfg.teacher.model:  # one rank's share before ZeRO, as the policy's
        teacher_counts = parameter_counts(cfg.teacher.model)
        teacher_local = teacher_counts["sharded"] // tp + (teacher_counts["total"] - teacher_counts["sharded"])
    shares = {
        "params": split(held_dense, rank_experts, weight_b, stage >= 3),
        "grads": split(trained_dense, trained_experts, grad_b, stage >= 2),
        "optimizer": split(trained_dense, trained_experts, optim_b, stage >= 1),
        # under ZeRO-3 an engine laid out like the policy (AutoEP included); else a plain module, whole
        "reference": ((split(dense, rank_experts, weight_b, True) if stage >= 3
                       else split(dense, experts, weight_b, False)) if reference else (0, 0)),
        # a distillation teacher (teacher.model), laid out as the reference is
        "teacher": split(teacher_local, 0, weight_b, stage >= 3) if cfg.teacher.model else (0, 0),
        # vLLM's share: its tp group splits every layer (every expert), the embedding and the head by vocabulary
        "rollout_weights": (0, 0) if r.servers or generating else (-(-total * weight_b // generator_tp),
                                                                    experts * weight_b // generator_tp),
    }
    bytes_per_rank = {key: value[0] for key, value in shares.items()}
    zero = read_deepspeed_config(cfg.deepspeed).get("zero_optimization", {})
    offloaded = {key: setting for key, setting, held_on_host in (
        ("optimizer", "offload_optimizer", stage >= 1 and _offloads(zero.get("offload_optimizer"))),
        ("params", "offload_param", stage >= 3 and _offloads(zero.get("offload_param"))),
        ("reference", "model.ref_offload", stage >= 3 and cfg.model.ref_offload and bytes_per_rank["reference"]),
        ("teacher", "teacher.offload", stage >= 3 and cfg.teacher.offload and bytes_per_rank["teacher"]))
        if held_on_host}
    layout = Topology(trainers, 0, 0, tp, pp, sp)
    ranks = [(rank, place.dp_rank, place.tp_rank, place.pp_rank, place.sp_rank) for rank in range(trainers)
             for place in [layout.at(rank)]]
    shape = moe_shape(model_config(cfg.model.name_or_path).get_text_config()) if experts else None
    plan = Plan(world_size, dp, tp, pp, stage, total, sharded, trained, bytes_per_rank, ranks, lora=lora,
                generator_tp=generator_tp, servers=list(r.servers),
                max_staleness=r.max_staleness, generating_ranks=generating, sp=sp, ep=ep,
                params_experts=experts, experts=(shape[0], shape[1], shape[3]) if shape else (),
                expert_bytes={key: value[1] for key, value in shares.items()},
                params_held=held_dense + rank_experts,
                trained_partition=(trained_dense // parts + trained_experts // expert_parts) if stage >= 1
                else trained, offloaded=offloaded)
    plan.peak = peak_memory(cfg, plan, trained)
    if generating:  # a server's weights and KV cache, split over its ranks
        shard = -(-total * weight_b // generator_tp)
        plan.generating_peak = RUNTIME_BYTES[_device()] + engine_bytes(cfg, shard)
    return plan


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _offloads(section) -> bool:
    """Whether a ZeRO offload section moves its tensors off the accelerator (device cpu or nvme)."""
    return bool(section) and str(section.get("device", "none")).lower() not in ("none", "")


def engine_bytes(cfg: Config, weights: int) -> int:
    """What a vLLM engine holding `weights` bytes of the model takes on a rank: its copies of
    them and its KV cache on CPU; its share of the device on GPU."""
    r = cfg.rollout
    if _device() == "cpu":
        return weights * VLLM_CPU_WEIGHT_COPIES[cfg.model.dtype] + int(r.cpu_kv_cache_gb * 2**30)
    return int(r.gpu_memory_utilization * torch.cuda.get_device_properties(0).total_memory)


# ---- the peak: everything a rank holds at once --------------------------------------------

RUNTIME_BYTES = {"cpu": int(1.0 * 2**30), "cuda": int(0.5 * 2**30)}
"""Python, torch, DeepSpeed and vLLM in one rank process before any model: measured 1.0 GiB of
RSS on CPU (a run of the 0.5M-parameter test model, vLLM included); the CUDA context on GPU."""


VLLM_CPU_WEIGHT_COPIES = {"float32": 3, "bfloat16": 2}
"""What vLLM's CPU engine holds per byte of the model's weights, measured (RSS after building the
engine, less the 0.5M-parameter model's): 3.0 in float32, 2.05 in bfloat16, on a 196M-parameter
Qwen2.5-0.5B-shaped model (4 layers)."""


def activation_bytes_per_token(config, layers: int, dtype: str, checkpointing: bool, tiled_mlp: bool = False) -> int:
    """Bytes the backward keeps per token of a micro-batch through `layers` decoder layers.
    Counted with saved-tensor hooks on Qwen2.5-0.5B's shape (bench/memory_model.py): one layer
    keeps (14 h + 6 i) values per token (h hidden, i intermediate size) in the model's dtype,
    plus the float32 inputs of its two RMSNorms in bfloat16; within 4% in float32 and bfloat16.
    With activation checkpointing each layer keeps its input (h values) and one layer at a time
    is recomputed in full. With a tiled MLP (model.tiled_mlp) a layer keeps 2 i of the 6 i:
    measured on the same shape, bf16, 2 layers, 4096 -> 8192 tokens, +0.40 GiB against +0.72
    without tiling (bench/long_context.py; 2 i plans +0.37).

    A mixture-of-experts layer (moe_shape: E experts, top k, expert width m) keeps, in place of
    the dense MLP's 6 i, k x (2 h + 6 m) values (each routed copy of the token: its hidden state
    gathered for its expert and the expert's output, and the expert's intermediates counted as
    the dense MLP's are) plus 4 E + 64 k bytes (the router's float32 probabilities, the top-k
    indices and weights). Saved-tensor hooks on the MoE block alone (Qwen3-MoE, h 512-1024,
    m 256-512, E 16-32, k 4-8, bf16 and float32; Mixtral's keeps a little less) measure k (2 h + 4 m) values +
    4 E + 40 k bytes through transformers' grouped_mm experts, against 4 i for a dense MLP under
    the same hooks (which this count plans at 6 i); 6 m keeps the dense count's margin. Under
    DeepSpeed's AutoEP (ep 2 on 2 ranks, three tiny Qwen3-MoE shapes, the same tokens on both)
    the whole model kept 1.5-6.7% more than through transformers' experts: what a rank's
    experts drew beyond an even share of the tokens."""
    h, i = config.hidden_size, config.intermediate_size
    b = 4 if dtype == "float32" else 2
    norms = 4 * h if dtype != "float32" else 0
    layer = b * (14 * h + (2 if tiled_mlp else 6) * i) + norms
    shape = moe_shape(config)
    if shape is None:
        kept = [layer] * layers
    else:  # a stage's share of the model's MoE layers (the rest dense)
        experts, k, m, moe_layers = shape
        moe_layer = b * (14 * h + k * (2 * h + 6 * m)) + norms + 4 * experts + 64 * k
        sparse = min(layers, -(-moe_layers * layers // config.num_hidden_layers))
        kept = [moe_layer] * sparse + [layer] * (layers - sparse)
    if checkpointing:
        return layers * b * h + max(kept, default=0)
    return sum(kept)


def microbatch_tokens(cfg: Config) -> int:
    """The most tokens one micro-batch (a packed row under sp) holds: fixed size x the longest
    sequence, or the token budget (a longer sequence gets a micro-batch alone)."""
    g, longest = cfg.grpo, max_sequence_length(cfg)  # prompt + completion (every turn and tool message)
    tokens = g.per_device_train_batch_size * longest
    if g.max_tokens_per_microbatch:
        tokens = max(longest, min(g.max_tokens_per_microbatch, tokens * g.gradient_accumulation_steps))
    return tokens


PASS_PARTS = ("activations", "logprob_head", "sequence_parallel", "expert_parallel",
              "gradient_reduction")  # freed before the step
STEP_PARTS = ("optimizer_step",)  # allocated after the forward and backward's are freed
SYNC_PARTS = ("expert_gather",)  # the weight sync's, after the step


def peak_total(peak: dict) -> int:
    """The bytes of a rank's peak: what it holds throughout, plus the largest of the pass's
    transients, the optimizer step's and the weight sync's (one phase at a time:
    bench/long_context.py measures each phase's peak apart)."""
    held = sum(v for k, v in peak.items() if k not in PASS_PARTS + STEP_PARTS + SYNC_PARTS)
    return held + max(sum(peak.get(k, 0) for k in parts) for parts in (PASS_PARTS, STEP_PARTS, SYNC_PARTS))


def peak_memory(cfg: Config, plan: Plan, trained_params: int, tokens: Optional[int] = None) -> dict:
    """The bytes one rank holds at its peak (the sampling rank of a stage-0 shard: the largest),
    by what holds them (their total: peak_total). The pass's transients are its largest
    micro-batch's activations (tokens, by default microbatch_tokens; each sp rank holds 1/sp of
    them) and the fused log-prob head's working set; the optimizer step's come after them. vLLM
    on CPU does not sleep, so its engine is held throughout there."""
    config = model_config(cfg.model.name_or_path).get_text_config()  # a VLM's language model
    device = _device()
    g, r = cfg.grpo, cfg.rollout
    weight_b = 4 if cfg.model.dtype == "float32" else 2
    tokens = -(-(tokens or microbatch_tokens(cfg)) // plan.sp)  # this rank's slice of the row
    layers = -(-config.num_hidden_layers // plan.pp)  # a stage's share
    vocab, hidden = config.vocab_size, config.hidden_size
    # the head reads only the positions that predict completion tokens: its sequences' completions
    longest = max_sequence_length(cfg)
    chunk = min(g.logprob_chunk_size, tokens, -(-tokens // longest) * (longest - cfg.data.max_prompt_length))
    head = chunk * vocab * 4 * 3  # a chunk's logits, probabilities and their gradient (float32)
    if device == "cpu" and weight_b == 2:
        head += 2 * vocab * hidden * 4  # the float32 copy of the head and its gradient
    # on GPUs, what ZeRO offloads lives in host memory (the optimizer's step runs there, DeepSpeed's
    # CPU Adam); on CPU host memory is the device's. The gradients are counted on the GPU either way.
    on_host = set(plan.offloaded) if device == "cuda" else set()
    state = sum(plan.bytes_per_rank[k] for k in ("params", "grads", "optimizer") if k not in on_host)
    zero = read_deepspeed_config(cfg.deepspeed).get("zero_optimization", {})
    peak = {
        "runtime": RUNTIME_BYTES[device],
        "trainer_state": state,
        "gradient_buckets": _bucket_bytes(zero, trained_params, weight_b),
        "gradient_reduction": _reduction_bytes(zero, plan, trained_params, weight_b),
        "optimizer_step": 0 if "optimizer" in on_host else _step_bytes(plan, cfg.model.dtype),
        "reference": 0 if "reference" in on_host else plan.bytes_per_rank["reference"],
        "teacher": 0 if "teacher" in on_host else plan.bytes_per_rank["teacher"],
        "gathered_params": _gathered_bytes(zero, plan, weight_b),
        "rollout": engine_bytes(cfg, plan.bytes_per_rank["rollout_weights"]),
        "activations": tokens * activation_bytes_per_token(config, layers, cfg.model.dtype,
                                                           cfg.model.gradient_checkpointing, cfg.model.tiled_mlp),
        "logprob_head": head,
        "sequence_parallel": _all_to_all_bytes(config, tokens, weight_b) if plan.sp > 1 else 0,
    }
    if plan.ep > 1:  # AutoEP's exchanges of one MoE layer, and the weight sync's gather of its experts
        peak["expert_parallel"] = _expert_all_to_all_bytes(config, tokens, weight_b)
        peak["expert_gather"] = _expert_gather_bytes(plan, weight_b)
    if device == "cuda" and r.sleep:  # vLLM's weights and KV cache leave the GPU while it trains
        peak["rollout"] = max(0, peak["rollout"] - peak["activations"] - head)
    if r.servers or plan.generating_ranks:  # generation runs in the servers' memory, not the trainers'
        peak["rollout"] = 0
    return peak


def _gathered_bytes(zero: dict, plan: Plan, weight_b: int) -> int:
    """ZeRO-3 gathers whole parameters to use them: the weight sync's stream, and the forward and
    backward, which keep up to stage3_max_live_parameters (default 1e9) of them gathered while
    they will be used again soon. Measured: a 2-layer model of Qwen2.5-0.5B's shape (151,936-token
    vocabulary, 166M parameters, float32, 2 ranks) held 0.62 GiB, its whole model, more than the
    plan without this term (tests/test_train_real_vocab.py holds the plan to that run)."""
    if plan.zero_stage < 3:
        return 0  # the parameters are whole already (trainer_state)
    whole = plan.params_held * weight_b  # this rank's share, ungathered (under AutoEP: its experts only)
    return min(whole, int(float(zero.get("stage3_max_live_parameters", 1e9))) * weight_b)


def _expert_all_to_all_bytes(config, tokens: int, weight_b: int) -> int:
    """AutoEP's exchange in one MoE layer (DeepSpeed's all_to_all_single, no persistent buffers:
    deepspeed/module_inject/auto_ep_layer.py): each of the rank's tokens goes to its top-k
    experts' ranks and comes back, tokens x k x h values sent and received for the dispatch and
    again for the combine, in the model's dtype (the backward exchanges gradients of the same
    size). Planned for an even load: a rank whose experts draw more tokens receives more."""
    k = moe_shape(config)[1]
    return 4 * tokens * k * config.hidden_size * weight_b


def _expert_gather_bytes(plan: Plan, weight_b: int) -> int:
    """The weight sync under AutoEP gathers each MoE layer's experts whole, from the ep ranks, to
    send them under their checkpoint names (policy/expert_parallel.py): the gathered pieces and
    their concatenation of the layer's largest tensor (gate_up_proj, 2/3 of its experts), held
    while the next is gathered: about 4/3 of one layer's experts."""
    per_layer = plan.params_experts // max(1, plan.experts[2])
    return 4 * per_layer * weight_b // 3


STEP_BYTES_PER_PARAMETER = {"float32": 14, "bfloat16": 19}
"""What a ZeRO 1-3 rank's optimizer step holds beyond the counted state, per trained parameter
of its partition: DeepSpeed flattens the gradient partition (and in bf16 casts it to float32
for the master weights), torch's AdamW and the gradient norm make float32 temporaries, and the
updated partition is copied back. Measured per phase (bench/long_context.py: the step's peak
above the plan's other parts), Qwen2.5-0.5B's shape: bf16, 24 layers on 2 ranks 18.1, 2 layers
on 1 rank 13.8-18.0; float32, 2 layers on 2 ranks 12.2-13.5 (docs/parallelism.md)."""


def _step_bytes(plan: Plan, dtype: str) -> int:
    """Over the trained parameters of this rank's ZeRO partition (plan.trained_partition: an
    MoE's experts partitioned over their own group)."""
    return plan.trained_partition * STEP_BYTES_PER_PARAMETER[dtype] if plan.zero_stage else 0


def _all_to_all_bytes(config, tokens: int, weight_b: int) -> int:
    """Ulysses' exchange of one layer: q, k and v of this rank's tokens sent and received (the
    whole sequence's for heads/sp), twice over for the contiguous copies around each all-to-all."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", config.num_attention_heads)
    return 4 * tokens * (config.num_attention_heads + 2 * kv) * head_dim * weight_b


REDUCTION_BUCKETS = 1.5
"""What the backward's gradient reduction holds beyond the bucket, in buckets, over 2 or more
ZeRO partitions: DeepSpeed's coalesced reduce-scatter flattens the bucket's gradients into a
copy and gloo copies it again (2 buckets, measured alone); part of it overlaps the pass's other
transients. With 1.5 the rows of bench/long_context.py peak at 0.85-0.98 of the plan (dp 2 in
bf16 and float32, sp 2 and 4), one (sp 4, 1024 tokens) at 1.06; one rank holds none."""


def _reduction_bytes(zero: dict, plan: Plan, trained_params: int, weight_b: int) -> int:
    return int(REDUCTION_BUCKETS * _bucket_bytes(zero, trained_params, weight_b)) if plan.zero_partitions > 1 else 0


def _bucket_bytes(zero: dict, trained_params: int, weight_b: int) -> int:
    """DeepSpeed's gradient reduction bucket (ZeRO 1-3, contiguous gradients): reduce_bucket_size
    elements (default 5e8) of the gradient dtype, filled as far as the model's gradients go."""
    if zero.get("stage", 0) == 0 or not zero.get("contiguous_gradients", True):
        return 0
    return min(int(float(zero.get("reduce_bucket_size", 5e8))), trained_params) * weight_b


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _experts_line(plan: Plan) -> str:
    experts, top_k, layers = plan.experts or (0, 0, 0)
    per_rank = f"{experts // plan.ep} per rank (ep {plan.ep})" if plan.ep > 1 else "all on every rank (ep 1)"
    return (f"experts: {plan.params_experts / 1e6:.2f}M parameters in {layers} MoE layers of {experts} experts "
            f"(top {top_k}), {per_rank}; dense (attention, routers, embeddings, norms): "
            f"{(plan.params_total - plan.params_experts) / 1e6:.2f}M")


def format_plan(plan: Plan, max_rows: int = 16) -> str:
    trainers = plan.world_size - plan.generating_ranks
    generation = (f"generation on {len(plan.servers)} vLLM server(s) apart from the job, max staleness "
                  f"{plan.max_staleness}" if plan.servers else f"vLLM tp {plan.generator_tp}")
    if plan.generating_ranks:
        servers = plan.generating_ranks // plan.generator_tp
        generation = (f"generation on ranks {trainers}-{plan.world_size - 1}: {servers} vLLM server(s) of tp "
                      f"{plan.generator_tp}, max staleness {plan.max_staleness}")
    dims = (f"dp {plan.dp}" + (f" (ep {plan.ep}: each layer's experts split over {plan.ep} of them)"
                               if plan.ep > 1 else "")
            + (f" x sp {plan.sp}" if plan.sp > 1 else "") + f" x tp {plan.tp} x pp {plan.pp}")
    world = f"world {plan.world_size} = " + (f"{trainers} training ({dims}) + {plan.generating_ranks} generating"
                                             if plan.generating_ranks else dims)
    lines = [f"{world}, {generation}; ZeRO stage {plan.zero_stage}",
             *([f"servers: {', '.join(plan.servers)} (their memory is theirs: size them with vLLM's own "
                "settings)"] if plan.servers else []),
             f"model: {plan.params_total / 1e6:.2f}M parameters, {plan.params_sharded / 1e6:.2f}M "
             f"split by tensor parallelism"
             + (f"; LoRA adapters: {plan.params_trained / 1e6:.2f}M trained parameters (the base frozen)"
                if plan.lora else ""),
             *([_experts_line(plan)] if plan.params_experts else []),
             "", f"{'rank':>5} {'dp rank':>8} {'tp shard':>9} {'pp stage':>9}"
             + (f" {'sequence slice':>15}" if plan.sp > 1 else "")]
    for rank, dp_rank, tp_rank, stage, sp_rank in plan.ranks[:max_rows]:
        lines.append(f"{rank:>5} {dp_rank:>8} {f'{tp_rank + 1}/{plan.tp}':>9} {stage:>9}"
                     + (f" {f'{sp_rank + 1}/{plan.sp}':>15}" if plan.sp > 1 else ""))
    if len(plan.ranks) > max_rows:
        lines.append(f"  ... {len(plan.ranks) - max_rows} more ranks, same pattern")
    lines += ["", "model state per rank:"]
    for key, value in plan.bytes_per_rank.items():
        notes = []
        if plan.params_experts and value:
            experts = plan.expert_bytes.get(key, 0)
            notes.append(f"experts {_gib(experts)}, dense {_gib(value - experts)}")
        if key in plan.offloaded:
            notes.append(f"in host memory on GPUs: {plan.offloaded[key]}")
        lines.append(f"  {key:<16}{_gib(value):>14}" + (f"  ({'; '.join(notes)})" if notes else ""))
    training = sum(plan.bytes_per_rank[k] for k in ("params", "grads", "optimizer"))
    lines.append(f"  {'trainer total':<16}{_gib(training):>14}  (params + grads + optimizer)")
    if plan.peak:
        lines += ["", "peak memory per rank (the sampling rank, during the training step):"]
        for key, value in plan.peak.items():
            phase = (" (the pass)" if key in PASS_PARTS else " (the optimizer step)" if key in STEP_PARTS
                     else " (the weight sync)" if key in SYNC_PARTS else "")
            lines.append(f"  {key:<18}{_gib(value):>12}{phase}")
        phases = ("the largest of the pass's, the optimizer step's and the weight sync's"
                  if any(k in plan.peak for k in SYNC_PARTS) else "the larger of the pass's and the optimizer step's")
        lines.append(f"  {'total':<18}{_gib(peak_total(plan.peak)):>12}  (held throughout, plus {phases})")
    if plan.generating_ranks:
        lines.append(f"peak memory per generating rank (its server's weights and KV cache): "
                     f"{_gib(plan.generating_peak)}")
    return "\n".join(lines)
