"""What the trainer asks of the policy, whatever the parallel layout.

    policy = build_policy(cfg, topology, total_steps)      # megagrpo.policy
    micro_batches = policy.micro_batches(batch)            # rows per micro-batch, same count on every rank
    batch.ref_logp = policy.logprobs(batch, micro_batches, reference=True)
    batch.teacher_logp = policy.logprobs(batch, micro_batches, teacher=True)   # teacher.model (distillation)
    metrics = policy.optimize(batch, micro_batches)        # num_iterations passes, one step each
    for name, tensor in policy.full_tensors(): ...         # whole HF tensors (weight sync, export)
    policy.layout(), policy.adapter_config                 # what checkpoints record and save

Two implementations: ZeroPolicy (zero.py: ZeRO 0-3, AutoTP) and PipelinePolicy (pipeline.py:
DeepSpeed PipelineModule). What they share lives here: micro-batching, the loss normalisers,
the step's statistics, the moving reference, and what checkpoints and exports ask.
"""
from __future__ import annotations

import functools
import os
from typing import Iterator, Optional

import torch

from megagrpo.algorithm.loss import StepStats, declare_stats
from megagrpo.cluster.distributed import all_reduce
from megagrpo.cluster.topology import Topology
from megagrpo.config.schema import Config, has_teacher
from megagrpo.policy import lora
from megagrpo.policy.batch import RolloutBatch
from megagrpo.policy.models import DeepSpeedSettings
from megagrpo.policy.packing import balanced_microbatches


class Policy:
    """The policy model under its DeepSpeed engine (`self.engine`) and its frozen reference.
    For a LoRA policy (model.lora) only the adapters train (policy/lora.py)."""

    engine = None
    reference = None
    teacher = None  # teacher.model's frozen model (policy/teacher.py)

    def __init__(self, cfg: Config, topology: Topology):
        self.cfg, self.g, self.topo = cfg, cfg.grpo, topology
        self.deepspeed = DeepSpeedSettings.from_config(cfg)
        self.is_lora = cfg.model.lora.r > 0
        model = cfg.model.name_or_path
        self.base_model = os.path.abspath(model) if os.path.isdir(model) else model  # as checkpoints record it
        # PEFT's adapter_config.json for a LoRA policy (its checkpoints and exports), else None
        self.adapter_config = lora.adapter_config(cfg.model.lora, self.base_model) if self.is_lora else None
        self.distillation = cfg.teacher if has_teacher(cfg) else None  # the loss's teacher settings

    # ---- per layout ---------------------------------------------------------------------------

    def logprobs(self, batch: RolloutBatch, micro_batches: list[list[int]],
                 reference: bool = False, teacher: bool = False) -> Optional[torch.Tensor]:
        """(B, C) log-probs of the completion tokens under the policy (or the reference, or
        teacher.model's teacher at temperature 1), no gradient, over the update's micro-batches.
        Returns None for a reference that does not exist (kl_coef 0)."""
        raise NotImplementedError

    def optimize(self, batch: RolloutBatch, micro_batches: list[list[int]]) -> dict:
        """num_iterations passes over the batch, one optimizer step each; returns the step's
        statistics (loss, entropy, KL, clip ratios, importance weights, grad norm, lr)."""
        raise NotImplementedError

    def full_tensors(self, changed_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, whole tensor) for every weight, on the ranks where `holds_full_tensors`
        (elsewhere nothing); collective: every rank iterates to the end. changed_only: only
        the weights a step can change (a LoRA policy's adapted layers, merged), for a
        receiver that holds the rest already."""
        raise NotImplementedError

    @property
    def holds_full_tensors(self) -> bool:
        """Whether full_tensors() yields the weights on this rank."""
        raise NotImplementedError

    # ---- what checkpoints and exports ask -----------------------------------------------------

    @functools.cached_property
    def trains_all_weights(self) -> bool:
        """False for a LoRA policy (a step changes only its adapted layers) and for a VLM with a
        frozen vision tower: a receiver that already holds the rest can take
        full_tensors(changed_only=True). (Which weights train is fixed when the model loads.)"""
        return not self.is_lora and all(p.requires_grad for p in self.hf_module.parameters())

    def layout(self) -> dict:
        """The run's layout as a checkpoint records it (TrainerState.layout); a checkpoint
        resumes only onto a layout that these allow (checkpoints/checkpoint.py)."""
        return {"tp": self.topo.tp_size, "pp": self.topo.pp_size, "sp": self.topo.sp_size,
                "ep": self.cfg.parallel.expert_parallel_size,
                "zero_stage": self.deepspeed.zero_stage,
                "dtype": self.cfg.model.dtype, "lora": lora.checkpoint_entry(self.cfg.model.lora)}

    @property
    def hf_module(self) -> torch.nn.Module:
        """The trained module, whose `config` (and generation_config) an HF export writes."""
        return self.engine.module

    def adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """A LoRA policy's adapter weights under PEFT's names; collective under ZeRO-3."""
        return lora.adapter_tensors(self.engine.module)

    # ---- shared -------------------------------------------------------------------------------

    def _reference_parts(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(key, policy parameter, reference tensor) for this rank's parts of the reference: a
        ZeRO-3 parameter's partition (ds_tensor) and, for one small enough to stay gathered
        (ds_persist: forward reads that copy, once gathered), its whole tensor too; else the parameter. The
        reference is built with the policy's layout, so the partitions correspond."""
        reference = getattr(self.reference, "module", self.reference)
        policy = dict(self.engine.module.named_parameters())
        for name, ref_param in reference.named_parameters():
            if not hasattr(ref_param, "ds_tensor"):
                yield name, policy[name], ref_param.data
                continue
            yield name, policy[name], ref_param.ds_tensor
            if getattr(ref_param, "ds_persist", False) and ref_param.data.numel():  # gathered at its first use
                yield name + ".whole", policy[name], ref_param.data

    @torch.no_grad()
    def mix_reference(self, alpha: float) -> None:
        """The moving reference (TR-DPO; TRL's sync_ref_model): reference = alpha x policy +
        (1 - alpha) x reference, each rank on its own partitions; only the few parameters
        ZeRO-3 keeps whole (below its persistence threshold) are gathered from the policy."""
        import deepspeed

        for key, param, theirs in self._reference_parts():
            if key.endswith(".whole"):
                with deepspeed.zero.GatheredParameters([param]):
                    mine = param.data.clone()
            else:
                mine = param.ds_tensor if hasattr(param, "ds_tensor") else param.data
            if mine.shape != theirs.shape:
                raise RuntimeError(f"reference weight {key} is laid out unlike the policy's: "
                                   f"{tuple(theirs.shape)} vs {tuple(mine.shape)}")
            theirs.mul_(1 - alpha).add_(mine.to(theirs.device, theirs.dtype), alpha=alpha)

    def reference_state(self) -> dict:
        """This rank's parts of the reference's weights, for a checkpoint."""
        return {key: theirs.detach().cpu().clone() for key, _, theirs in self._reference_parts()}

    @torch.no_grad()
    def load_reference_state(self, state: dict) -> None:
        """Restore reference_state(); a whole copy not yet gathered here is built from the
        restored partitions at its first use."""
        for key, _, theirs in self._reference_parts():
            theirs.copy_(state[key])

    def micro_batches(self, batch: RolloutBatch) -> list[list[int]]:
        """Row indices per micro-batch: within the token budget and balanced, or fixed-size.
        Every rank gets the same number of micro-batches."""
        g = self.g
        if not g.max_tokens_per_microbatch:
            size = g.per_device_train_batch_size
            return [list(range(s, min(s + size, len(batch)))) for s in range(0, len(batch), size)]
        lengths = batch.token_counts()
        local = balanced_microbatches(lengths, g.max_tokens_per_microbatch)
        count = int(all_reduce(torch.tensor([len(local)]), "max")[0])
        return balanced_microbatches(lengths, g.max_tokens_per_microbatch, min_count=count)

    def loss_normalisers(self, batch: RolloutBatch) -> dict:
        """What the chosen aggregation divides by, for the whole step (see grpo.aggregate)."""
        tokens = float(batch.completion_mask.sum())
        if self.g.loss_type in ("dapo", "cispo"):  # global token mean; DeepSpeed averages over dp ranks
            summed = all_reduce(torch.tensor([tokens], dtype=torch.float64), group=self.topo.dp_group)
            tokens = float(summed[0]) / self.topo.dp_size
        return {"num_sequences": len(batch), "num_tokens": tokens,
                # the most sampled tokens a completion can hold: max_new_tokens per model turn
                "max_sampled_tokens": self.cfg.rollout.max_new_tokens * self.cfg.rollout.max_turns}

    def new_stats(self) -> StepStats:
        stats = StepStats()
        declare_stats(stats, self.g, self.distillation)
        return stats

    def step_metrics(self, stats: StepStats, loss_group, grad_norm: Optional[float]) -> dict:
        """The statistics reduced over the ranks. DeepSpeed averages gradients over dp ranks:
        the step's loss is the mean of the ranks' sums over `loss_group` (the ranks that hold
        a copy of the loss), per pass."""
        out = stats.reduce(all_reduce)
        loss = float(all_reduce(torch.tensor([stats.loss]), group=loss_group)[0])
        out["loss"] = loss / self.topo.dp_size / self.g.num_iterations
        out.pop("sampling/sampling_logp_difference/min", None)
        out["learning_rate"] = self.engine.get_lr()[0]
        out["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        return out
