"""A reward function that is all noise, for the run doctor's reward-swing check: a fair coin per
completion, whatever it says, from a generator seeded by the call and the completion's place
(so a run gets the same coins whatever its model writes)."""
import itertools
import random

_calls = itertools.count()


def coin_flip(prompts, completions, **_) -> list[float]:
    call = next(_calls)
    return [float(random.Random(f"{call}:{i}").random() < 0.5) for i in range(len(completions))]
