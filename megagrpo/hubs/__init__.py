"""Environments from the hubs users already have, named in the config by hub and name:

    rollout.environment: textarena:GuessTheNumber-v0     # a TextArena game (the textarena extra)
    rollout.environment: verifiers:vf-arith              # a verifiers taskset (.venv-verifiers)

A TextArena name resolves to an environment class of megagrpo's own interface (rollout/tools.py:
its public methods are the model's tools; reset, get_reward, close), so the built-in
multi-turn loop runs it and the `environment` reward scores it. A verifiers taskset runs in
verifiers' own machinery, as an outside agent (hubs/verifiers.py); so does an OpenEnv server,
through verifiers' openenv taskset. docs/environments.md lists the hubs.
"""
from __future__ import annotations

import importlib
from typing import Optional

from megagrpo.config.schema import ConfigError

ADAPTED = {"textarena": "megagrpo.hubs.textarena"}
OUTSIDE_AGENT = {"verifiers"}  # hubs whose environments run as outside agents (rollout/outside_agents.py)
# hub names that are not a way in themselves, and the way in (docs/environments.md)
NOT_ADAPTED = {
    "openenv": "OpenEnv environments are servers; megagrpo drives them through verifiers' openenv taskset: "
               "rollout.environment: verifiers:openenv, with rollout.environment_config {taskset: {base_url: "
               "http://HOST:PORT}} (docs/environments.md)",
}


def hub_of(name: str) -> Optional[str]:
    """The hub a rollout.environment value names ('textarena:Wordle-v0' -> 'textarena'), or None
    for a module:Class path."""
    prefix = name.split(":", 1)[0]
    return prefix if prefix in ADAPTED or prefix in OUTSIDE_AGENT or prefix in NOT_ADAPTED else None


def runs_as_outside_agent(name: Optional[str]) -> bool:
    """Whether a rollout.environment value is a hub's environment that runs as an outside agent."""
    return bool(name) and hub_of(name) in OUTSIDE_AGENT


def hub_environment(name: str) -> type:
    """The environment class for `hub:environment`, or a one-line ConfigError naming the fix."""
    hub, _, environment = name.partition(":")
    if hub in NOT_ADAPTED:
        raise ConfigError(f"rollout.environment: '{name}': {NOT_ADAPTED[hub]}")
    if hub in OUTSIDE_AGENT:
        raise ConfigError(f"rollout.environment: '{name}' runs as an outside agent, not in the built-in loop")
    if not environment:
        raise ConfigError(f"rollout.environment: '{name}' names no environment after '{hub}:'")
    return importlib.import_module(ADAPTED[hub]).environment_class(environment)
