"""Probe for test_rollout_agent.py: multi-turn GRPO steps through the real trainer, vLLM and sandbox,
with a record of every engine call. Writes agent_rank<r>.json to output_dir:
- steps: each step's metrics (after `--steps` training steps, each followed by a weight sync);
- calls: every rollout-engine call of a last rollout, its inputs and what it returned;
- rows: that rollout's trajectories as the trainer's batch holds them (prompt ids, completion
  ids, mask), with their messages, ending, errors and environment reward;
- logprobs: the trainer's log-probs of those rows next to vLLM's sampling log-probs.

    python tests/helpers/agent_probe.py --config X.yaml key=value ...          # one rank
    deepspeed --num_gpus 2 tests/helpers/agent_probe.py --config X.yaml ...    # two ranks
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import agent_tools

from megagrpo.cluster.distributed import init_distributed
from megagrpo.cluster.generator_layout import generator_layout
from megagrpo.policy.batch import make_batch
from megagrpo.process_exit import exit_without_teardown
from megagrpo.rollout.generators import sampling_seed
from megagrpo.train import Trainer, parse_args
from megagrpo.validation import load_config


def main():
    args, steps = parse_args(), int(os.environ.get("PROBE_STEPS", "1"))
    cfg = load_config(args.config, args.overrides)
    topology = init_distributed(tp_size=cfg.parallel.tensor_parallel_size,
                                generator_tp=generator_layout(cfg).ranks_per_group)
    trainer = Trainer(cfg, topology)
    trainer.sync_generator_weights(trainer.step)
    metrics = []
    for _ in range(steps):
        metrics.append(trainer.train_step())
        trainer.step += 1

    calls, generate = [], trainer.stack.generator.generate

    def recording_generate(prompt_ids, n, seeds, greedy=False, max_tokens=None):
        out = generate(prompt_ids, n=n, seeds=seeds, greedy=greedy, max_tokens=max_tokens)
        calls.append({"inputs": prompt_ids, "outputs": [[{"ids": c.token_ids, "logprobs": c.logprobs}
                                                         for c in group] for group in out]})
        return out

    trainer.stack.generator.generate = recording_generate
    created_before, closed_before = agent_tools.NumberGame.created, agent_tools.NumberGame.closed_count
    indices = trainer.prompt_order.next_indices()
    prompts = [trainer.prompts[i] for i in indices]
    n = cfg.grpo.num_generations
    groups = trainer.stack.generate(prompts, n, [sampling_seed(cfg.grpo.seed, trainer.step, i) for i in indices])
    trajectories = [t for group in groups for t in group]
    # an outside agent's episode has its own first request as its prompt
    rows = [p for p in prompts for _ in range(n)]
    batch = make_batch([t.prompt_ids or p.token_ids for p, t in zip(rows, trajectories)], trajectories,
                       torch.zeros(len(trajectories)), trainer.tokenizer.pad_token_id)
    trainer.policy.engine.eval()
    with torch.no_grad():
        trainer_logp = trainer.policy.logprobs(batch, trainer.policy.micro_batches(batch))
    prompt_ids, completion_ids = batch.sequences()
    rows = [{"prompt": p, "completion": c, "mask": batch.completion_mask[i, :len(c)].tolist(),
             "messages": t.messages, "ended_by": t.ended_by, "turns": t.turns, "tool_calls": t.tool_calls,
             "tool_errors": t.tool_errors, "environment_reward": t.environment_reward,
             "agent_reward": t.agent_reward, "failure": t.failure, "prefix_mismatches": t.prefix_mismatches,
             "trainer_logp": trainer_logp[i, :len(c)].tolist(), "sampler_logp": batch.sampler_logp[i, :len(c)].tolist()}
            for i, (p, c, t) in enumerate(zip(prompt_ids, completion_ids, trajectories))]
    result = {"steps": metrics, "calls": calls if topology.samples_rollout else [], "rows": rows,
              "environments_created": agent_tools.NumberGame.created - created_before,
              "environments_closed": agent_tools.NumberGame.closed_count - closed_before,
              "samples_rollout": topology.samples_rollout}
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, f"agent_rank{topology.rank}.json"), "w") as f:
        json.dump(result, f)
    if trainer.stack.toolset:
        trainer.stack.toolset.close()
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # the interpreter's teardown costs seconds a rank
