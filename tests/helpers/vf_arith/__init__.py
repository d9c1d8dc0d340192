"""A verifiers environment, written against verifiers' own API as an environment package on its
Environments Hub is (tests/test_hubs.py runs it from .venv-verifiers): two additions in the tiny
model's format, the second asked as the user's next turn once the model has answered the first.
The reward is the share of the two answered right ("Answer: N", the tiny model's format). With
`--env.taskset.turns 1` only the first is asked; with `--env.taskset.fail` set, every
episode's run raises, as a broken environment does.

Taskset id: vf-arith (this module, on PYTHONPATH)."""
import itertools
import random

import verifiers.v1 as vf


def stated(reply: str) -> str:
    """The answer a reply states: what follows its last "Answer:" (the tiny model's format)."""
    return reply.rsplit("Answer:", 1)[-1].strip() if "Answer:" in reply else ""


class ArithData(vf.TaskData):
    follow_up: str
    answers: list[str]


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    pass


class ArithConfig(vf.TasksetConfig):
    seed: int = 0
    turns: int = 2  # 1: only the first question (the tiny quickstart's task, asked through verifiers)
    fail: bool = False


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    INFINITE = True

    def load(self):
        rng = random.Random(self.config.seed)
        for i in itertools.count():
            a, b, c, d = (rng.randint(0, 9) for _ in range(4))
            yield ArithTask(ArithData(name=f"vf-arith#{i}", prompt=f"What is {a} + {b}?",
                                      follow_up=f"What is {c} + {d}?", answers=[str(a + b), str(c + d)]),
                            self.config.task)


class ArithEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class ArithEnv(vf.Env[ArithEnvConfig]):
    async def run(self, task, agents):
        if self.taskset.config.fail:
            raise RuntimeError("vf-arith was told to fail")
        turns, replies = self.taskset.config.turns, []
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            if not segment.terminated:
                replies.append(segment.last_reply)
                if turns > 1:
                    segment = await interaction.turn(task.data.follow_up)
                    if not segment.terminated:
                        replies.append(segment.last_reply)
        right = sum(stated(reply) == answer for answer, reply in zip(task.data.answers, replies))
        interaction.trace.record_reward("right", right / turns, 1.0)


__all__ = ["ArithTaskset", "ArithEnv"]
