"""Multi-turn rollout throughput: trajectories/s and model tokens/s of the agent loop at 1, 2 and
4 turns against single-turn generation, same model, same prompts, same engine, side by side in
one process; and the share of the time spent in tools (the sandboxed `python` tool).

    python bench/agentic_rollout.py --model runs/agent/warm --prompts runs/agent/data/train.jsonl

Every turn calls `python` (a bench parser asks for `print(<turn length> * 7)` whatever the model
wrote), so a trajectory runs to max_turns unless a turn is cut at max_new_tokens. The model is
the agentic quickstart's warm-started one (AGENT=1 bash launch/quickstart.sh), whose turns end
with EOS. "4 turns, no prefix cache" repeats the longest case with vLLM's prefix caching off.
Prints a table, writes JSON.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megagrpo.cluster.distributed import init_distributed
from megagrpo.config.schema import Config, DataConfig, ModelConfig, RolloutConfig, ToolConfig, max_sequence_length
from megagrpo.data import load_prompts
from megagrpo.policy.models import load_tokenizer
from megagrpo.rollout import tools
from megagrpo.rollout.agent import AgentLoop
from megagrpo.rollout.generator_group import GeneratorGroup
from megagrpo.rollout.generators import VLLMGenerator


def force_python(text: str):
    return tools.hermes('<tool_call>{"name": "python", "arguments": {"code": "print(%d * 7)"}}</tool_call>'
                        % len(text))


tools.PARSERS["bench_force_python"] = force_python


def config(args, max_turns: int) -> Config:
    return Config(model=ModelConfig(name_or_path=args.model, dtype="float32"),
                  data=DataConfig(train_file=args.prompts, max_prompt_length=64),
                  rollout=RolloutConfig(max_new_tokens=args.max_new_tokens, max_turns=max_turns,
                                        tools=[ToolConfig("python")], tool_call_parser="bench_force_python",
                                        max_tool_response_tokens=32, tool_workers=args.tool_workers,
                                        cpu_kv_cache_gb=0.5))


def measure(generate, prompts, n, repeats, loop=None):
    generate(prompts[:2], 2, [0, 1])  # warm-up
    trajectories = model_tokens = turns = 0
    tool_seconds, start = 0.0, time.perf_counter()
    for r in range(repeats):
        groups = generate(prompts, n, [r * 1000 + i for i in range(len(prompts))])
        done = [c for g in groups for c in g]
        trajectories += len(done)
        model_tokens += sum(len(c.token_ids) if c.model_mask is None else sum(c.model_mask) for c in done)
        turns += sum(getattr(c, "turns", 1) for c in done)
        tool_seconds += loop.tool_wall_seconds if loop else 0.0
    seconds = time.perf_counter() - start
    return {"trajectories": trajectories, "model_tokens": model_tokens, "mean_turns": turns / trajectories,
            "seconds": seconds, "trajectories_per_s": trajectories / seconds,
            "model_tokens_per_s": model_tokens / seconds, "tool_share": tool_seconds / seconds}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--tool-workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="bench/results/agentic_rollout.json")
    args = p.parse_args()

    init_distributed()
    tokenizer = load_tokenizer(args.model)
    base = config(args, 4)
    toolset = tools.Toolset(base)
    prompts, _ = load_prompts(args.prompts, tokenizer, 64, tools=toolset.schemas)
    prompts = prompts[:args.num_prompts]
    results = {}
    engine = VLLMGenerator(base, args.model, seed=0)  # prefix caching on (max_turns > 1)

    def single_turn(chosen, n, seeds):
        return engine.generate([pr.token_ids for pr in chosen], n=n, seeds=seeds)

    results["single-turn"] = measure(single_turn, prompts, args.num_generations, args.repeats)
    for turns in (1, 2, 4):
        loop = AgentLoop(config(args, turns), GeneratorGroup.of_one(engine), tokenizer, toolset)
        results[f"{turns} turns"] = measure(lambda c, n, s: loop.generate(c, n, s), prompts,
                                            args.num_generations, args.repeats, loop)
    del engine
    cold = config(args, 4)
    cold.rollout.max_model_len = max_sequence_length(base)
    cold.rollout.max_turns = 1  # an engine without prefix caching; the loop below still runs 4 turns
    engine = VLLMGenerator(cold, args.model, seed=0)
    loop = AgentLoop(config(args, 4), GeneratorGroup.of_one(engine), tokenizer, toolset)
    results["4 turns, no prefix cache"] = measure(lambda c, n, s: loop.generate(c, n, s), prompts,
                                                  args.num_generations, args.repeats, loop)
    toolset.close()
    single = results["single-turn"]
    print(f"\n{'rollout':<26}{'turns':>7}{'traj/s':>9}{'x single':>10}{'tok/s':>9}{'x single':>10}{'in tools':>10}")
    for name, r in results.items():
        r["trajectories_per_s_vs_single"] = r["trajectories_per_s"] / single["trajectories_per_s"]
        r["model_tokens_per_s_vs_single"] = r["model_tokens_per_s"] / single["model_tokens_per_s"]
        print(f"{name:<26}{r['mean_turns']:>7.2f}{r['trajectories_per_s']:>9.1f}"
              f"{r['trajectories_per_s_vs_single']:>10.2f}{r['model_tokens_per_s']:>9.0f}"
              f"{r['model_tokens_per_s_vs_single']:>10.2f}{100 * r['tool_share']:>9.0f}%")
    results["setup"] = vars(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
