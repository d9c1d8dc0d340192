"""A reward with spread on any text, for runs of random-weight models (whose completions a task
reward scores all zero, which leaves no advantage and no gradient): the share of distinct
characters in the completion."""


def distinct_characters(prompts, completions, **_) -> list[float]:
    return [len(set(text)) / max(len(text), 1) for text in completions]
