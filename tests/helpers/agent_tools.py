"""Tools, an environment and scripted tool-call parsers for the multi-turn tests
(tests/test_rollout_agent.py, tests/helpers/agent_probe.py).

The scripted parsers stand in for the model's tool-calling skill: they read the model's real
turn and return calls through the real hermes parser, so that a tiny model that has never seen
a tool still makes multi-turn trajectories whose tool results the tests can predict."""
import time

from megagrpo.rollout.tools import hermes

BAD_CALLS = {  # what each bad call must produce in the tool message
    "parse": ('<tool_call>{"name": "lookup", "arguments": {"key": </tool_call>', "malformed tool call JSON"),
    "unknown_tool": ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "unknown tool 'nope'"),
    "bad_arguments": ('<tool_call>{"name": "lookup", "arguments": {"wrong": "x"}}</tool_call>',
                      "wrong arguments for lookup: missing argument(s) key"),
    "raised": ('<tool_call>{"name": "boom", "arguments": {}}</tool_call>', "boom raised RuntimeError: kaboom"),
    "timeout": ('<tool_call>{"name": "slow", "arguments": {"seconds": 30}}</tool_call>', "slow timed out after"),
    "environment_raised": ('<tool_call>{"name": "explode", "arguments": {}}</tool_call>',
                           "explode raised ValueError: the game refuses"),
    "python_error": ('<tool_call>{"name": "python", "arguments": {"code": "1/0"}}</tool_call>',
                     "ZeroDivisionError"),
}


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key
    """
    return f"value of {key}"


SLOW_STARTS: list[float] = []  # time.monotonic() at each call of `slow` (tools run in threads)


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long to sleep
    """
    SLOW_STARTS.append(time.monotonic())
    time.sleep(seconds)
    return "late"


def boom() -> str:
    """Always fails."""
    raise RuntimeError("kaboom")


class NumberGame:
    """Guess a number: each instance is one trajectory's game; get_reward reads its state."""

    created = closed_count = 0  # instances made and closed in this process

    def __init__(self):
        NumberGame.created += 1
        self.guesses = []
        self.secret = 5
        self.closed = False

    def reset(self, secret=5, **_):
        self.secret = int(secret)

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: the guess
        """
        self.guesses.append(number)
        return "correct" if number == self.secret else ("higher" if number < self.secret else "lower")

    def explode(self) -> str:
        """Always fails."""
        raise ValueError("the game refuses")

    def get_reward(self) -> float:
        return 1.0 if self.secret in self.guesses else 0.1 * len(self.guesses)

    def close(self):
        assert not self.closed, "closed twice"
        self.closed = True
        NumberGame.closed_count += 1


class BrokenGame(NumberGame):
    """A NumberGame whose reset raises for secret 1 and whose get_reward raises for secret 2
    (each episode must end scored 0 with its reason), and whose close raises for secret 3 (the
    episode keeps its reward)."""

    def reset(self, secret=5, **_):
        if int(secret) == 1:
            raise RuntimeError("no board for secret 1")
        super().reset(secret)

    def get_reward(self) -> float:
        if self.secret == 2:
            raise KeyError("score")
        return super().get_reward()

    def close(self):
        super().close()
        if self.secret == 3:
            raise OSError("the board would not close")


def expected_python_output(text: str) -> str:
    return f"{len(text) * 7}\n"


def python_call(text: str) -> str:
    return f'<tool_call>{{"name": "python", "arguments": {{"code": "print({len(text)} * 7)"}}}}</tool_call>'


def python_parser(text: str):
    """Every turn calls python with a program whose output the test predicts from the turn."""
    return hermes(python_call(text))


def every_call_parser(text: str):
    """Every turn makes each bad call, one good python call and one guess (the number is the
    turn's length mod 10)."""
    script = "".join(call for call, _ in BAD_CALLS.values())
    return hermes(script + python_call(text) + guess_call(text))


def guess_call(text: str) -> str:
    return f'<tool_call>{{"name": "guess", "arguments": {{"number": {len(text) % 10}}}}}</tool_call>'


def python_and_game_parser(text: str):
    """Every turn calls python and guesses (the resumed multi-turn run: a tool and an environment)."""
    return hermes(python_call(text) + guess_call(text))


def game_parser(text: str):
    """Every turn guesses the turn's length mod 10."""
    return hermes(guess_call(text))
