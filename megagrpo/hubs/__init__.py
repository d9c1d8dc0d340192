"""Environments from the hubs users already have, named in the config by hub and name:

    rollout.environment: textarena:GuessTheNumber-v0     # a TextArena game (the textarena extra)
    rollout.environment: verifiers:vf-arith              # a verifiers taskset (.venv-verifiers)

A TextArena name resolves to an environment class of megagrpo's own interface (rollout/tools.py:
its public methods are the model's tools; reset, get_reward, close), so the built-in
multi-turn loop runs it and the `environment` reward scores it. A verifiers taskset runs in
verifiers' own machinery, as an outside agent (hubs/verifiers.py). docs/environments.md lists
the hubs, and says why `openenv` environments are not adapted.
"""
from __future__ import annotations

import importlib
from typing import Optional

from megagrpo.config.schema import ConfigError

ADAPTED = {"textarena": "megagrpo.hubs.textarena"}
OUTSIDE_AGENT = {"verifiers"}  # hubs whose environments run as outside agents (rollout/outside_agents.py)
# hubs whose environments do not fit, and what to do instead (docs/environments.md)
NOT_ADAPTED = {
    "openenv": "OpenEnv's packages ship no environments (each is a server from the Hugging Face Hub, "
               "started by uv or Docker): wrap its client in a rollout.environment class, or run its agent "
               "as an outside agent (docs/environments.md)",
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
