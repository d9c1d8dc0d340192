"""A reward function that is all noise, for the run doctor's reward-swing check: a coin flip per
completion, whatever it says (seeded by the text and a counter, so a run is reproducible)."""
import hashlib
import itertools

_calls = itertools.count()


def coin_flip(prompts, completions, **_) -> list[float]:
    call = next(_calls)
    return [float(hashlib.sha256(f"{call}:{i}:{text}".encode()).digest()[0] & 1) for i, text in enumerate(completions)]
