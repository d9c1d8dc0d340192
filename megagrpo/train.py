"""The GRPO trainer: `python -m megagrpo.train --config X.yaml key.sub=value ...`.

Runs as one process, under `deepspeed --num_gpus N --module megagrpo.train`, or torchrun.
One step:
    prompts -> rollout (G completions each; multi-turn with tools: rollout/agent.py)
    -> rewards -> group advantages
    -> reference (and old-policy) logprobs -> mu passes of clipped, KL-penalised updates
    -> weight sync into the rollout engine -> metrics, checkpoint
The policy engine (policy/) hides the parallel layout: this loop is the same for all of them.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

import torch

from megagrpo import evaluation
from megagrpo.algorithm import grpo
from megagrpo.checkpoints import checkpoint
from megagrpo.cluster.distributed import all_gather_1d, init_distributed
from megagrpo.cluster.topology import Topology
from megagrpo.config.deepspeed_json import zero_stage
from megagrpo.validation import load_config
from megagrpo.config.loading import to_dict
from megagrpo.config.schema import Config, ConfigError
from megagrpo.data import DataError, Prompt, PromptSampler, load_prompts, record_prompts
from megagrpo.policy import build_policy, lora
from megagrpo.policy.models import load_tokenizer
from megagrpo.metrics import (
    MetricsLogger,
    PhaseClock,
    Progress,
    quiet_library_output,
    rollout_metrics,
    samples_markdown,
)
from megagrpo.rewards import (
    RewardError,
    build_reward_functions,
    close_reward_functions,
    component_metrics,
    compute_rewards,
)
from megagrpo.rollout.agent import AgentLoop, agent_metrics, answer_texts, completion_fields
from megagrpo.policy.batch import make_batch
from megagrpo.rollout.generators import build_generator, sampling_seed
from megagrpo.rollout.groups import SampledGroups, sample_informative_groups
from megagrpo.rollout.tools import Toolset
from megagrpo.rollout.weight_sync import sync_weights


class Trainer:
    def __init__(self, cfg: Config, topology: Topology):
        self.cfg, self.topo = cfg, topology
        g, data = cfg.grpo, cfg.data
        self.device = torch.device(f"cuda:{topology.local_rank}" if torch.cuda.is_available() else "cpu")
        self.log = lambda msg: print(f"[megagrpo] {msg}", flush=True) if topology.is_main else None
        self.tokenizer = load_tokenizer(cfg.model.name_or_path)
        model = cfg.model.name_or_path
        self.base_model = os.path.abspath(model) if os.path.isdir(model) else model  # as checkpoints record it
        self.adapter_config = lora.adapter_config(cfg.model.lora, self.base_model) if cfg.model.lora.r else None
        self.toolset = Toolset(cfg) if cfg.rollout.max_turns > 1 else None
        tools = self.toolset.schemas if self.toolset else None
        self.prompts, dropped = load_prompts(data.train_file, self.tokenizer, data.max_prompt_length,
                                             data.prompt_field, data.system_prompt, data.split, tools)
        self.log(f"{len(self.prompts)} training prompts; {dropped} dropped as longer than "
                 f"data.max_prompt_length={data.max_prompt_length}")
        self.eval_prompts = []
        if data.eval_file:
            self.eval_prompts, _ = load_prompts(data.eval_file, self.tokenizer, data.max_prompt_length,
                                                data.prompt_field, data.system_prompt, data.eval_split, tools)
        self.reward_functions = build_reward_functions(cfg.rewards.functions, cfg)
        completions_per_rank = g.per_device_train_batch_size * g.gradient_accumulation_steps
        self.sampler = PromptSampler(len(self.prompts), completions_per_rank // g.num_generations,
                                     topology.dp_rank, topology.dp_size, g.seed, data.shuffle)
        self.total_steps = g.max_steps if g.max_steps > 0 else max(
            1, math.ceil(g.num_train_epochs * self.sampler.steps_per_epoch))
        self.engine = build_policy(cfg, topology, self.total_steps)
        # every rank builds a rollout engine (vLLM's external launcher forms its groups over
        # all ranks); the first rank of each model group samples for the group
        self.rollout = build_generator(cfg, seed=g.seed + topology.dp_rank)
        self.agent = AgentLoop(cfg, self.rollout, self.tokenizer, self.toolset) if self.toolset else None
        self.metrics = MetricsLogger(cfg.output_dir, cfg.logging, topology.is_main, to_dict(cfg))
        self.ckpt_root = os.path.join(cfg.output_dir, "checkpoints")
        os.makedirs(cfg.output_dir, exist_ok=True)
        self.step = 0
        self.rollout_synced = False  # after the first sync only the weights a step changes move
        self.log(topology.describe())

    # ---- the run ------------------------------------------------------------------------------

    def train(self) -> dict:
        cfg = self.cfg
        self.resume()
        self.sync_rollout_weights()
        results = {}
        if self.eval_prompts and self.step == 0:
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
            if cfg.logging.eval_steps and self.step % cfg.logging.eval_steps == 0 and self.eval_prompts:
                self.metrics.scalars(self.step, {f"eval/{k}": v for k, v in self.evaluate().items()})
            if cfg.checkpoint.save_steps and self.step % cfg.checkpoint.save_steps == 0:
                self.save()
        progress.close()
        if not cfg.checkpoint.save_steps or self.step % cfg.checkpoint.save_steps != 0:
            self.save()
        if self.eval_prompts:
            results["after"] = self.evaluate()
            self.metrics.scalars(self.step, {f"eval/{k}": v for k, v in results["after"].items()})
            self.log(f"held-out after training: {evaluation.format_metrics(results['after'])}")
        if cfg.checkpoint.save_hf_at_end:
            self.export()
        if self.topo.is_main and results:
            evaluation.write_results(cfg.output_dir, results)
        close_reward_functions(self.reward_functions)
        if self.toolset:
            self.toolset.close()
        self.metrics.close()
        self.log(f"done: {self.step} steps. {self.metrics.how_to_watch()}")
        return results

    # ---- one GRPO step ------------------------------------------------------------------------

    def train_step(self) -> dict:
        g = self.cfg.grpo
        clock = PhaseClock()
        # rollout (G completions or multi-turn trajectories per prompt, with the sampler's
        # logprobs) and rewards; dynamic sampling: more rounds until the groups are informative
        if g.dynamic_sampling:
            sampled = sample_informative_groups(lambda r: self.sample_groups(r, clock), self.sampler.per_rank,
                                                g.max_sampling_rounds, self.topo.dp_group)
        else:
            sampled = self.sample_groups(0, clock)
        prompt_of, completions, texts = sampled.prompts, sampled.completions, sampled.texts
        rewards, per_function, details = sampled.rewards, sampled.per_function, sampled.details

        # group advantages (groups never leave their rank; batch std is global)
        global_rewards = all_gather_1d(rewards, self.topo.dp_group)
        advantages = grpo.group_advantages(rewards, g.num_generations, g.scale_rewards,
                                           batch_std=global_rewards.std())
        clock.lap("reward")

        batch = make_batch([p.token_ids for p in prompt_of], completions, advantages,
                           self.tokenizer.pad_token_id).to(self.device)
        if g.mask_truncated_completions:
            batch.completion_mask = batch.completion_mask * (~batch.truncated).unsqueeze(1).float()

        # reference and old-policy logprobs, over the same micro-batches as the update
        micro_batches = self.engine.micro_batches(batch)
        batch.ref_logp = self.engine.logprobs(batch, micro_batches, reference=True)
        if g.num_iterations > 1:
            batch.old_logp = self.engine.logprobs(batch, micro_batches)
        clock.lap("reference")

        # policy update: mu passes, one optimizer step each; a moving reference follows it
        metrics = self.engine.optimize(batch, micro_batches)
        if g.sync_ref_model and (self.step + 1) % g.ref_model_sync_steps == 0:
            self.engine.mix_reference(g.ref_model_mixup_alpha)
        clock.lap("train")

        self.sync_rollout_weights()
        clock.lap("weight_sync")
        if self.topo.is_main and self.cfg.logging.sample_steps and (self.step + 1) % self.cfg.logging.sample_steps == 0:
            shown = texts if self.agent is None else [  # whole trajectories: turns and tool results
                self.tokenizer.decode(c.token_ids) for c in completions[:g.num_generations]]
            table = samples_markdown(prompt_of[0].prompt, shown[:g.num_generations],
                                     rewards[:g.num_generations].tolist())
            self.metrics.text(self.step + 1, "samples", table)
        metrics.update(rollout_metrics(global_rewards, per_function, advantages, batch,
                                       [rf.name for rf in self.reward_functions], g.num_generations,
                                       sum(clock.seconds.values()), self.topo.dp_group))
        metrics.update(component_metrics(details, self.topo.dp_group))
        metrics.update(sampled.metrics)
        if self.agent is not None:
            metrics.update(agent_metrics(completions, self.agent.tool_wall_seconds, self.topo.dp_group))
        metrics.update(clock.metrics())
        return {k: float(v) for k, v in metrics.items()}

    def sample_groups(self, sampling_round: int, clock: PhaseClock) -> SampledGroups:
        """The next prompts of this rank, their groups sampled and scored."""
        g = self.cfg.grpo
        indices = self.sampler.next_indices()
        record_prompts(self.cfg.output_dir, self.step + 1, indices, sampling_round, self.topo)
        prompts = [self.prompts[i] for i in indices]
        groups = self.generate(prompts, n=g.num_generations,
                               seeds=[sampling_seed(g.seed, self.step, i, sampling_round) for i in indices])
        completions = [c for group in groups for c in group]
        prompt_of = [p for p in prompts for _ in range(g.num_generations)]
        clock.lap("rollout" if sampling_round == 0 else "resampling")
        texts = answer_texts(completions, self.tokenizer)
        rewards, per_function, details = self.score(prompt_of, texts, completions)
        clock.lap("reward" if sampling_round == 0 else "resampling")
        return SampledGroups(prompt_of, completions, texts, rewards, per_function, details, g.num_generations)

    def generate(self, prompts: list[Prompt], n, seeds, greedy=False):
        """Sample on the first rank of each model group (one engine call, or the multi-turn
        loop) and share its completions with the group, so that every rank trains on the same
        tokens."""
        groups = None
        if self.topo.samples_rollout:
            if self.agent is not None:
                groups = self.agent.generate(prompts, n=n, seeds=seeds, greedy=greedy)
            else:
                groups = self.rollout.generate([p.token_ids for p in prompts], n=n, seeds=seeds, greedy=greedy)
            self.rollout.sleep()
        if self.topo.model_group is not None:
            box = [groups]
            torch.distributed.broadcast_object_list(box, src=self.topo.model_group_source,
                                                    group=self.topo.model_group)
            groups = box[0]
        return groups

    def score(self, prompts: list[Prompt], texts: list[str], completions: list):
        """Weighted total and per-function rewards, and the details (components, reasons) of
        the rewards that give them."""
        fields = {key: [p.fields.get(key) for p in prompts] for key in prompts[0].fields}
        fields.update(completion_fields(completions, self.cfg.rollout.max_new_tokens))
        details = {}
        total, per_function = compute_rewards(self.reward_functions, [p.prompt for p in prompts], texts,
                                              fields, details)
        return total, per_function, details

    def sync_rollout_weights(self) -> float:
        """Stream the policy's weights into the rollout engine of every rank that receives them
        whole (all ranks, or a pipeline's first stage); returns seconds taken."""
        partial = self.rollout_synced and self.cfg.model.lora.r > 0
        seconds = sync_weights(self.engine.full_tensors(changed_only=partial),
                               self.rollout if self.engine.holds_full_tensors else None, partial)
        self.rollout_synced = True
        return seconds

    # ---- evaluation and checkpoints -------------------------------------------------------------

    def evaluate(self) -> dict:
        """This rank's share of the held-out prompts through the rollout engine, scored by the
        reward functions and the text metrics (see evaluation.py). Returns the global metrics."""
        indices = list(range(self.topo.dp_rank, len(self.eval_prompts), self.topo.dp_size))
        # only a sampling rank's engine is sure to hold the trained weights
        score = self.rollout.score if self.topo.samples_rollout else None
        records = evaluation.score_prompts(
            [self.eval_prompts[i] for i in indices], indices, self.generate, score, self.tokenizer,
            self.reward_functions, sorted(self.eval_prompts[0].fields), self.cfg.logging.eval_num_generations,
            self.cfg.data.reference_field, self.cfg.rollout.max_new_tokens, self.cfg.grpo.seed)
        records = evaluation.gather_records(records, self.topo.dp_group)
        metrics = evaluation.summarize(records, [rf.name for rf in self.reward_functions],
                                       self.cfg.logging.eval_num_generations,
                                       {rf.name: rf.pass_threshold for rf in self.reward_functions})
        if self.topo.is_main:
            evaluation.record_evaluation(self.cfg.output_dir, self.step, records, metrics)
        return metrics

    def resume(self) -> None:
        state = checkpoint.resume(self.engine.policy, self.ckpt_root, self.cfg.checkpoint.resume, self.topo,
                                  len(self.prompts), self.sampler.global_batch,
                                  zero_stage(self.cfg.deepspeed), self.log, lora.checkpoint_entry(self.cfg.model.lora))
        if state is not None:
            self.step = state["step"]
            self.sampler.load_state_dict(state["sampler"])
            if self.cfg.grpo.sync_ref_model:
                self.engine.load_reference_state(checkpoint.load_reference(state, self.topo.rank))

    def save(self) -> None:
        state = checkpoint.TrainerState(
            step=self.step, sampler=self.sampler.state_dict(), world_size=self.topo.world_size,
            dp_size=self.topo.dp_size, num_prompts=len(self.prompts), total_steps=self.total_steps,
            prompts_per_step=self.sampler.global_batch, model=self.base_model,
            layout={"tp": self.topo.tp_size, "pp": self.topo.pp_size, "zero_stage": zero_stage(self.cfg.deepspeed),
                    "dtype": self.cfg.model.dtype, "lora": lora.checkpoint_entry(self.cfg.model.lora)})
        reference = self.engine.reference_state() if self.cfg.grpo.sync_ref_model else None
        path = checkpoint.save(self.engine.policy, self.ckpt_root, state, self.cfg.checkpoint.keep_last,
                               self.topo.is_main, self.topo.rank, reference, self.adapter_config)
        self.log(f"checkpoint saved: {path}")

    def export(self) -> None:
        """output_dir/hf: the model as an HF folder (a LoRA policy's merged; its adapters also
        as a PEFT folder, output_dir/adapter)."""
        out = os.path.join(self.cfg.output_dir, "hf")
        checkpoint.export_hf(self.engine.policy.module, self.engine.full_tensors(), self.tokenizer, out,
                             self.topo.is_main)
        self.log(f"HF model written to {out}")
        if self.adapter_config:
            out = os.path.join(self.cfg.output_dir, "adapter")
            lora.write_adapter_folder(lora.adapter_tensors(self.engine.policy.module), self.adapter_config, out,
                                      self.topo.is_main)
            self.log(f"LoRA adapter written to {out}")


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
        cfg = load_config(args.config, args.overrides, planning=args.dry_run)
        if args.dry_run:
            from megagrpo.planning import format_plan, make_plan
            plan = make_plan(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except (ConfigError, DataError) as e:
        print(f"megagrpo: config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        if int(os.environ.get("RANK", "0")) == 0:
            print(format_plan(plan))
        return 0
    quiet_library_output()
    topology = init_distributed(args.timeout_minutes, cfg.parallel.tensor_parallel_size,
                                cfg.parallel.pipeline_parallel_size)
    try:
        Trainer(cfg, topology).train()
    except Exception as e:  # noqa: BLE001 - every failure must end this rank now
        if not isinstance(e, (DataError, RewardError, ConfigError)):
            traceback.print_exc()
        print(f"megagrpo: error on rank {topology.rank}: {e or type(e).__name__}", file=sys.stderr, flush=True)
        # other ranks may wait in a collective: exit without teardown so the launcher sees the
        # failure and stops them, instead of everyone hanging until the process-group timeout
        os._exit(1)
    torch.distributed.barrier()  # leave together (vLLM's exit hook tears its groups down)
    return 0


if __name__ == "__main__":
    sys.exit(main())
