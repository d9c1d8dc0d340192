"""Runs a verifiers environment's episodes for megagrpo, in the venv that holds verifiers and the
environment's package (launch/install_hub.sh verifiers makes .venv-verifiers). It imports
nothing of megagrpo: verifiers pins openai<3, which megagrpo's own venv does not keep.

    python megagrpo/hubs/verifiers_runner.py serve '<env config JSON>'
    python megagrpo/hubs/verifiers_runner.py rows '<env config JSON>' COUNT [SKIP]

serve: loads the environment once, holds its serving resources (verifiers' interception server,
shared tool servers), prints {"ready": ...}, then reads one request per line on stdin,
{"id", "task", "base_url", "model"}, and runs each as one episode with verifiers' own
machinery, all at once on one event loop. Every model call of an episode goes to its base_url:
megagrpo's OpenAI-compatible endpoint, whose per-episode key is in the URL, so the calls come
back to the trainer as the tokens the generator sampled. Each episode's answer is a line
{"id", "reward", "error", "turns"} on stdout, in the order they end.

rows: prints the data of the environment's tasks SKIP .. SKIP + COUNT - 1, one JSON object a line,
for tools/prepare_data.py --verifiers.
"""
import asyncio
import itertools
import json
import os
import sys

# run as a script, its folder comes first on sys.path, and megagrpo/hubs/verifiers.py (and
# textarena.py) would shadow the packages of those names
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

# where megagrpo's endpoint is: each episode gets its own base URL, so the key is not a secret
API_KEY_VARIABLE = "MEGAGRPO_VERIFIERS_UNUSED_KEY"


# each agent role's defaults where the config names none: verifiers' plain chat loop, run as a
# local process (verifiers' own defaults, the bash harness on the prime runtime, need its cloud)
LOCAL_AGENT = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}


def load_env(env_config: dict):
    """The environment megagrpo's rollout.environment_config describes (verifiers' EnvConfig as a
    mapping, the taskset's id in it), every agent role defaulting to LOCAL_AGENT."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.utils.loaders import env_config_type, load_environment, resolve_env_config

    config = env_config  # this process's own copy, parsed from its command line
    config_type = env_config_type(config["taskset"]["id"], config.get("id") or "")
    for name, field in config_type.model_fields.items():
        if isinstance(field.default, AgentConfig):
            role = config.setdefault(name, {})
            for key, default in LOCAL_AGENT.items():
                role.setdefault(key, default)
    return load_environment(resolve_env_config(config))


def task_of(env, data: dict):
    """The environment's Task for one row's task data, built as verifiers' own env server does."""
    task_type = type(env.taskset).task_type()
    return task_type(task_type.data_type().model_validate(data), env.config.taskset.task)


def outcome(episode) -> dict:
    """An ended episode as megagrpo reads it: its traces' mean reward, and its first error."""
    traces = list(episode.traces)
    errors = [f"{e.type}: {e.message}" for e in episode.errors]
    errors += [f"{e.type}: {e.message}" for trace in traces for e in trace.errors]
    reward = sum(trace.reward for trace in traces) / len(traces) if traces else 0.0
    return {"reward": float(reward), "error": errors[0][:500] if errors else "",
            "turns": sum(trace.num_turns for trace in traces) if traces else 0}


async def serve(env_config: dict) -> None:
    from verifiers.v1.clients import ModelContext
    from verifiers.v1.configs.client import EvalClientConfig

    env = load_env(env_config)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    running: set = set()

    def answer(message: dict) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    async def episode(request: dict) -> None:
        try:
            ctx = ModelContext(model=request["model"], client=EvalClientConfig(
                base_url=request["base_url"], api_key_var=API_KEY_VARIABLE))
            (slot,) = env.slots(task_of(env, request["task"]))
            answer({"id": request["id"], **outcome(await env.run_slot(slot, ctx))})
        except Exception as e:  # the episode's own failure: megagrpo scores it 0 with the reason
            answer({"id": request["id"], "reward": 0.0, "error": f"{type(e).__name__}: {e}"[:500], "turns": 0})

    async with env.serving():
        answer({"ready": type(env).__name__, "taskset": type(env.taskset).__name__})
        while line := await reader.readline():
            task = asyncio.ensure_future(episode(json.loads(line)))
            running.add(task)
            task.add_done_callback(running.discard)
        for task in list(running):  # stdin closed: megagrpo is done with this runner
            task.cancel()


def rows(env_config: dict, count: int, skip: int) -> None:
    env = load_env(env_config)
    for task in itertools.islice(env.taskset, skip, skip + count):
        sys.stdout.write(json.dumps(task.data.model_dump(mode="json", exclude_defaults=True)) + "\n")


def main(argv: list) -> int:
    if len(argv) < 2 or argv[0] not in ("serve", "rows"):
        sys.stderr.write(__doc__)
        return 2
    env_config = json.loads(argv[1])
    if argv[0] == "serve":
        asyncio.run(serve(env_config))
    else:
        rows(env_config, int(argv[2]), int(argv[3]) if len(argv) > 3 else 0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
