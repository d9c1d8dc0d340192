"""The GRPO trainer: `python -m megagrpo.train --config X.yaml key.sub=value ...`.

Runs as one process, under `deepspeed --num_gpus N --module megagrpo.train`, or torchrun.
One step:
    prompts -> rollout (G completions each; multi-turn with tools: rollout/agent.py)
    -> rewards -> group advantages
    -> reference (and old-policy) logprobs -> num_iterations passes of clipped, KL-penalised updates
    -> weight sync into the generator -> metrics, checkpoint
The policy (policy/) hides the parallel layout, ZeRO and LoRA: this loop is the same for all.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time

import torch

from megagrpo import evaluation
from megagrpo.algorithm import grpo
from megagrpo.checkpoints import checkpoint, export
from megagrpo.cluster.distributed import all_gather_1d, init_distributed, launch_env
from megagrpo.cluster.placement import Placement, engine_tp
from megagrpo.cluster.topology import Topology
from megagrpo.config.loading import to_dict
from megagrpo.config.schema import Config, ConfigError
from megagrpo.console import quiet_library_output
from megagrpo.data import DataError, Prompt, PromptSampler, record_prompts
from megagrpo.metrics import MetricsLogger, rollout_metrics, samples_markdown
from megagrpo.monitoring import MemoryWatch, PhaseClock, Progress, StartupTimeline
from megagrpo.planning import format_plan, make_plan, planned_host_peak_gib
from megagrpo.policy import build_policy
from megagrpo.policy.batch import make_batch
from megagrpo.process_exit import exit_without_teardown, run_rank
from megagrpo.rewards import RewardError, component_metrics
from megagrpo.rollout.agent import agent_metrics
from megagrpo.rollout.ahead import RolloutsAhead, ahead_sampler
from megagrpo.rollout.generator_group import GeneratorGroup
from megagrpo.rollout.generators import sampling_seed
from megagrpo.rollout.groups import SampledGroups, sample_informative_groups
from megagrpo.rollout.serving import serve
from megagrpo.rollout.weight_sync import sync_weights
from megagrpo.stack import build_rollout_stack
from megagrpo.validation import load_config

USER_ERRORS = (DataError, RewardError, ConfigError)  # their messages say it all: no traceback


class Trainer:
    def __init__(self, cfg: Config, topology: Topology, startup: StartupTimeline | None = None):
        self.cfg, self.topo = cfg, topology
        self.startup = startup = startup or StartupTimeline()
        g = cfg.grpo
        self.device = torch.device(f"cuda:{topology.local_rank}" if torch.cuda.is_available() else "cpu")
        self.log = lambda msg: print(f"[megagrpo] {msg}", flush=True) if topology.is_main else None
        self.stack = build_rollout_stack(cfg)  # tokenizer, tools, prompts, reward functions
        startup.lap("data")
        self.tokenizer, self.prompts = self.stack.tokenizer, self.stack.prompts
        self.log(f"{len(self.prompts)} training prompts; {self.stack.dropped['train']} dropped as longer than "
                 f"data.max_prompt_length={cfg.data.max_prompt_length}")
        completions_per_rank = g.per_device_train_batch_size * g.gradient_accumulation_steps
        self.sampler = PromptSampler(len(self.prompts), completions_per_rank // g.num_generations,
                                     topology.dp_rank, topology.dp_size, g.seed, cfg.data.shuffle)
        self.total_steps = g.max_steps if g.max_steps > 0 else max(
            1, math.ceil(g.num_train_epochs * self.sampler.steps_per_epoch))
        self.policy = build_policy(cfg, topology, self.total_steps)
        startup.lap("policy")
        # vLLM's start-up runs five full GCs: with our objects frozen first, each takes ms, not 0.4 s
        gc.freeze()
        # every rank builds its generator (shard); a generator group's ranks make the same calls
        self.generator_group = GeneratorGroup(topology, engine_tp(cfg))
        self.stack.start_generator(seed=g.seed + topology.generator_ranks()[0],
                                   run_once=self.generator_group.run_once)
        self.generator = self.stack.generator
        # rollout.max_staleness: the next steps' batches sampled while this one trains (rollout/ahead.py)
        self.ahead = RolloutsAhead(self.sampler.next_indices, ahead_sampler(self.stack, g, topology.generates),
                                   cfg.rollout.max_staleness, self.total_steps,
                                   cfg.rollout.partial_rollouts) if cfg.rollout.max_staleness else None
        startup.lap("generator")
        self.metrics = MetricsLogger(cfg.output_dir, cfg.logging, topology.is_main, to_dict(cfg))
        self.ckpt_root = os.path.join(cfg.output_dir, "checkpoints")
        os.makedirs(cfg.output_dir, exist_ok=True)
        self.step, self.generator_synced = 0, False  # after the first sync only changed weights move
        self.log(topology.describe())

    # ---- the run ------------------------------------------------------------------------------

    def train(self) -> dict:
        cfg = self.cfg
        self.resume()
        self.startup.lap("resume")
        self.sync_generator_weights(self.step)
        self.startup.lap("weight sync")
        self.report_startup()
        results = {}
        if self.stack.eval_prompts and self.step == 0:
            results["before"] = self.evaluate()
            self.log(f"held-out before training: {evaluation.format_metrics(results['before'])}")
        progress = Progress(self.total_steps, self.step, self.topo.is_main and cfg.logging.progress_bar,
                            cfg.logging.logging_steps)
        while self.step < self.total_steps:
            start = time.perf_counter()
            metrics = self.train_step()
            self.step += 1
            metrics["time/step"] = time.perf_counter() - start
            progress.update(self.step, metrics)
            if self.step % cfg.logging.logging_steps == 0 or self.step == self.total_steps:
                self.metrics.scalars(self.step, {f"train/{k}": v for k, v in metrics.items()})
            if cfg.logging.eval_steps and self.step % cfg.logging.eval_steps == 0 and self.stack.eval_prompts:
                self.metrics.scalars(self.step, {f"eval/{k}": v for k, v in self.evaluate().items()})
            if cfg.checkpoint.save_steps and self.step % cfg.checkpoint.save_steps == 0:
                self.save()
        progress.close()
        if not cfg.checkpoint.save_steps or self.step % cfg.checkpoint.save_steps != 0:
            self.save()
        if self.stack.eval_prompts:
            results["after"] = self.evaluate()
            self.metrics.scalars(self.step, {f"eval/{k}": v for k, v in results["after"].items()})
            self.log(f"held-out after training: {evaluation.format_metrics(results['after'])}")
        if cfg.checkpoint.save_hf_at_end:
            self.export()
        if self.topo.is_main and results:
            evaluation.write_results(cfg.output_dir, results)
        self.stack.close()
        self.metrics.close()
        self.log(f"done: {self.step} steps. {self.metrics.how_to_watch()}")
        return results

    def report_startup(self) -> None:
        """The start-up timeline (the slowest rank's phases) on the console and in every sink."""
        startup = self.startup.slowest()
        self.log(StartupTimeline.line(startup))
        self.metrics.scalars(self.step, {f"startup/{p.replace(' ', '_')}_s": s for p, s in startup.items()})

    # ---- one GRPO step ------------------------------------------------------------------------

    def train_step(self) -> dict:
        g = self.cfg.grpo
        clock = PhaseClock(self.startup.watch)
        # rollout (G completions or multi-turn trajectories per prompt, with the sampler's
        # logprobs) and rewards; dynamic sampling: more rounds until the groups are informative
        if g.dynamic_sampling:
            sampled = sample_informative_groups(lambda r: self.sample_groups(r, clock),
                                                self.sampler.prompts_per_rank, g.max_sampling_rounds,
                                                self.topo.dp_group)
        else:
            sampled = self.sample_groups(0, clock)
        prompt_of, completions, rewards = sampled.prompts, sampled.completions, sampled.rewards

        # group advantages (groups never leave their rank; batch std is global)
        global_rewards = all_gather_1d(rewards.total, self.topo.dp_group)
        advantages = grpo.group_advantages(rewards.total, g.num_generations, g.scale_rewards,
                                           batch_std=global_rewards.std())
        clock.lap("reward")

        batch = make_batch([p.token_ids for p in prompt_of], completions, advantages,
                           self.tokenizer.pad_token_id).to(self.device)
        if g.mask_truncated_completions:
            batch.completion_mask = batch.completion_mask * (~batch.truncated).unsqueeze(1).float()

        # reference and old-policy logprobs, over the same micro-batches as the update
        micro_batches = self.policy.micro_batches(batch)
        batch.ref_logp = self.policy.logprobs(batch, micro_batches, reference=True)
        if g.num_iterations > 1:
            batch.old_logp = self.policy.logprobs(batch, micro_batches)
        clock.lap("reference")

        # policy update: num_iterations passes, one optimizer step each; a moving reference follows it
        metrics = self.policy.optimize(batch, micro_batches)
        if g.sync_ref_model and (self.step + 1) % g.ref_model_sync_steps == 0:
            self.policy.mix_reference(g.ref_model_mixup_alpha)
        clock.lap("train")

        if self.ahead is not None:
            self.ahead.settle()  # every rank's batches in flight are done before the weights change
            clock.lap("rollout_ahead")
        self.sync_generator_weights(self.step + 1)
        clock.lap("weight_sync")
        if self.topo.is_main and self.cfg.logging.sample_steps and (self.step + 1) % self.cfg.logging.sample_steps == 0:
            shown = sampled.texts if self.stack.agent is None else [  # whole trajectories: turns and tool results
                self.tokenizer.decode(c.token_ids) for c in completions[:g.num_generations]]
            table = samples_markdown(prompt_of[0].prompt, shown[:g.num_generations],
                                     rewards.total[:g.num_generations].tolist())
            self.metrics.text(self.step + 1, "samples", table)
        metrics.update(rollout_metrics(global_rewards, rewards.per_function, advantages, batch,
                                       [rf.name for rf in self.stack.reward_functions], g.num_generations,
                                       sum(clock.seconds.values()), self.topo.dp_group))
        metrics.update(component_metrics(rewards, self.topo.dp_group))
        metrics.update(sampled.metrics)
        if self.stack.agent is not None:
            metrics.update(agent_metrics(completions, self.stack.agent.tool_wall_seconds, self.topo.dp_group))
        metrics.update(clock.metrics())
        return {k: float(v) for k, v in metrics.items()}

    def sample_groups(self, sampling_round: int, clock: PhaseClock) -> SampledGroups:
        """The next prompts of this rank, their groups sampled and scored."""
        g = self.cfg.grpo
        if self.ahead is not None:  # sampled on the side thread, while an earlier step trained
            batch = self.ahead.take(self.step)
            indices, groups = batch.indices, self.share_rollout(batch.groups)
        else:
            indices = self.sampler.next_indices()
            groups = self.generate([self.prompts[i] for i in indices], n=g.num_generations,
                                   seeds=[sampling_seed(g.seed, self.step, i, sampling_round) for i in indices])
        record_prompts(self.cfg.output_dir, self.step + 1, indices, sampling_round, self.topo)
        prompts = [self.prompts[i] for i in indices]
        completions = [c for group in groups for c in group]
        prompt_of = [p for p in prompts for _ in range(g.num_generations)]
        clock.lap("rollout" if sampling_round == 0 else "resampling")
        texts, rewards = self.stack.score(prompt_of, completions, prompts[0].fields)
        clock.lap("reward" if sampling_round == 0 else "resampling")
        return SampledGroups(prompt_of, completions, texts, rewards, g.num_generations,
                             self.ahead.metrics() if self.ahead is not None else {})

    def generate(self, prompts: list[Prompt], n, seeds, greedy=False):
        """Sample on the generator groups of each model group that hold its first rank (one
        generator call, or the multi-turn loop), and share the completions with the ranks that
        did not sample, so that every rank trains on the same tokens."""
        groups = None
        if self.topo.generates:
            groups = self.generator_group.generate(self.stack, prompts, n, seeds, greedy)
        self.generator.sleep()  # (on GPU; an engine that did not sample frees its memory too)
        return self.share_rollout(groups)

    def share_rollout(self, groups):
        """The completions of the model group's sampling rank, on every rank of the group."""
        if self.topo.shares_rollout:
            box = [groups]
            torch.distributed.broadcast_object_list(box, src=self.topo.model_group_source,
                                                    group=self.topo.model_group)
            groups = box[0]
        return groups

    def sync_generator_weights(self, steps_done: int) -> float:
        """Stream the policy's weights (`steps_done` steps trained) into every generator that takes
        them whole; returns seconds taken. After the first sync, LoRA sends only what it trains."""
        partial = self.generator_synced and not self.policy.trains_all_weights
        seconds = sync_weights(self.policy.full_tensors(changed_only=partial),
                               self.generator if self.policy.holds_full_tensors else None, partial, steps_done)
        self.generator_synced = True
        return seconds

    # ---- evaluation and checkpoints -------------------------------------------------------------

    def evaluate(self) -> dict:
        """This rank's share of the held-out prompts through the generator, scored by the
        reward functions and the text metrics (see evaluation.py). Returns the global metrics."""
        # only a sampling rank's generator is sure to hold the trained weights
        score_tokens = (lambda requests: self.generator_group.map(self.generator.score, requests)) \
            if self.topo.generates else None
        records, metrics = evaluation.evaluate(self.stack, self.stack.eval_prompts, self.topo.dp_rank,
                                               self.topo.dp_size, self.generate, score_tokens, self.topo.dp_group)
        if self.topo.is_main:
            evaluation.record_evaluation(self.cfg.output_dir, self.step, records, metrics)
        return metrics

    def trainer_state(self) -> checkpoint.TrainerState:
        """What a checkpoint of this run records now (and what a checkpoint must match to resume)."""
        return checkpoint.TrainerState(
            step=self.step, sampler=self.sampler.state_dict(), world_size=self.topo.world_size,
            dp_size=self.topo.dp_size, num_prompts=len(self.prompts), total_steps=self.total_steps,
            prompts_per_step=self.sampler.prompts_per_step, model=self.policy.base_model,
            layout=self.policy.layout())

    def resume(self) -> None:
        state = checkpoint.resume(self.policy, self.ckpt_root, self.cfg.checkpoint.resume, self.trainer_state(),
                                  self.topo, self.log)
        if state is not None:
            self.step = state["step"]
            self.metrics.resumed_at(self.step)  # what the killed attempt logged after it goes
            self.sampler.load_state_dict(state["sampler"])
            ahead = checkpoint.load_rollouts_ahead(state, self.topo.rank, self.cfg.rollout.max_staleness)
            if self.ahead is not None:
                self.ahead.load_state(ahead)
            if self.cfg.grpo.sync_ref_model:
                self.policy.load_reference_state(checkpoint.load_reference(state, self.topo.rank))

    def save(self) -> None:
        reference = self.policy.reference_state() if self.cfg.grpo.sync_ref_model else None
        path = checkpoint.save(self.policy, self.ckpt_root, self.trainer_state(), self.cfg.checkpoint.keep_last,
                               self.topo, reference, self.ahead.state() if self.ahead is not None else None)
        self.log(f"checkpoint saved: {path}")

    def export(self) -> None:
        """output_dir/hf: the model as an HF folder (a LoRA policy's merged; its adapters also
        as a PEFT folder, output_dir/adapter)."""
        for what, folder in export.export(self.policy, self.tokenizer, self.cfg.output_dir,
                                              self.topo.is_main).items():
            self.log(f"{what} written to {folder}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="megagrpo train",
        description="GRPO training. Settings come from --config and key.sub=value overrides "
                    "(e.g. grpo.kl_coef=0.1 num_generations=8 use_vllm=false).")
    p.add_argument("--config", help="experiment YAML (see configs/)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--timeout-minutes", type=float, default=30.0, help="collectives' timeout (default 30)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the layout and per-rank memory (as `megagrpo plan`) and exit")
    p.add_argument("overrides", nargs="*", help="key.sub=value settings applied after the YAML")
    return p.parse_args(argv)


def main(argv=None) -> int:
    startup = StartupTimeline()
    startup.lap("imports")
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides, planning=args.dry_run)
        plan = make_plan(cfg, int(os.environ.get("WORLD_SIZE", "1"))) if args.dry_run else None
    except (ConfigError, DataError) as e:
        print(f"megagrpo: config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        if int(os.environ.get("RANK", "0")) == 0:
            print(format_plan(plan))
        return 0
    quiet_library_output()
    startup.lap("config")
    launch_env()
    placement = Placement.from_env(cfg)  # rollout.placement: which ranks train, which generate
    if not placement.trains:
        return run_rank(lambda: serve(cfg, placement) or 0, placement.rank, USER_ERRORS)
    placement.enter_trainer_world()
    p = cfg.parallel
    topology = init_distributed(args.timeout_minutes, p.tensor_parallel_size, p.pipeline_parallel_size,
                                engine_tp(cfg), p.sequence_parallel_size)
    startup.lap("distributed")
    startup.watch = MemoryWatch(topology.rank, planned_host_peak_gib(cfg, topology.world_size), phase="distributed")
    startup.watch.start()  # before an OOM kill; told each phase by the clocks that lap with it
    # held until the ranks leave together: its vLLM engine, once collected, ends the process groups
    trainer = run_rank(lambda: Trainer(cfg, topology, startup), topology.rank, USER_ERRORS)
    run_rank(trainer.train, topology.rank, USER_ERRORS)
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
