"""The pipeline policy: the HF decoder as a DeepSpeed PipelineModule (pipeline_module.py), one
stage per tp group of a pipeline (each stage's decoder layers split over its tp ranks),
data-parallel across pipelines (ZeRO 0 or 1).

DeepSpeed's schedule runs the micro-batches over the stages: `train_batch` does the forwards,
backwards and the optimizer step, `eval_batch` the no-grad passes. The policy's log-probs
exist only at the last stage, so the GRPO loss runs there, as the module's loss_fn
(`_StageLoss`), with everything else it needs carried as each micro-batch's labels.
"""
from __future__ import annotations

from typing import Iterator, Optional

import deepspeed
import torch
import torch.distributed as dist

from megagrpo.algorithm.loss import LossInputs, StepStats, micro_batch_loss
from megagrpo.cluster.topology import Topology
from megagrpo.config.schema import Config, GRPOConfig
from megagrpo.policy.base import Policy
from megagrpo.policy.batch import RolloutBatch
from megagrpo.policy.models import attention_implementation, initialize
from megagrpo.policy.packing import pack
from megagrpo.policy.pipeline_module import build_pipeline_module, gather_to_first_stage


class PipelinePolicy(Policy):
    def __init__(self, cfg: Config, topology: Topology, total_steps: int):
        super().__init__(cfg, topology)
        ds_config = self.deepspeed.config
        ds_config.pop("tensor_parallel", None)  # the stages split their own layers (no AutoTP pass)
        # each tp rank sends its stage's whole activations to the same tp rank of the next stage
        # (DeepSpeed's partitioned send assumes activation sizes fixed across micro-batches)
        ds_config["pipeline"] = {**ds_config.get("pipeline", {}), "pipe_partitioned": False,
                                 "grad_partitioned": False}
        self._loss = _StageLoss(self.g)
        self.engine = initialize(self._build_module(self._loss), cfg, self.deepspeed, total_steps)
        _clip_gradients_over_stages(self.engine, topology)
        self.reference, self._reference_loss = None, _StageLoss(self.g)
        if self.g.kl_coef > 0:  # the same stages, frozen, no optimizer state
            module = self._build_module(self._reference_loss).requires_grad_(False)
            frozen = self.deepspeed.for_frozen_model()
            self.reference, _, _, _ = deepspeed.initialize(model=module, config=frozen.config)

    def _build_module(self, loss_fn):
        return build_pipeline_module(self.cfg, attention_implementation(), self.topo, loss_fn)

    def _items(self, batch: RolloutBatch, micro_batches: list[list[int]]) -> list:
        one_row = attention_implementation().startswith("flash")
        return [_micro_batch_item(batch.select(rows or [0]), 1.0 if rows else 0.0, one_row)
                for rows in micro_batches]

    def logprobs(self, batch, micro_batches, reference=False, teacher=False) -> Optional[torch.Tensor]:
        """Known at the last stage only, which is the only one that needs them (zeros elsewhere).
        (A teacher is refused under pipeline parallelism: policy/teacher.py.)"""
        engine, loss = (self.reference, self._reference_loss) if reference else (self.engine, self._loss)
        if engine is None:
            return None
        out = torch.zeros(batch.completion_ids.shape, device=batch.completion_ids.device)
        items = self._items(batch, micro_batches)
        collected = loss.collect()
        with torch.no_grad():
            engine.eval_batch(iter(items), compute_loss=True, bcast_loss=False, num_micro_batches=len(items))
        if engine.is_last_stage():
            for rows, (_, labels), logp in zip(micro_batches, items, collected):
                if rows:
                    out[torch.tensor(rows)[labels[0]], labels[1]] = logp.to(out.dtype)
        return out

    def optimize(self, batch, micro_batches) -> dict:
        stats = self.new_stats()
        self._loss.start_step(self.loss_normalisers(batch), stats, len(micro_batches))
        self.engine.set_train_batch_size(len(micro_batches) * self.g.per_device_train_batch_size
                                         * self.topo.dp_size)
        try:
            for _ in range(self.g.num_iterations):
                self.engine.train_batch(iter(self._items(batch, micro_batches)))
        finally:
            self._loss.collect()
        # only the last stage holds the loss (each of its tp ranks a copy, counted once): its
        # sum runs over every rank
        if self.topo.tp_rank != 0:
            stats.loss = 0.0
        return self.step_metrics(stats, None, self.engine.get_global_grad_norm())

    @property
    def holds_full_tensors(self) -> bool:
        return self.topo.samples_rollout  # the stages stream their layers to the group's first rank

    def full_tensors(self, changed_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        return gather_to_first_stage(self.engine.module, self.topo)


def _micro_batch_item(mb: RolloutBatch, share: float, one_row: bool = False):
    """(inputs, labels) of one micro-batch for the pipeline engine.

    inputs feed the first stage; labels reach the loss at the last stage: where each predicted
    token goes in the (B, C) layout, everything the GRPO loss needs besides the policy's own
    log-probs, and the micro-batch's share (0 for a rank's padding micro-batch)."""
    prompts, completions = mb.sequences()
    packed = pack(prompts, completions, None if one_row else max(mb.token_counts()))
    inputs = (packed.input_ids, packed.position_ids, packed.predict_at, packed.targets)
    empty = torch.zeros(0)
    labels = (packed.rows, packed.cols, mb.completion_mask, mb.advantages, mb.sampler_logp,
              mb.old_logp if mb.old_logp is not None else empty,
              mb.ref_logp if mb.ref_logp is not None else empty, torch.tensor([share]))
    return inputs, labels


def _scatter_tokens(values: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, like: torch.Tensor):
    """(K,) per-token values into a zero (B, C) tensor shaped like `like`."""
    return torch.zeros(like.shape, dtype=values.dtype, device=values.device).index_put((rows, cols), values)


class _StageLoss:
    """The PipelineModule's loss_fn, run at the last stage, in one of two modes.

    collecting (eval_batch: reference and old-policy log-probs): keeps each micro-batch's (K,)
    log-probs in the list `collect()` returned.
    training (train_batch, after `start_step`): the micro-batch's GRPO loss
    (algorithm/loss.micro_batch_loss), times the number of micro-batches because DeepSpeed
    divides by it while our normalisers already cover the whole step."""

    def __init__(self, g: GRPOConfig):
        self._g = g
        self._collected: Optional[list] = []
        self._normalisers, self._stats, self._micro_batches = None, None, 1

    def collect(self) -> list:
        """Switch to collecting log-probs into a fresh list, and return it."""
        self._collected = []
        return self._collected

    def start_step(self, normalisers: dict, stats: StepStats, micro_batches: int) -> None:
        self._collected = None
        self._normalisers, self._stats, self._micro_batches = normalisers, stats, micro_batches

    def __call__(self, outputs, labels):
        if self._collected is not None:  # DeepSpeed sums what this returns: keep the outputs here
            self._collected.append(outputs[:, 0].detach())
            return outputs.new_zeros(())
        rows, cols, mask, advantages, sampler_logp, old_logp, ref_logp, share = labels
        logp = _scatter_tokens(outputs[:, 0], rows, cols, mask)
        entropy = _scatter_tokens(outputs[:, 1], rows, cols, mask)
        inputs = LossInputs(mask, advantages, sampler_logp, old_logp if old_logp.numel() else None,
                            ref_logp if ref_logp.numel() else None)
        share = float(share[0])
        loss = micro_batch_loss(self._g, logp, entropy, inputs, self._normalisers, share,
                                self._stats if share else None)
        return loss * self._micro_batches


def _clip_gradients_over_stages(engine, topology: Topology) -> None:
    """Gradient clipping of plain fp32 ZeRO-0 training under a pipeline, done right.

    DeepSpeed's clip_fp32_gradients (deepspeed.runtime.utils.clip_grad_norm_, 0.19) counts only
    the first stage's gradients: with the pipeline grid as mpu it sums the parameters of
    model-parallel rank 0 and the tensor-parallel ones of other ranks, so later stages are left
    out of the norm that scales every stage. Here each rank adds its squared norms (a tied copy
    once: DeepSpeed marks the later copies ds_pipe_replicated; a weight replicated over the tp
    ranks once, from tp rank 0), the model group sums them, every rank clips by the same
    factor, and the norm is kept for get_global_grad_norm(). (ZeRO-1 and bf16 compute the norm
    in their optimizers, correctly; docs/upstream-issues.md.)"""

    def counted(p) -> bool:
        split = getattr(p, "tensor_model_parallel", False)
        return not getattr(p, "ds_pipe_replicated", False) and (split or topology.tp_rank == 0)

    def clip():
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        squares = [p.grad.detach().float().pow(2).sum() for p in engine.module.parameters()
                   if p.grad is not None and counted(p)]
        squares = torch.stack(squares).sum() if squares else torch.zeros(())
        if topology.model_group is not None:
            dist.all_reduce(squares, group=topology.model_group)
        norm = float(squares.sqrt())
        scale = engine.gradient_clipping() / (norm + 1e-6)
        if scale < 1.0:
            for g in grads:
                g.mul_(scale)
        engine._global_grad_norm = norm
    engine.clip_fp32_gradients = clip
