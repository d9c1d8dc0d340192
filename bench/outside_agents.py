"""Agents through the OpenAI-compatible endpoint (rollout/outside_agents.py), against the
built-in multi-turn loop on the same vLLM engine, side by side in one process:

  - the endpoint's overhead per request: one request at a time through the `openai` SDK (the
    HTTP round trip, the episode's bookkeeping, the batcher) against the same prompt ids and
    seed handed to the engine directly, which sample the same tokens (medians);
  - episodes per second with 64 agents at once (8 prompts x 8), each making 3 model calls,
    against the built-in loop's trajectories per second at 3 turns.

    python bench/outside_agents.py --model runs/agent/warm --prompts runs/agent/data/train.jsonl

The agent is tests/helpers/openai_tool_agent.py (the `openai` SDK; it runs its own arithmetic
`python` tool, which the built-in loop runs too, as a function tool). Every turn calls python (a
bench parser reads `print(<turn length> * 7)` into each turn, for the endpoint's replies and the
built-in loop alike), so every episode makes 3 calls. The model is the agentic quickstart's warm
start (AGENT=1 bash launch/quickstart.sh).
Prints a table, writes JSON.
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from agentic_rollout import force_python  # noqa: E402,F401 (registers the bench parser, bench_force_python)

from megagrpo.cluster.distributed import init_distributed  # noqa: E402
from megagrpo.config.schema import Config, DataConfig, ModelConfig, RolloutConfig, ToolConfig  # noqa: E402
from megagrpo.data import load_prompts  # noqa: E402
from megagrpo.policy.models import load_tokenizer  # noqa: E402
from megagrpo.rollout import tools  # noqa: E402
from megagrpo.rollout.agent import AgentLoop, turn_seed  # noqa: E402
from megagrpo.rollout.episodes import Episode  # noqa: E402
from megagrpo.rollout.generator_group import GeneratorGroup  # noqa: E402
from megagrpo.rollout.generators import VLLMGenerator  # noqa: E402
from megagrpo.rollout.outside_agents import OutsideAgents  # noqa: E402


def config(args, **rollout) -> Config:
    return Config(model=ModelConfig(name_or_path=args.model, dtype="float32"),
                  data=DataConfig(train_file=args.prompts, max_prompt_length=64),
                  rollout=RolloutConfig(max_new_tokens=args.max_new_tokens, max_turns=3,
                                        tool_call_parser="bench_force_python", max_tool_response_tokens=32,
                                        cpu_kv_cache_gb=0.5, **rollout))


def per_request(agents: OutsideAgents, engine, prompt_ids: list[int], repeats: int) -> dict:
    """Seconds of one request through the endpoint against the engine called directly: the same
    prompt ids (the completions route takes them as they are) and the same seed, so both sample
    the same tokens; medians over `repeats`."""
    import openai

    direct, endpoint, same = [], [], True
    for r in range(repeats):
        start = time.perf_counter()
        out = engine.generate([prompt_ids], n=1, seeds=[turn_seed(r, 0)], max_tokens=[agents.cfg.max_new_tokens])
        direct.append(time.perf_counter() - start)
        episode = Episode(key=f"bench{r}", seed=r, task={})
        agents.endpoint.episodes[episode.key] = episode
        # an agent makes its client once: its construction is not part of a request
        client = openai.OpenAI(base_url=agents.endpoint.url(episode.key), api_key="-", max_retries=0)
        start = time.perf_counter()
        client.completions.create(model="policy", prompt=prompt_ids, max_tokens=agents.cfg.max_new_tokens)
        endpoint.append(time.perf_counter() - start)
        same &= episode.token_ids == out[0][0].token_ids
    return {"direct_ms": 1000 * statistics.median(direct), "endpoint_ms": 1000 * statistics.median(endpoint),
            "overhead_ms": 1000 * (statistics.median(endpoint) - statistics.median(direct)), "same_tokens": same}


def throughput(generate, prompts, n: int, repeats: int) -> tuple[dict, list]:
    """Episodes per second over `repeats` rounds, and the last round's episodes."""
    generate(prompts[:2], 2, [0, 1])  # warm-up
    done, calls, start = 0, 0, time.perf_counter()
    for r in range(repeats):
        groups = generate(prompts, n, [r * 1000 + i for i in range(len(prompts))])
        episodes = [t for g in groups for t in g]
        done += len(episodes)
        calls += sum(t.turns for t in episodes)
    seconds = time.perf_counter() - start
    return {"episodes": done, "seconds": seconds, "episodes_per_s": done / seconds,
            "calls_per_episode": calls / done}, episodes


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=8, help="x num-prompts = agents at once (64)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/outside_agents.json")
    args = p.parse_args()

    init_distributed()
    tokenizer = load_tokenizer(args.model)
    # the built-in loop runs the agent's own tool, as a function tool: the same work on both sides
    builtin_cfg = config(args, tools=[ToolConfig("openai_tool_agent:python")])
    toolset = tools.Toolset(builtin_cfg)
    prompts = load_prompts(args.prompts, tokenizer, 64, tools=toolset.schemas)[0][:args.num_prompts]
    engine = VLLMGenerator(builtin_cfg, args.model, seed=0)
    outside_cfg = config(args, agent="openai_tool_agent:solve")
    agents = OutsideAgents(outside_cfg, engine, tokenizer, log=lambda line: print(line, flush=True))
    results = {"per_request": per_request(agents, engine, prompts[0].token_ids, 4 * args.repeats)}
    loop = AgentLoop(builtin_cfg, GeneratorGroup.of_one(engine), tokenizer, toolset)
    results["built-in loop"], _ = throughput(lambda c, n, s: loop.generate(c, n, s), prompts, args.num_generations,
                                             args.repeats)
    outside, episodes = throughput(lambda c, n, s: agents.generate(c, n, s), prompts, args.num_generations,
                                   args.repeats)
    outside["last repeat"] = agents.metrics(episodes)  # where an episode's time went
    results["endpoint + openai SDK agents"] = outside
    toolset.close()
    agents.close()
    r = results["per_request"]
    print(f"\none request (the same tokens: {r['same_tokens']}): engine directly {r['direct_ms']:.1f} ms, "
          f"through the endpoint {r['endpoint_ms']:.1f} ms (overhead {r['overhead_ms']:.1f} ms)")
    base = results["built-in loop"]["episodes_per_s"]
    print(f"{'rollout':<32}{'calls/episode':>14}{'episodes/s':>12}{'x built-in':>12}")
    for name in ("built-in loop", "endpoint + openai SDK agents"):
        row = results[name]
        row["vs_builtin"] = row["episodes_per_s"] / base
        print(f"{name:<32}{row['calls_per_episode']:>14.2f}{row['episodes_per_s']:>12.1f}{row['vs_builtin']:>12.2f}")
    last = results["endpoint + openai SDK agents"]["last repeat"]
    print(f"an episode through the endpoint (last repeat): {last['agent/seconds_in_model']:.2f} s waiting on the "
          f"generator, {last['agent/seconds_in_agent']:.2f} s in the agent; largest generator call "
          f"{last['agent/requests_per_generator_call_max']:.0f} requests")
    results["setup"] = vars(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
