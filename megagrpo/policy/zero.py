"""The ZeRO policy: the HF model under DeepSpeed ZeRO 0-3, optionally tensor-parallel (AutoTP).

Every rank runs the same micro-batches through `deepspeed.initialize`'s engine: forward (the
fused log-prob head, logprobs.py), the GRPO loss (algorithm/loss.py), backward with gradient
accumulation, one optimizer step per pass. The reference is a ZeRO-3 inference engine (no
optimizer state) when the policy uses ZeRO-3, else a plain eval module; for a LoRA policy
(policy/lora.py) it is the policy itself with its adapters disabled. A distillation teacher
(teacher.model, policy/teacher.py) is built as the reference is.
"""
from __future__ import annotations

from typing import Iterator, Optional

import deepspeed
import torch

from megagrpo.algorithm.loss import LossInputs, micro_batch_loss
from megagrpo.cluster.distributed import all_reduce
from megagrpo.cluster.topology import Topology
from megagrpo.config.schema import Config
from megagrpo.policy import lora
from megagrpo.policy.base import Policy
from megagrpo.policy.batch import RolloutBatch
from megagrpo.policy.expert_parallel import hf_named_tensors
from megagrpo.policy.logprobs import completion_logprobs
from megagrpo.policy.models import initialize, load_model
from megagrpo.policy.moe import attach_routing, checkpoint_names
from megagrpo.policy.sequence_parallel import SequenceParallel, sum_gradients_over_sp
from megagrpo.policy.teacher import teacher_config
from megagrpo.policy.weight_gather import named_full_tensors


class ZeroPolicy(Policy):
    def __init__(self, cfg: Config, topology: Topology, total_steps: int):
        super().__init__(cfg, topology)
        self.sp = SequenceParallel.of(topology)  # sequences split over an sp group, or None
        model = load_model(cfg, self.deepspeed, self.sp)
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        if self.is_lora:
            model = lora.add_adapters(model, cfg.model.lora, self.g.seed)
        if self.sp is not None:
            sum_gradients_over_sp(self.deepspeed.config, model)
        expert_parallel = cfg.parallel.expert_parallel_size > 1  # AutoEP replaces the MoE blocks at initialize
        self.routing = None if expert_parallel else attach_routing(model)  # an MoE model's routers (moe.py)
        self.old_routes: list = []  # per micro-batch, the old-policy pass's routes
        self.engine = initialize(model, cfg, self.deepspeed, total_steps, topology.deepspeed_mpu)
        if expert_parallel:
            self.routing = attach_routing(self.engine.module)
        if self.g.kl_coef > 0 and not self.is_lora:
            self.reference = self._build_frozen(cfg, cfg.model.ref_offload)
        if cfg.teacher.model:  # on-policy distillation: the teacher, built as the reference is (policy/teacher.py)
            self.teacher = self._build_frozen(teacher_config(cfg), cfg.teacher.offload, replays_routes=False)

    def _build_frozen(self, cfg: Config, offload: bool, replays_routes: bool = True):
        """A frozen model (the reference, the teacher) from cfg.model: a ZeRO-3 inference engine
        (partitioned and sharded like the policy, optionally offloaded to CPU) when the policy
        uses ZeRO-3; else a plain eval module. replays_routes: under routing replay R3 it scores
        through the sampler's experts too (the reference; a teacher has experts of its own)."""
        routing = replays_routes and self.cfg.rollout.routing_replay == "r3"
        if self.deepspeed.zero_stage != 3:
            from deepspeed.accelerator import get_accelerator
            model = load_model(cfg, self.deepspeed, self.sp).eval().requires_grad_(False)
            if routing:
                attach_routing(model)
            return model.to(get_accelerator().current_device_name())
        settings = self.deepspeed.for_frozen_model(zero3=True, offload=offload)
        model = load_model(cfg, settings, self.sp).eval()
        # frozen after initialize: AutoTP registers gradient hooks on replicated parameters that
        # see split activations (Qwen3's q/k norms), and a frozen tensor refuses a hook
        expert_parallel = self.cfg.parallel.expert_parallel_size > 1
        if routing and not expert_parallel:
            attach_routing(model)
        engine, _, _, _ = deepspeed.initialize(model=model, config=settings.config, mpu=self.topo.deepspeed_mpu)
        engine.module.requires_grad_(False)
        engine.eval()
        if routing and expert_parallel:
            attach_routing(engine.module)
        return engine

    def _forward(self, model, mb: RolloutBatch, temperature: Optional[float] = None):
        return completion_logprobs(model, mb, temperature or self.cfg.rollout.temperature, self.g.packing,
                                   self.g.fused_logprobs, self.sp)

    def logprobs(self, batch, micro_batches, reference=False, teacher=False) -> Optional[torch.Tensor]:
        if teacher:  # at temperature 1: the teacher's own distribution
            return self._logprobs(self.teacher, batch, micro_batches, temperature=1.0)
        if reference and self.is_lora:  # the base model: the policy with its adapters off
            if self.g.kl_coef == 0:
                return None
            with lora.adapters_disabled(self.engine.module):
                return self._logprobs(self.engine, batch, micro_batches)
        model = self.reference if reference else self.engine
        return None if model is None else self._logprobs(model, batch, micro_batches, record_routes=not reference)

    def _logprobs(self, model, batch, micro_batches, record_routes: bool = False,
                  temperature: Optional[float] = None) -> torch.Tensor:
        """record_routes: keep an MoE policy's routes per micro-batch (the old-policy pass's,
        which the update passes compare with and, under routing replay R2, replay)."""
        out = torch.zeros(batch.completion_ids.shape, device=batch.completion_ids.device)
        model.eval()
        if record_routes:
            self.old_routes = []
        with torch.no_grad():
            for rows in micro_batches:  # an empty micro-batch still runs (ZeRO-3 gathers are collective)
                logp = self._forward(model, batch.select(rows or [0]), temperature)[0]
                if rows:
                    out[torch.tensor(rows)[:, None], torch.arange(logp.shape[1])[None, :]] = logp
                if record_routes and self.routing is not None:
                    self.old_routes.append(self.routing.recorded())
                    if rows:
                        self.routing.count_sampler_flips()
        return out

    def optimize(self, batch, micro_batches) -> dict:
        stats, normalisers = self.new_stats(), self.loss_normalisers(batch)
        self.engine.train()
        grad_norm = None
        if self.routing is not None:  # routing replay R2, load counts, the load-balancing loss
            # the old-policy pass's routes hold the sampler's under R3
            self.routing.begin_step(self.old_routes, self.cfg.rollout.routing_replay in ("r2", "r3"),
                                    self.cfg.model.router_aux_loss_coef)
            self.old_routes = []  # this step's: no later step compares with them
        for passed in range(self.g.num_iterations):
            for i, rows in enumerate(micro_batches):
                self.engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
                # a rank with fewer sequences than micro-batches still runs the forward
                # (ZeRO-3 gathers are collective) and contributes zero
                mb, share = (batch.select(rows), 1.0) if rows else (batch.select([0]), 0.0)
                if self.routing is not None:
                    self.routing.before_update(i)
                logp, entropy = self._forward(self.engine, mb)
                inputs = LossInputs(mb.completion_mask, mb.advantages, mb.sampler_logp, mb.old_logp, mb.ref_logp,
                                    mb.teacher_logp)
                loss = micro_batch_loss(self.g, logp, entropy, inputs, normalisers, share, stats if rows else None,
                                        self.distillation)
                if self.routing is not None and passed == 0 and rows and not self.routing.old:
                    self.routing.count_sampler_flips()  # R3 with no old-policy pass: the first forward at these weights
                if self.routing is not None:
                    loss = loss + self.routing.after_update(i, passed, share / len(micro_batches))
                self.engine.backward(loss, scale_wrt_gas=False)
            grad_norm = self._grad_norm_before_step()
            self.engine.step()
        reported = self.engine.get_global_grad_norm()
        metrics = self.step_metrics(stats, self.topo.dp_group, reported if reported is not None else grad_norm)
        if self.routing is not None:
            metrics.update(self.routing.end_step(lambda t: all_reduce(t, group=self.topo.dp_group)))
        return metrics

    def _grad_norm_before_step(self) -> Optional[float]:
        """DeepSpeed reports the gradient norm under ZeRO and bf16, not for plain fp32 ZeRO-0:
        there it is measured here (gradients are already averaged over dp). Under AutoTP the
        squares are summed over the tp group, so a replicated tensor (embeddings, norms, LM
        head) counts on tp rank 0 only and a split one on every rank, as DeepSpeed's own
        clip_grad_norm_ counts them; counting all on every rank overstated the norm."""
        if self.deepspeed.zero_stage != 0 or self.cfg.model.dtype != "float32":
            return None
        from deepspeed.runtime.utils import get_global_norm_of_tensors, is_model_parallel_parameter
        mpu = self.engine.mpu
        first = mpu is None or mpu.get_model_parallel_rank() == 0
        grads = [p.grad for p in self.engine.module.parameters()
                 if p.grad is not None and (first or is_model_parallel_parameter(p))]
        if not grads and mpu is None:
            return 0.0
        # a rank with nothing to count still joins the tp group's sum
        return float(get_global_norm_of_tensors(grads or [torch.zeros(1)], mpu=mpu))

    holds_full_tensors = True  # ZeRO-3 partitions and AutoTP shards are gathered on every rank

    def full_tensors(self, changed_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        if self.is_lora:
            tensors = lora.merged_full_tensors(self.engine.module, self.cfg.rollout.sync_bucket_mb, changed_only)
        else:
            gather = hf_named_tensors if self.cfg.parallel.expert_parallel_size > 1 else named_full_tensors
            tensors = gather(self.engine.module, self.cfg.rollout.sync_bucket_mb, trained_only=changed_only)
        # an MoE model's experts under their checkpoint names (vLLM's loaders take those)
        return tensors if self.routing is None else checkpoint_names(tensors, self.engine.module)
