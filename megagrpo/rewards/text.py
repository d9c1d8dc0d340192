"""Text rewards: the customer-service reward, math accuracy (math-verify), think/answer
format, and DAPO's soft overlong penalty.

Each is a reward function `fn(prompts, completions, **fields) -> list[float]` (see rewards/__init__.py);
customer_service returns its components too, which the trainer logs as
`rewards/customer_service/<component>`.
"""
from __future__ import annotations

import re
import threading

from megagrpo.rewards import Scores, length_penalty

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")

# Words that carry no topic: left out when keywords are extracted from the query.
STOPWORDS = frozenset("""
a about above after again against all am an and any are as at be because been before being below
between both but by can cannot could did do does doing down during each few for from further get
got had has have having he her here hers herself him himself his how i if in into is it its itself
just let me more most my myself no nor not now of off on once only or other our ours ourselves out
over own please same she should so some such than that the their theirs them themselves then there
these they this those through to too under until up very was we were what when where which while
who whom why will with would you your yours yourself yourselves hi hello hey thanks thank dear
can't i'm i've it's don't doesn't didn't won't isn't
""".split())


def prompt_text(prompt) -> str:
    """The text of a prompt: a string, or the last user message of a chat."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1]) if users else ""
    return str(prompt)


def extract_keywords(query: str, min_length: int = 3) -> list[str]:
    """Distinct lowercase words of the query, in order, without stopwords or short words."""
    seen = []
    for word in _WORD.findall(query.lower()):
        if len(word) >= min_length and word not in STOPWORDS and not word.isdigit() and word not in seen:
            seen.append(word)
    return seen


def keyword_coverage(completion: str, keywords: list[str]) -> float:
    """Fraction of keywords that occur in the completion (case-insensitive; a keyword of one
    word must appear as a whole word, a phrase as a substring). 0 when there are none."""
    if not keywords:
        return 0.0
    text = completion.lower()
    words = set(_WORD.findall(text))
    hits = sum(1 for k in keywords
               if (k.lower() in words if " " not in k.strip() else k.lower().strip() in text))
    return hits / len(keywords)


_ANALYZER = None


def friendliness(text: str) -> float:
    """VADER's compound sentiment mapped from [-1, 1] to [0, 1]."""
    global _ANALYZER
    if _ANALYZER is None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
        _ANALYZER = SentimentIntensityAnalyzer()
    return (_ANALYZER.polarity_scores(text)["compound"] + 1.0) / 2.0


def customer_service(prompts, completions, keywords=None, solved_weight: float = 0.5,
                     friendly_weight: float = 0.3, length_weight: float = 0.2, target: int = 150,
                     **_) -> Scores:
    """solved_weight x keyword coverage + friendly_weight x friendliness + length_weight x
    (1 - |len - target| / target). Keywords come from the row's `keywords` field (a list or a
    comma-separated string) or, without one, from the query's content words."""
    solved, friendly = [], []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        row = keywords[i] if keywords is not None else None
        if isinstance(row, str):
            row = [k.strip() for k in row.split(",") if k.strip()]
        words = list(row) if row else extract_keywords(prompt_text(prompt))
        solved.append(keyword_coverage(completion, words))
        friendly.append(friendliness(completion))
    length = length_penalty(prompts, completions, target=target)
    totals = [solved_weight * s + friendly_weight * f + length_weight * n
              for s, f, n in zip(solved, friendly, length)]
    return Scores(totals, components={"solved": solved, "friendliness": friendly, "length": length})


# ---- math ---------------------------------------------------------------------------------------

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _math_timeout():
    """math-verify times out with SIGALRM, which only the main thread may set."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_accuracy(prompts, completions, answer=None, **_) -> list[float]:
    """1.0 when the completion's final answer (inside <answer> tags when present, else the
    whole completion; \\boxed{} preferred) is mathematically equal to the row's `answer`
    (math-verify: LaTeX, fractions, decimals, sets, ...), else 0.0."""
    from math_verify import parse, verify

    if answer is None:
        raise ValueError("math_accuracy needs an 'answer' field in every data row")
    timeout = _math_timeout()
    delimited = lambda text: text if "$" in text or "\\boxed" in text else f"${text.strip()}$"  # noqa: E731
    scores = []
    for completion, reference in zip(completions, answer):
        gold = parse(delimited(str(reference)), parsing_timeout=timeout)
        tagged = _ANSWER_TAG.findall(completion)
        # an <answer> tag holds a bare expression: read it as LaTeX math
        predicted = parse(delimited(tagged[-1]) if tagged else completion, parsing_timeout=timeout)
        ok = bool(gold) and bool(predicted) and verify(gold, predicted, timeout_seconds=timeout)
        scores.append(1.0 if ok else 0.0)
    return scores


_THINK_ANSWER = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)


def think_answer_format(prompts, completions, **_) -> list[float]:
    """1.0 for `<think>...</think>` then `<answer>...</answer>` and nothing else around them,
    each tag exactly once and the answer not empty; else 0.0."""
    scores = []
    for c in completions:
        m = _THINK_ANSWER.fullmatch(c)
        once = all(c.count(tag) == 1 for tag in ("<think>", "</think>", "<answer>", "</answer>"))
        scores.append(1.0 if m and once and m.group(2).strip() else 0.0)
    return scores


def overlong_penalty(prompts, completions, completion_length=None, max_new_tokens=None,
                     max_length: int | None = None, cache_length: int = 64, **_) -> list[float]:
    """DAPO's soft overlong punishment, in tokens. The trainer passes each completion's token
    count as the field `completion_length` and rollout.max_new_tokens as `max_new_tokens`,
    the default of `max_length`:
        0                                   if L <= max_length - cache_length
        (max_length - cache_length - L) / cache_length   if in the last cache_length tokens
        -1                                  if L > max_length"""
    if completion_length is None:
        raise ValueError("overlong_penalty needs each completion's token count in the "
                         "'completion_length' field (the trainer provides it)")
    if max_length is None:
        if not max_new_tokens:
            raise ValueError("overlong_penalty needs args.max_length or the 'max_new_tokens' field")
        max_length = int(max_new_tokens[0])
    if not 0 < cache_length <= max_length:
        raise ValueError(f"overlong_penalty: cache_length {cache_length} must be in (0, max_length={max_length}]")
    free = max_length - cache_length
    scores = []
    for n in completion_length:
        if n <= free:
            scores.append(0.0)
        elif n <= max_length:
            scores.append((free - n) / cache_length)
        else:
            scores.append(-1.0)
    return scores
