"""TextArena's single-player games as a megagrpo environment (the `textarena` extra):

    rollout.environment: textarena:GuessTheNumber-v0
    rewards: [{name: environment}]

The game is the trajectory's environment. Its prompt is the game's opening board for the row's
seed (tools/prepare_data.py --textarena GAME writes the rows), and reset(seed) builds the same
board. The model plays with one tool, `move(action)`, whose result is the game's answer to
that move. When the game ends, get_reward() is TextArena's own score for player 0 (1 for a
win; a game's partial credit where it gives one; 0 for a game left unfinished).

TextArena draws its boards (and some games' later moves) from Python's process-wide `random`.
Each game therefore keeps its own generator state and runs under one lock, so episodes that
play at once in the tool threads still replay exactly from their seeds.
"""
from __future__ import annotations

import random
import threading

from megagrpo.config.schema import ConfigError

_RANDOM = threading.Lock()  # TextArena's games share Python's global `random`


def _textarena():
    try:
        import textarena
    except ImportError:
        raise ConfigError("rollout.environment: textarena games need the textarena package: pip install -e "
                          "'.[textarena]' (or MEGAGRPO_EXTRAS=textarena bash launch/install.sh)") from None
    return textarena


def _latest(observation) -> str:
    """The game's last message, without the history TextArena repeats in every observation."""
    return str(observation).split("[GAME]")[-1].strip()


def opening(game: str, seed: int) -> str:
    """The board a game opens with for `seed`: the prompt of a data row."""
    board = _Game(game, seed)
    board.env.close()
    return board.opening


class _Game:
    """One seeded game of player 0, with its own state of `random`."""

    def __init__(self, game: str, seed: int):
        ta = _textarena()
        with _RANDOM:
            saved = random.getstate()
            random.seed(seed)
            try:
                self.env = ta.make(env_id=game)
                self.env.reset(num_players=1)
                self.opening = str(self.env.get_observation()[1]).strip()
                self.state = random.getstate()
            finally:
                random.setstate(saved)

    def step(self, action: str) -> bool:
        with _RANDOM:
            saved = random.getstate()
            random.setstate(self.state)
            try:
                done, _ = self.env.step(action)
                self.state = random.getstate()
            finally:
                random.setstate(saved)
        return bool(done)


def environment_class(game: str) -> type:
    """The environment class of TextArena game `game`, checked by opening one board (a
    one-line ConfigError for a game TextArena does not have, or one that cannot start here)."""
    _textarena()  # a one-line error where the extra is not installed
    from textarena.envs.registration import ENV_REGISTRY
    if game not in ENV_REGISTRY:
        near = sorted(g for g in ENV_REGISTRY if g.split("-")[0].lower() == game.split("-")[0].lower())
        raise ConfigError(f"rollout.environment: textarena has no game '{game}'"
                          + (f"; did you mean {', '.join(near[:5])}?" if near else
                             "; textarena.envs.registration.ENV_REGISTRY lists its games"))
    try:
        opening(game, 0)
    except Exception as e:  # noqa: BLE001 - the game's own failure, named
        raise ConfigError(f"rollout.environment: textarena game '{game}' cannot start here: "
                          f"{type(e).__name__}: {e}") from None

    class TextArenaGame:
        __doc__ = f"TextArena's {game}, played by the model through its `move` tool."
        name = game

        def reset(self, seed: int = 0, **_fields):
            self.game, self.done, self.reason = _Game(game, int(seed)), False, ""

        def move(self, action: str) -> str:
            """Make your next move in the game.

            Args:
                action: your move, written as the game's rules ask (for example a guess in square brackets, [7])
            """
            if self.done:
                return f"The game is over: {self.reason}"
            self.done = self.game.step(action)
            if self.done:
                info = self.game.env.state.game_info.get(0, {})
                self.reason = str(info.get("reason", "the game ended"))
                return f"The game is over: {self.reason}"
            return _latest(self.game.env.get_observation()[1])

        def get_reward(self) -> float:
            if not self.done:
                return 0.0
            return float((self.game.env.state.rewards or {}).get(0, 0.0))

        def close(self):
            self.game.env.close()

    return TextArenaGame
