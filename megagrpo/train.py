"""The GRPO trainer: `python -m megagrpo.train --config X.yaml key.sub=value ...`.

Runs as one process, under `deepspeed --num_gpus N --module megagrpo.train`, or torchrun.
One step:
    prompts -> rollout (G completions each; multi-turn with tools: rollout/agent.py)
    -> rewards -> group advantages
    -> reference (and old-policy, and a distillation teacher's) logprobs
    -> num_iterations passes of clipped, KL-penalised updates
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
from megagrpo.checkpoints import checkpoint, export, rollouts_ahead
from megagrpo.cluster.distributed import all_gather_1d, init_distributed, launch_env
from megagrpo.cluster.generator_layout import generator_layout
from megagrpo.cluster.placement import Placement
from megagrpo.cluster.topology import Topology
from megagrpo.config.loading import to_dict
from megagrpo.config.schema import Config, ConfigError, has_teacher
from megagrpo.console import quiet_library_output
from megagrpo.data import DataError, PromptOrder
from megagrpo.doctor import Doctor
from megagrpo.metrics import MetricsLogger, rollout_metrics, samples_markdown
from megagrpo.monitoring import MemoryWatch, PhaseClock, Progress, StartupTimeline
from megagrpo.planning import format_plan, make_plan, planned_host_peak_gib
from megagrpo.policy import build_policy
from megagrpo.policy.batch import make_batch
from megagrpo.process_exit import exit_without_teardown, run_rank
from megagrpo.rewards import RewardError, component_metrics
from megagrpo.rollout.serving import serve
from megagrpo.rollout.teacher_server import TeacherServer
from megagrpo.rollout.weight_sync import sync_weights
from megagrpo.run_logs import read_series
from megagrpo.stack import SampledGroups, build_rollout_stack
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
        self.log(f"{len(self.prompts)} training prompts; {self.stack.dropped['train']} dropped (longer than "
                 f"data.max_prompt_length={cfg.data.max_prompt_length}, or a bad image)")
        completions_per_rank = g.per_device_train_batch_size * g.gradient_accumulation_steps
        self.prompt_order = PromptOrder(len(self.prompts), completions_per_rank // g.num_generations,
                                        topology.dp_rank, topology.dp_size, g.seed, cfg.data.shuffle)
        self.total_steps = g.max_steps if g.max_steps > 0 else max(
            1, math.ceil(g.num_train_epochs * self.prompt_order.steps_per_epoch))
        self.policy = build_policy(cfg, topology, self.total_steps)  # (and teacher.model's teacher)
        startup.lap("policy")
        self.teacher_server = TeacherServer(cfg, self.tokenizer, self.log) if cfg.teacher.url else None
        # vLLM's start-up runs five full GCs: with our objects frozen first, each takes ms, not 0.4 s
        gc.freeze()
        # every rank builds its generator (shard); a generator group's ranks make the same calls;
        # rollout.max_staleness: the next steps' batches sampled while this one trains (rollout/ahead.py)
        self.stack.start(topology, seed=g.seed + topology.generator_ranks()[0], prompt_order=self.prompt_order,
                         total_steps=self.total_steps)
        startup.lap("generator")
        self.metrics = MetricsLogger(cfg.output_dir, cfg.logging, topology.is_main, to_dict(cfg))
        self.doctor = Doctor(cfg) if topology.is_main and cfg.doctor.enabled else None
        self.ckpt_root = os.path.join(cfg.output_dir, "checkpoints")
        os.makedirs(cfg.output_dir, exist_ok=True)
        self.step, self.generator_synced = 0, False  # after the first sync only changed weights move
        ep = cfg.parallel.expert_parallel_size
        self.log(topology.describe() + (f"; each MoE layer's experts split over {ep} ranks (AutoEP)" if ep > 1 else ""))

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
                logged = {f"train/{k}": v for k, v in metrics.items()}
                self.metrics.scalars(self.step, logged)
                self.diagnose(logged)
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
        if self.teacher_server is not None:
            self.teacher_server.close()
        self.metrics.close()
        self.log(f"done: {self.step} steps. {self.metrics.how_to_watch()}")
        return results

    def diagnose(self, logged: dict) -> None:
        """The run doctor reads the logged step (doctor.py): each new finding a console line,
        and to every sink."""
        for finding in self.doctor.observe(self.step, logged) if self.doctor else []:
            self.log(finding.line())
            self.metrics.finding(self.step, finding.check, finding.line())

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
        # logprobs, sampled now or ahead) and rewards; dynamic sampling: more rounds until the
        # groups are informative
        sampled = self.stack.sample(self.step, clock)

        # group advantages (groups never leave their rank; batch std is global)
        global_rewards = all_gather_1d(sampled.rewards.total, self.topo.dp_group)
        advantages = grpo.group_advantages(sampled.rewards.total, g.num_generations, g.scale_rewards,
                                           batch_std=global_rewards.std())
        clock.lap("reward")
        batch = self.make_batch(sampled, advantages)

        # reference and old-policy logprobs, over the same micro-batches as the update
        micro_batches = self.policy.micro_batches(batch)
        batch.ref_logp = self.policy.logprobs(batch, micro_batches, reference=True)
        if g.num_iterations > 1:
            batch.old_logp = self.policy.logprobs(batch, micro_batches)
        clock.lap("reference")
        if has_teacher(self.cfg):  # on-policy distillation: the teacher scores every sampled token
            batch.teacher_logp = (self.teacher_server.logprobs(batch) if self.teacher_server is not None
                                  else self.policy.logprobs(batch, micro_batches, teacher=True))
            clock.lap("teacher")

        # policy update: num_iterations passes, one optimizer step each; a moving reference follows it
        metrics = self.policy.optimize(batch, micro_batches)
        if g.sync_ref_model and (self.step + 1) % g.ref_model_sync_steps == 0:
            self.policy.mix_reference(g.ref_model_mixup_alpha)
        clock.lap("train")

        # the new weights into the generator, once no batch sampled ahead is in flight
        self.stack.settle(clock)
        self.sync_generator_weights(self.step + 1)
        clock.lap("weight_sync")
        self.log_samples(sampled)
        metrics.update(self.step_metrics(sampled, global_rewards, advantages, batch, clock))
        return {k: float(v) for k, v in metrics.items()}

    def make_batch(self, sampled: SampledGroups, advantages: torch.Tensor):
        """The step's batch on this rank's device (policy/batch.py); truncated completions masked
        out of the loss with grpo.mask_truncated_completions."""
        # an outside agent's episode brings its own first request as its prompt
        prompt_ids = [getattr(c, "prompt_ids", None) or p.token_ids
                      for p, c in zip(sampled.prompts, sampled.completions)]
        batch = make_batch(prompt_ids, sampled.completions, advantages,
                           self.tokenizer.pad_token_id, [p.vision for p in sampled.prompts]).to(self.device)
        if self.cfg.grpo.mask_truncated_completions:
            batch.completion_mask = batch.completion_mask * (~batch.truncated).unsqueeze(1).float()
        return batch

    def step_metrics(self, sampled: SampledGroups, global_rewards, advantages, batch, clock: PhaseClock) -> dict:
        """The step's rollout, reward and time metrics (the policy's come from optimize)."""
        g = self.cfg.grpo
        metrics = rollout_metrics(global_rewards, sampled.rewards.per_function, advantages, batch,
                                  [rf.name for rf in self.stack.reward_functions], g.num_generations,
                                  sum(clock.seconds.values()), self.topo.dp_group)
        metrics.update(component_metrics(sampled.rewards, self.topo.dp_group))
        metrics.update(sampled.metrics)
        metrics.update(clock.metrics())
        if self.startup.watch is not None and self.startup.watch.planned_gib is not None:
            metrics["memory/planned_peak_gib"] = self.startup.watch.planned_gib  # the doctor's memory check
        return metrics

    def log_samples(self, sampled: SampledGroups) -> None:
        """Every logging.sample_steps steps, the first group's completions with their rewards as
        a table (the main rank's; with tools, whole trajectories: turns and tool results)."""
        g, every = self.cfg.grpo, self.cfg.logging.sample_steps
        if not (self.topo.is_main and every and (self.step + 1) % every == 0):
            return
        shown = sampled.texts if self.stack.agent is None else [
            self.tokenizer.decode(c.token_ids) for c in sampled.completions[:g.num_generations]]
        table = samples_markdown(sampled.prompts[0].prompt, shown[:g.num_generations],
                                 sampled.rewards.total[:g.num_generations].tolist())
        self.metrics.text(self.step + 1, "samples", table)

    def sync_generator_weights(self, steps_done: int) -> float:
        """Stream the policy's weights (`steps_done` steps trained) into the generator of every rank
        that receives them whole (all ranks, or a pipeline's first stage); returns seconds taken.
        After the first sync, a LoRA policy sends only the weights it trains."""
        partial = self.generator_synced and not self.policy.trains_all_weights
        seconds = sync_weights(self.policy.full_tensors(changed_only=partial),
                               self.stack.generator if self.policy.holds_full_tensors else None, partial, steps_done)
        self.generator_synced = True
        return seconds

    # ---- evaluation and checkpoints -------------------------------------------------------------

    def evaluate(self) -> dict:
        """This rank's share of the held-out prompts through the generator, scored by the
        reward functions and the text metrics (see evaluation.py). Returns the global metrics."""
        records, metrics = evaluation.evaluate(self.stack, self.stack.eval_prompts, self.topo.dp_rank,
                                               self.topo.dp_size, self.topo.dp_group)
        if self.topo.is_main:
            evaluation.record_evaluation(self.cfg.output_dir, self.step, records, metrics)
        return metrics

    def trainer_state(self) -> checkpoint.TrainerState:
        """What a checkpoint of this run records now (and what a checkpoint must match to resume)."""
        return checkpoint.TrainerState(
            step=self.step, sampler=self.prompt_order.state_dict(),  # (the checkpoint's key for it)
            world_size=self.topo.world_size, dp_size=self.topo.dp_size, num_prompts=len(self.prompts),
            total_steps=self.total_steps, prompts_per_step=self.prompt_order.prompts_per_step,
            model=self.policy.base_model, layout=self.policy.layout())

    def resume(self) -> None:
        state = checkpoint.resume(self.policy, self.ckpt_root, self.cfg.checkpoint.resume, self.trainer_state(),
                                  self.topo, self.log)
        if state is not None:
            self.step = state["step"]
            self.metrics.resumed_at(self.step)  # what the killed attempt logged after it goes
            if self.doctor and os.path.isfile(os.path.join(self.cfg.output_dir, "metrics.jsonl")):
                self.doctor.replay(read_series(self.cfg.output_dir))  # its episodes of trouble stay open
            self.prompt_order.load_state_dict(state["sampler"])
            ahead = rollouts_ahead.load_rollouts_ahead(state, self.topo.rank, self.cfg.rollout.max_staleness)
            if self.stack.ahead is not None:
                self.stack.ahead.load_state(ahead)
            if self.cfg.grpo.sync_ref_model:
                self.policy.load_reference_state(checkpoint.load_reference(state, self.topo.rank))

    def save(self) -> None:
        reference = self.policy.reference_state() if self.cfg.grpo.sync_ref_model else None
        path = checkpoint.save(self.policy, self.ckpt_root, self.trainer_state(), self.cfg.checkpoint.keep_last,
                               self.topo, reference, self.stack.ahead.state() if self.stack.ahead is not None else None)
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
    p.add_argument("--timeout-minutes", type=float, default=30.0,
                   help="process-group timeout for collectives (default 30)")
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
                                generator_layout(cfg).ranks_per_group, p.sequence_parallel_size)
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
