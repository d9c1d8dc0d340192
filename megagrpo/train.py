"""The GRPO trainer: `python -m megagrpo.train --config X.yaml key.sub=value ...`.

Runs as one process, under `deepspeed --num_gpus N --module megagrpo.train`, or torchrun.
One step:
    prompts -> rollout (G completions each) -> rewards -> group advantages
    -> reference (and old-policy) logprobs -> mu passes of clipped, KL-penalised updates
    -> weight sync into the rollout engine -> metrics, checkpoint
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

from megagrpo.algorithm import grpo
from megagrpo.checkpoints import checkpoint
from megagrpo.engines import pipeline_module as pipeline
from megagrpo.rollout.batch import RolloutBatch, make_batch
from megagrpo.engines.logprobs import completion_logprobs
from megagrpo.config import Config, ConfigError, load_config
from megagrpo.cluster.distributed import init_distributed
from megagrpo.data import DataError, Prompt, PromptSampler, load_prompts
from megagrpo.algorithm.loss import LossInputs, declare_stats, micro_batch_loss
from megagrpo.metrics import MetricsLogger, StepStats, all_gather_1d, all_reduce, progress_bar
from megagrpo.engines.packing import balanced_microbatches
from megagrpo.engines.models import (attention_implementation, build_policy, build_reference, deepspeed_config,
                    load_tokenizer, zero_stage)
from megagrpo.rewards import (RewardError, build_reward_functions, close_reward_functions,
                      component_metrics, compute_rewards)
from megagrpo.rollout.engines import build_rollout_engine
from megagrpo.cluster.topology import Topology
from megagrpo.rollout.weight_sync import sync_weights


class Trainer:
    def __init__(self, cfg: Config, topology: Topology):
        self.cfg, self.topo = cfg, topology
        g = cfg.grpo
        self.device = torch.device(f"cuda:{topology.local_rank}" if torch.cuda.is_available() else "cpu")
        self.log = lambda msg: print(f"[megagrpo] {msg}", flush=True) if topology.is_main else None
        self.tokenizer = load_tokenizer(cfg.model.name_or_path)
        self.prompts, dropped = load_prompts(cfg.data.train_file, self.tokenizer,
                                             cfg.data.max_prompt_length, cfg.data.prompt_field,
                                             cfg.data.system_prompt, cfg.data.split)
        self.log(f"{len(self.prompts)} training prompts; {dropped} dropped as longer than "
                 f"data.max_prompt_length={cfg.data.max_prompt_length}")
        self.eval_prompts = []
        if cfg.data.eval_file:
            self.eval_prompts, _ = load_prompts(cfg.data.eval_file, self.tokenizer,
                                                cfg.data.max_prompt_length, cfg.data.prompt_field,
                                                cfg.data.system_prompt, cfg.data.eval_split)
        self.reward_functions = build_reward_functions(cfg.rewards.functions, cfg)
        completions_per_rank = g.per_device_train_batch_size * g.gradient_accumulation_steps
        self.sampler = PromptSampler(len(self.prompts), completions_per_rank // g.num_generations,
                                     topology.dp_rank, topology.dp_size, g.seed, cfg.data.shuffle)
        self.total_steps = g.max_steps if g.max_steps > 0 else max(
            1, math.ceil(g.num_train_epochs * self.sampler.steps_per_epoch))
        self.ds_config = deepspeed_config(cfg)
        self.pipeline = topology.pp_size > 1
        self.pipeline_loss = pipeline.PipelineLoss(g) if self.pipeline else None
        self.policy = build_policy(cfg, self.ds_config, self.total_steps, self.pipeline_loss)
        self.reference = (build_reference(cfg, self.ds_config, pipeline.PipelineLoss(g) if self.pipeline else None)
                          if g.kl_coef > 0 else None)
        # one rollout per model group (tp group or pipeline), sampled by its first rank. Every
        # rank builds an engine (vLLM's external launcher forms its groups over all ranks); under
        # pipeline parallelism only the sampling rank's engine receives weights
        self.samples_rollout = topology.rank == topology.model_group_source
        self.rollout = build_rollout_engine(cfg, seed=g.seed + topology.dp_rank)
        # metrics and batch statistics are taken over the dp ranks (model groups hold copies)
        self.dp_group, self.model_group = None, None
        if topology.tp_size > 1:
            from deepspeed.utils import groups
            self.dp_group = groups.get_data_parallel_group()
            self.model_group = groups.get_tensor_model_parallel_group()
        elif self.pipeline:
            self.dp_group = self.policy.grid.get_data_parallel_group()
            self.model_group = self.policy.grid.get_pipe_parallel_group()
        self.metrics = MetricsLogger(cfg.output_dir, topology.is_main and cfg.logging.report_to == "tensorboard")
        self.ckpt_root = os.path.join(cfg.output_dir, "checkpoints")
        os.makedirs(cfg.output_dir, exist_ok=True)
        self.step, self.grad_norm = 0, None
        self.log(topology.describe())

    # ---- the step -------------------------------------------------------------------------

    def train(self) -> dict:
        cfg = self.cfg
        self.maybe_resume()
        self.sync_rollout_weights()
        results = {}
        if self.eval_prompts and self.step == 0:
            results["before"] = self.evaluate()
            self.log(f"held-out before training: {_format_eval(results['before'])}")
        bar = progress_bar(self.total_steps, self.step, self.topo.is_main and cfg.logging.progress_bar)
        while self.step < self.total_steps:
            start = time.perf_counter()
            metrics = self.train_step()
            self.step += 1
            metrics["time/step"] = time.perf_counter() - start
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward']:.3f}", step_s=f"{metrics['time/step']:.1f}")
            if self.step % cfg.logging.logging_steps == 0 or self.step == self.total_steps:
                self.metrics.scalars(self.step, {f"train/{k}": v for k, v in metrics.items()})
            if cfg.logging.eval_steps and self.step % cfg.logging.eval_steps == 0 and self.eval_prompts:
                self.metrics.scalars(self.step, {f"eval/{k}": v for k, v in self.evaluate().items()})
            if cfg.checkpoint.save_steps and self.step % cfg.checkpoint.save_steps == 0:
                self.save()
        bar.close()
        if not cfg.checkpoint.save_steps or self.step % cfg.checkpoint.save_steps != 0:
            self.save()
        if self.eval_prompts:
            results["after"] = self.evaluate()
            self.metrics.scalars(self.step, {f"eval/{k}": v for k, v in results["after"].items()})
            self.log(f"held-out after training: {_format_eval(results['after'])}")
        if cfg.checkpoint.save_hf_at_end:
            out = os.path.join(cfg.output_dir, "hf")
            checkpoint.export_hf(self.policy.module, self.tokenizer, out, self.topo.is_main,
                                 tensors=self._pipeline_tensors() if self.pipeline else None)
            self.log(f"HF model written to {out}")
        if self.topo.is_main and results:
            path = os.path.join(cfg.output_dir, "eval_results.json")
            previous = json.load(open(path)) if os.path.isfile(path) else {}
            with open(path, "w") as f:
                json.dump({**previous, **results}, f, indent=1)
        close_reward_functions(self.reward_functions)
        self.metrics.close()
        self.log(f"done: {self.step} steps. Watch with: tensorboard --logdir {self.metrics.log_dir}")
        return results

    def train_step(self) -> dict:
        cfg, g = self.cfg, self.cfg.grpo
        timings = {}
        clock = time.perf_counter()
        indices = self.sampler.next_indices()
        self._record_prompts(indices)
        prompts = [self.prompts[i] for i in indices]

        # rollout: G completions per prompt, with the sampler's logprobs
        groups = self._generate([p.token_ids for p in prompts], n=g.num_generations,
                                seeds=[self._sampling_seed(i) for i in indices])
        completions = [c for group in groups for c in group]
        prompt_of = [p for p in prompts for _ in range(g.num_generations)]
        timings["rollout"], clock = time.perf_counter() - clock, time.perf_counter()

        # rewards and group advantages (groups never leave their rank; batch std is global)
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        rewards, per_function = self._rewards(prompt_of, texts, [len(c.token_ids) for c in completions])
        global_rewards = all_gather_1d(rewards, self.dp_group)
        advantages = grpo.group_advantages(rewards, g.num_generations, g.scale_rewards,
                                           batch_std=global_rewards.std())
        timings["reward"], clock = time.perf_counter() - clock, time.perf_counter()

        batch = make_batch([p.token_ids for p in prompt_of], completions, advantages,
                           self.tokenizer.pad_token_id).to(self.device)
        if g.mask_truncated_completions:
            batch.completion_mask = batch.completion_mask * (~batch.truncated).unsqueeze(1).float()

        # reference and old-policy logprobs, over the same micro-batches as the update
        micro_batches = self._micro_batches(batch)
        with torch.no_grad():
            if self.reference is not None:
                batch.ref_logp = self._logprobs_without_grad(self.reference, batch, micro_batches)
            if g.num_iterations > 1:
                batch.old_logp = self._logprobs_without_grad(self.policy, batch, micro_batches)
        timings["reference"], clock = time.perf_counter() - clock, time.perf_counter()

        stats = self.optimize(batch, micro_batches)
        timings["train"], clock = time.perf_counter() - clock, time.perf_counter()

        timings["weight_sync"] = self.sync_rollout_weights()
        if self.topo.is_main and cfg.logging.sample_steps and (self.step + 1) % cfg.logging.sample_steps == 0:
            self._log_samples(prompts[0], texts[:g.num_generations], rewards[:g.num_generations])
        return self._step_metrics(global_rewards, per_function, advantages, batch, stats, timings)

    def optimize(self, batch: RolloutBatch, micro_batches: list[list[int]]) -> StepStats:
        """mu passes over the batch in micro-batches; one optimizer step per pass."""
        g = self.cfg.grpo
        stats = StepStats()
        declare_stats(stats, g)
        normalisers = self._loss_normalisers(batch)
        if self.pipeline:
            return self._optimize_pipeline(batch, micro_batches, normalisers, stats)
        self.policy.train()
        for _ in range(g.num_iterations):
            for i, rows in enumerate(micro_batches):
                self.policy.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
                # a rank with fewer sequences than micro-batches still runs the forward
                # (ZeRO-3 gathers are collective) and contributes zero
                mb, share = (batch.select(rows), 1.0) if rows else (batch.select([0]), 0.0)
                logp, entropy = self._logprobs(self.policy, mb)
                inputs = LossInputs(mb.completion_mask, mb.advantages, mb.sampler_logp, mb.old_logp, mb.ref_logp)
                loss = micro_batch_loss(g, logp, entropy, inputs, normalisers, share, stats if rows else None)
                self.policy.backward(loss, scale_wrt_gas=False)
            self.grad_norm = self._grad_norm_before_step()
            self.policy.step()
        return stats

    def _optimize_pipeline(self, batch, micro_batches, normalisers, stats) -> StepStats:
        """The same passes through DeepSpeed's pipeline schedule: train_batch runs the
        micro-batches' forwards and backwards over the stages, then the optimizer step; the
        loss is computed at the last stage (pipeline.PipelineLoss)."""
        g = self.cfg.grpo
        self.pipeline_loss.start_step(normalisers, stats, len(micro_batches))
        self.policy.set_train_batch_size(len(micro_batches) * g.per_device_train_batch_size * self.topo.dp_size)
        try:
            for _ in range(g.num_iterations):
                self.policy.train_batch(iter(self._pipeline_items(batch, micro_batches)))
        finally:
            self.pipeline_loss.mode = "logprobs"
        self.grad_norm = None
        return stats

    def _pipeline_items(self, batch: RolloutBatch, micro_batches: list[list[int]]) -> list:
        one_row = attention_implementation().startswith("flash")
        return [pipeline.micro_batch_item(batch.select(rows or [0]), 1.0 if rows else 0.0, one_row)
                for rows in micro_batches]

    def _pipeline_tensors(self):
        return pipeline.named_full_tensors(self.policy.module, self.model_group, self.policy.grid.pp_group)

    def sync_rollout_weights(self) -> float:
        """Stream the policy's weights into the rollout engine; returns seconds taken."""
        if not self.pipeline:
            return sync_weights(self.policy.module, self.rollout, self.cfg.rollout.sync_bucket_mb)
        return sync_weights(self.policy.module, self.rollout if self.samples_rollout else None,
                            tensors=self._pipeline_tensors())

    def _grad_norm_before_step(self):
        """DeepSpeed reports the gradient norm under ZeRO and bf16, not for plain fp32 ZeRO-0:
        there it is measured here (gradients are already averaged over dp)."""
        if zero_stage(self.ds_config) != 0 or self.cfg.model.dtype != "float32":
            return None
        from deepspeed.runtime.utils import get_global_norm_of_tensors
        grads = [p.grad for p in self.policy.module.parameters() if p.grad is not None]
        return float(get_global_norm_of_tensors(grads, mpu=self.policy.mpu)) if grads else 0.0

    # ---- pieces -------------------------------------------------------------------------------

    def _generate(self, prompt_ids, n, seeds, greedy=False):
        """Sample on the first rank of each tp group and share its completions with the group,
        so that every rank trains on the same tokens."""
        groups = None
        if self.samples_rollout:
            groups = self.rollout.generate(prompt_ids, n=n, seeds=seeds, greedy=greedy)
            self.rollout.sleep()
        if self.model_group is not None:
            box = [groups]
            torch.distributed.broadcast_object_list(box, src=self.topo.model_group_source,
                                                    group=self.model_group)
            groups = box[0]
        return groups

    def _sampling_seed(self, prompt_index: int) -> int:
        """A pure function of (seed, step, prompt): the same samples whatever the layout, and
        after a resume."""
        return ((self.cfg.grpo.seed * 1_000_003 + self.step) * 1_000_033 + prompt_index) % 2**31

    def _record_prompts(self, indices: list[int]) -> None:
        """Append this step's prompt indices (all dp ranks) to output_dir/prompts_seen.jsonl,
        so that a resumed run can be checked for skipped or repeated data."""
        everything = all_gather_1d(torch.tensor(indices, dtype=torch.long), self.dp_group).tolist()
        if self.topo.is_main:
            with open(os.path.join(self.cfg.output_dir, "prompts_seen.jsonl"), "a") as f:
                f.write(json.dumps({"step": self.step + 1, "prompts": everything}) + "\n")

    def _rewards(self, prompts: list[Prompt], texts: list[str], lengths: list[int]):
        """Weighted total and per-function rewards; components of the suite's rewards are kept
        in self.reward_details for the step metrics."""
        fields = {key: [p.fields.get(key) for p in prompts] for key in prompts[0].fields}
        fields["completion_length"] = lengths
        fields["max_new_tokens"] = [self.cfg.rollout.max_new_tokens] * len(texts)
        self.reward_details = {}
        return compute_rewards(self.reward_functions, [p.prompt for p in prompts], texts, fields,
                               self.reward_details)

    def _loss_normalisers(self, batch: RolloutBatch) -> dict:
        """What the chosen aggregation divides by, for the whole step (see grpo.aggregate)."""
        g = self.cfg.grpo
        tokens = float(batch.completion_mask.sum())
        if g.loss_type == "dapo":  # global token mean; DeepSpeed averages over dp ranks
            tokens = float(all_reduce(torch.tensor([tokens], dtype=torch.float64), group=self.dp_group)[0]) / self.topo.dp_size
        return {"num_sequences": len(batch), "num_tokens": tokens,
                "max_completion_length": self.cfg.rollout.max_new_tokens}

    def _micro_batches(self, batch: RolloutBatch) -> list[list[int]]:
        """Row indices per micro-batch: within the token budget and balanced, or fixed-size.
        Every rank gets the same number of micro-batches."""
        g = self.cfg.grpo
        if not g.max_tokens_per_microbatch:
            size = g.per_device_train_batch_size
            return [list(range(s, min(s + size, len(batch)))) for s in range(0, len(batch), size)]
        lengths = batch.token_counts()
        local = balanced_microbatches(lengths, g.max_tokens_per_microbatch)
        count = int(all_reduce(torch.tensor([len(local)]), "max")[0])
        return balanced_microbatches(lengths, g.max_tokens_per_microbatch, min_count=count)

    def _logprobs(self, model, mb: RolloutBatch):
        g = self.cfg.grpo
        return completion_logprobs(model, mb, self.cfg.rollout.temperature, g.packing, g.fused_logprobs)

    def _logprobs_without_grad(self, model, batch: RolloutBatch, micro_batches) -> torch.Tensor:
        out = torch.zeros(batch.completion_ids.shape, device=batch.completion_ids.device)
        if self.pipeline:  # known at the last stage only, which is the only one that needs them
            items = self._pipeline_items(batch, micro_batches)
            collector = model.module.loss_fn
            collector.collected = []
            model.eval_batch(iter(items), compute_loss=True, bcast_loss=False, num_micro_batches=len(items))
            if model.is_last_stage():
                for rows, (_, labels), logp in zip(micro_batches, items, collector.collected):
                    if rows:
                        out[torch.tensor(rows)[labels[0]], labels[1]] = logp.to(out.dtype)
            return out
        model.eval()
        for rows in micro_batches:
            mb = batch.select(rows or [0])
            logp = self._logprobs(model, mb)[0]
            if rows:
                out[torch.tensor(rows)[:, None], torch.arange(logp.shape[1])[None, :]] = logp
        return out

    def _step_metrics(self, global_rewards, per_function, advantages, batch, stats: StepStats,
                      timings: dict) -> dict:
        g = self.cfg.grpo
        out = stats.reduce()
        # DeepSpeed averages gradients over dp ranks: the step's loss is the mean of the ranks'
        # (under pipeline parallelism only the last stage holds it: the sum runs over everyone)
        loss_group = None if self.pipeline else self.dp_group
        out["loss"] = float(all_reduce(torch.tensor([stats.loss]), group=loss_group)[0]) / self.topo.dp_size / g.num_iterations
        out.pop("sampling/sampling_logp_difference/min", None)
        grouped = global_rewards.view(-1, g.num_generations)
        out.update({
            "reward": global_rewards.mean(), "reward_std": global_rewards.std(),
            "reward_min": global_rewards.min(), "reward_max": global_rewards.max(),
            "frac_reward_zero_std": (grouped.std(dim=1) < 1e-6).float().mean(),
        })
        # one gather for every per-completion statistic: (N, functions + 4) on each dp rank
        columns = [advantages, batch.completion_lens, batch.truncated,
                   batch.prompt_lens + batch.completion_lens]
        per_completion = torch.cat([per_function] + [c.cpu().float()[:, None] for c in columns], dim=1)
        gathered = all_gather_1d(per_completion.reshape(-1), self.dp_group).view(-1, per_completion.shape[1])
        *function_columns, global_adv, lengths, truncated, tokens = gathered.unbind(dim=1)
        for rf, values in zip(self.reward_functions, function_columns):
            out[f"rewards/{rf.name}/mean"] = values.mean()
            out[f"rewards/{rf.name}/std"] = values.std()
        out.update(component_metrics(self.reward_details, self.dp_group))
        out["advantages/mean"], out["advantages/std"] = global_adv.mean(), global_adv.std()
        out.update({"completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
                    "completions/max_length": lengths.max(),
                    "completions/clipped_ratio": truncated.mean()})
        out["learning_rate"] = self.policy.get_lr()[0]
        grad_norm = self.policy.get_global_grad_norm()
        if grad_norm is None:
            grad_norm = self.grad_norm
        out["grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        out["tokens_per_second"] = tokens.sum() / max(sum(timings.values()), 1e-9)
        out.update({f"time/{k}": v for k, v in timings.items()})
        return {k: float(v) for k, v in out.items()}

    def _log_samples(self, prompt: Prompt, texts: list[str], rewards: torch.Tensor) -> None:
        rows = "\n".join(f"| {r:.3f} | {t[:300]!r} |".replace("\n", " ") for t, r in zip(texts, rewards.tolist()))
        self.metrics.text(self.step + 1, "samples",
                          f"**prompt:** {str(prompt.prompt)[:300]!r}\n\n| reward | completion |\n|---|---|\n{rows}")

    def evaluate(self) -> dict:
        """This rank's share of the held-out prompts through the rollout engine, scored by the
        reward functions and the text metrics (see evaluation.py); every completion goes to
        output_dir/eval_samples/step_N.jsonl, the metrics to output_dir/eval_history.jsonl.
        Returns the global metrics."""
        from . import evaluation

        indices = list(range(self.topo.dp_rank, len(self.eval_prompts), self.topo.dp_size))
        # only a sampling rank's engine is sure to hold the trained weights (pipeline stages
        # after the first keep an engine vLLM needs but never sync it)
        score = self.rollout.score if self.samples_rollout else None
        records = evaluation.score_prompts(
            [self.eval_prompts[i] for i in indices], indices, self._generate, score, self.tokenizer,
            self.reward_functions, sorted(self.eval_prompts[0].fields), self.cfg.logging.eval_num_generations,
            self.cfg.data.reference_field, self.cfg.rollout.max_new_tokens, self.cfg.grpo.seed)
        records = evaluation.gather_records(records, self.dp_group)
        metrics = evaluation.summarize(records, [rf.name for rf in self.reward_functions],
                                       self.cfg.logging.eval_num_generations)
        if self.topo.is_main:
            evaluation.write_samples(os.path.join(self.cfg.output_dir, "eval_samples",
                                                  f"step_{self.step:08d}.jsonl"), records)
            with open(os.path.join(self.cfg.output_dir, "eval_history.jsonl"), "a") as f:
                f.write(json.dumps({"step": self.step, **metrics}) + "\n")
        return metrics

    def maybe_resume(self) -> None:
        resume = self.cfg.checkpoint.resume
        if resume == "none":
            if checkpoint.complete_checkpoints(self.ckpt_root):
                raise ConfigError(f"checkpoint.resume=none but {self.ckpt_root} holds checkpoints of "
                                  "an earlier run; resume it (checkpoint.resume=auto), use another "
                                  "output_dir, or delete that folder")
            return
        candidates = checkpoint.resume_candidates(self.ckpt_root, self.log) if resume == "auto" else [resume]
        path, state = None, None
        for path in candidates:  # a corrupt checkpoint is reported and the previous one tried
            reshard = self._check_resumable(path)
            try:
                state, error = checkpoint.load(self.policy, path, self.topo.rank, reshard, self.topo.is_main), None
            except Exception as e:  # noqa: BLE001 - whatever DeepSpeed or torch.load raise
                state, error = None, e
            failed = all_reduce(torch.tensor([0 if error is None else 1]), "max")[0]
            if not failed:
                break
            if resume != "auto":
                raise ConfigError(f"checkpoint.resume: '{path}' could not be loaded: {error}")
            self.log(f"checkpoint '{path}' could not be loaded ({error or 'on another rank'}); "
                     "trying the previous complete one")
            state = None
        if state is None:
            if candidates and resume == "auto":
                raise ConfigError(f"no checkpoint under {self.ckpt_root} could be loaded; move the "
                                  "folder away to start over")
            return
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        note = ""
        if reshard:
            note = (f" (re-sharded from dp {state['dp_size']} x tp {state['layout'].get('tp', 1)} "
                    f"to dp {self.topo.dp_size} x tp {self.topo.tp_size})")
        self.log(f"resumed from {path} at step {self.step}{note}")

    def _check_resumable(self, path: str) -> bool:
        """Refuse a checkpoint this run cannot continue (before loading anything); returns
        whether it needs re-sharding (saved with another number of data- or tensor-parallel ranks)."""
        try:
            state = checkpoint.read_trainer_state(path)
        except (OSError, ValueError):
            return False  # unreadable: the load reports it and the previous one is tried
        def refuse(what):
            raise ConfigError(f"checkpoint '{path}' {what}")
        if state.get("num_prompts", len(self.prompts)) != len(self.prompts):
            refuse(f"was saved with {state['num_prompts']} training prompts, this run has "
                   f"{len(self.prompts)}; the prompt order would not continue. Resume with the same data")
        try:
            return checkpoint.needs_reshard(state, self.topo.dp_size, self.topo.tp_size, self.topo.pp_size,
                                            self.sampler.global_batch, zero_stage(self.ds_config))
        except ValueError as e:
            refuse(str(e))

    def save(self) -> None:
        state = {"step": self.step, "sampler": self.sampler.state_dict(),
                 "world_size": self.topo.world_size, "dp_size": self.topo.dp_size,
                 "num_prompts": len(self.prompts), "total_steps": self.total_steps,
                 "prompts_per_step": self.sampler.global_batch,
                 "model": os.path.abspath(self.cfg.model.name_or_path)
                 if os.path.isdir(self.cfg.model.name_or_path) else self.cfg.model.name_or_path,
                 "layout": {"tp": self.topo.tp_size, "pp": self.topo.pp_size,
                            "zero_stage": zero_stage(self.ds_config), "dtype": self.cfg.model.dtype}}
        path = checkpoint.save(self.policy, self.ckpt_root, self.step, state,
                               self.cfg.checkpoint.keep_last, self.topo.is_main, self.topo.rank)
        self.log(f"checkpoint saved: {path}")


def _format_eval(results: dict) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in results.items())


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="megagrpo train",
        description="GRPO training. Settings come from --config and key.sub=value overrides "
                    "(e.g. grpo.kl_coef=0.1 num_generations=8 use_vllm=false).")
    p.add_argument("--config", help="experiment YAML (see configs/)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--timeout-minutes", type=float, default=30.0,
                   help="process-group timeout for collectives (default 30)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the layout and per-rank memory (as `megagrpo plan`) and exit")
    p.add_argument("overrides", nargs="*", help="key.sub=value settings applied after the YAML")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, DataError) as e:
        print(f"megagrpo: config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        if int(os.environ.get("RANK", "0")) == 0:
            from megagrpo.cluster.plan import format_plan, make_plan
            print(format_plan(make_plan(cfg, int(os.environ.get("WORLD_SIZE", "1")))))
        return 0
    topology = init_distributed(args.timeout_minutes, cfg.parallel.tensor_parallel_size,
                                cfg.parallel.pipeline_parallel_size)
    try:
        Trainer(cfg, topology).train()
    except Exception as e:  # noqa: BLE001 - every failure must end this rank now
        if not isinstance(e, (DataError, RewardError, ConfigError)):
            traceback.print_exc()
        print(f"megagrpo: error on rank {topology.rank}: {e}", file=sys.stderr, flush=True)
        # other ranks may wait in a collective: exit without teardown so the launcher sees the
        # failure and stops them, instead of everyone hanging until the process-group timeout
        os._exit(1)
    torch.distributed.barrier()  # leave together (vLLM's exit hook tears its groups down)
    return 0


if __name__ == "__main__":
    sys.exit(main())
