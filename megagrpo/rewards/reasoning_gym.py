"""The `reasoning_gym` reward: a reasoning-gym task's own scorer on the completion's final answer.

reasoning-gym (PyPI) generates over 100 kinds of tasks procedurally, each with a scorer
(`dataset.score_answer(answer, entry)`, 0 to 1) that nobody here wrote. `tools/prepare_data.py
--reasoning-gym TASK` writes rows that carry the task's entry as JSON in the `reasoning_gym`
field; this reward extracts the final answer from each completion (`extract_answer`, the rule
below) and hands that text, and only that text, to the task's scorer.

A completion is hostile input (docs/data-and-rewards.md): the scorer sees the extracted text
only, bounded in length; a scorer that raises scores 0 and says why; tasks whose scorers
evaluate the answer as code (Python `eval`/`exec`, sympy's `parse_expr`, which calls `eval`) are
refused by name: by tools/prepare_data.py when it would write their rows, and here on the first
call that meets one, before anything is scored.
"""
from __future__ import annotations

import functools
import json
import re

from megagrpo.rewards import Scores

# reasoning-gym 0.1.25's scorers that run the answer text as code: `eval` (string_insertion,
# spiral_matrix, binary_matrix, n_queens), `exec` (codeio), sympy's parse_expr/sympify (the
# integration, polynomial, geometry and number-game tasks). A policy that learns to write
# `__import__('os').system(...)` as its answer would run it in the trainer.
UNSAFE_TASKS = {
    "advanced_geometry": "sympy", "binary_matrix": "eval", "codeio": "exec", "countdown": "sympy parse_expr",
    "intermediate_integration": "sympy parse_expr", "n_queens": "eval", "polynomial_equations": "sympy",
    "polynomial_multiplication": "sympy parse_expr", "puzzle24": "sympy parse_expr",
    "simple_integration": "sympy parse_expr", "spiral_matrix": "eval", "string_insertion": "eval",
    "composite": "mixes tasks, some of them above",
}
MAX_ANSWER_CHARS = 1000  # what a scorer is handed at most: a longer "answer" scores 0

_MARKER = re.compile(r"\banswer(?:\s+is\b\s*:?|\s*:)", re.IGNORECASE)
_NUMBER_ANSWER = re.compile(r"-?\d+(?:\.\d+)?")
_NUMBER_IN_TEXT = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class ReasoningGymError(ValueError):
    """A task that is unknown or unsafe to score, or a row without its entry."""


def check_task(name: str) -> None:
    """Refuse a task that reasoning-gym does not have, or whose scorer evaluates answers as code."""
    if name in UNSAFE_TASKS:
        raise ReasoningGymError(f"reasoning-gym task '{name}' scores answers by running them as code "
                                f"({UNSAFE_TASKS[name]}), so a completion could run code in the trainer; pick "
                                "another task (docs/data-and-rewards.md lists the refused ones)")
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ReasoningGymError(f"reasoning-gym has no task '{name}'; some of its tasks: "
                                f"{', '.join(sorted(DATASETS)[:12])}, ...")


@functools.cache
def _scorer(task: str):
    check_task(task)
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def _last_tagged(text: str) -> str | None:
    """The content of the last <answer>...</answer> (any case); None without one. Linear time:
    found from the end, never by a regex that a flood of opening tags makes quadratic."""
    lower = text.lower()
    end = lower.rfind("</answer>")
    start = lower.rfind("<answer>", 0, end) if end >= 0 else -1
    return text[start + len("<answer>"):end] if start >= 0 else None


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced; None without one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(completion: str, reference: str | None = None) -> str:
    """The completion's final answer, by the first rule that applies:

    1. the content of the last <answer>...</answer> block;
    2. the content of the last \\boxed{...};
    3. the rest of the line after the last "answer:" or "answer is" (any case, so "Final
       Answer:" and "the answer is" too);
    4. the last non-empty line.

    The span is then stripped of spaces and markdown emphasis (`*`, `` ` ``) at both ends and of
    closing periods.
    When the task's reference answer is a number, the answer is the last number in the span
    (thousands separators dropped): "So 3 + 4 = 7." gives "7".
    """
    span = _last_tagged(completion)
    if span is None:
        span = _last_boxed(completion)
    if span is None:
        markers = list(_MARKER.finditer(completion))
        if markers:
            span = completion[markers[-1].end():].split("\n", 1)[0]
        else:
            lines = [line for line in completion.splitlines() if line.strip()]
            span = lines[-1] if lines else ""
    span = span.lstrip(" \t\r\n*`").rstrip(" \t\r\n*`.")  # one pass each: linear on any input
    if reference is not None and _NUMBER_ANSWER.fullmatch(str(reference).strip()):
        numbers = _NUMBER_IN_TEXT.findall(span)
        if numbers:
            span = numbers[-1].replace(",", "")
    return span


def reasoning_gym(prompts, completions, reasoning_gym=None, **_) -> Scores:
    """The task's own score (0 to 1) of each completion's extracted answer; components
    `answered` (an answer was found) and `score`. A scorer that raises scores 0 with the reason."""
    if reasoning_gym is None:
        raise ReasoningGymError("the reasoning_gym reward needs the 'reasoning_gym' field that "
                                "tools/prepare_data.py --reasoning-gym writes in every row")
    scores, answered, reasons = [], [], []
    entries = {}  # a group's completions share their row: its entry is parsed once
    for completion, entry_json in zip(completions, reasoning_gym):
        if not isinstance(entry_json, str):
            entry = entry_json
        elif (entry := entries.get(entry_json)) is None:
            entry = entries[entry_json] = json.loads(entry_json)
        task = entry["metadata"]["source_dataset"]
        answer = extract_answer(completion, entry.get("answer"))
        answered.append(1.0 if answer else 0.0)
        if not answer or len(answer) > MAX_ANSWER_CHARS:
            scores.append(0.0)
            reasons.append("no answer found" if not answer else f"answer longer than {MAX_ANSWER_CHARS} characters")
            continue
        try:
            score = float(_scorer(task)(answer, entry))
        except ReasoningGymError:
            raise
        except Exception as e:  # noqa: BLE001 - the scorer choked on hostile text: it scores 0
            scores.append(0.0)
            reasons.append(f"the {task} scorer raised {type(e).__name__}: {str(e)[:120]}")
            continue
        scores.append(min(1.0, max(0.0, score)) if score == score else 0.0)
        reasons.append(f"answer {answer[:60]!r}")
    return Scores(scores, components={"answered": answered, "score": scores}, reasons=reasons)
