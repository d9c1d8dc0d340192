"""Environments from the hubs users already have, named in the config by hub and name:

    rollout.environment: textarena:GuessTheNumber-v0     # a TextArena game (the textarena extra)

A hub name resolves to an environment class of megagrpo's own interface (rollout/tools.py:
its public methods are the model's tools; reset, get_reward, close), so the built-in
multi-turn loop runs it and the `environment` reward scores it. docs/environments.md lists the
hubs, and says why `verifiers` and `openenv` environments run another way.
"""
from __future__ import annotations

import importlib
from typing import Optional

from megagrpo.config.schema import ConfigError

ADAPTED = {"textarena": "megagrpo.hubs.textarena"}
# hubs whose environments do not fit in-process, and what to do instead (docs/environments.md)
NOT_ADAPTED = {
    "verifiers": "verifiers 0.4 makes every environment's model calls from a chat program of its own (a uv "
                 "script behind its interception server), and pins openai<3, which the agent frameworks "
                 "beside megagrpo (pydantic-ai, the OpenAI Agents SDK) do not allow: run the environment as "
                 "an outside agent (rollout.agent_command) from a venv of its own (docs/environments.md)",
    "openenv": "OpenEnv's packages ship no environments (each is a server from the Hugging Face Hub, "
               "started by uv or Docker): wrap its client in a rollout.environment class, or run its agent "
               "as an outside agent (docs/environments.md)",
}


def hub_of(name: str) -> Optional[str]:
    """The hub a rollout.environment value names ('textarena:Wordle-v0' -> 'textarena'), or None
    for a module:Class path."""
    prefix = name.split(":", 1)[0]
    return prefix if prefix in ADAPTED or prefix in NOT_ADAPTED else None


def hub_environment(name: str) -> type:
    """The environment class for `hub:environment`, or a one-line ConfigError naming the fix."""
    hub, _, environment = name.partition(":")
    if hub in NOT_ADAPTED:
        raise ConfigError(f"rollout.environment: '{name}': {NOT_ADAPTED[hub]}")
    if not environment:
        raise ConfigError(f"rollout.environment: '{name}' names no environment after '{hub}:'")
    return importlib.import_module(ADAPTED[hub]).environment_class(environment)
