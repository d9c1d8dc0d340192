"""Text rewards: the customer-service reward, math accuracy (math-verify), think/answer
format, and DAPO's soft overlong penalty.

Each is a reward function `fn(prompts, completions, **fields) -> list[float]` (see rewards/__init__.py);
customer_service returns its components too, which the trainer logs as
`rewards/customer_service/<component>`.
"""
from __future__ import annotations

import json
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
from contextlib import nullcontext, suppress
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megagrpo.rewards import Scores

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
    words = _WORD.findall(query.lower())
    return list(dict.fromkeys(w for w in words if len(w) >= min_length and w not in STOPWORDS and not w.isdigit()))


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

# VADER's time grows with the square of the words (an emoji counts as the words of its name):
# 1,000 characters of one emoji take over a second, 500 a quarter of that.
FRIENDLINESS_CHARS = 500


def friendliness(text: str) -> float:
    """VADER's compound sentiment of the first FRIENDLINESS_CHARS characters, mapped from
    [-1, 1] to [0, 1]."""
    global _ANALYZER
    if _ANALYZER is None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
        _ANALYZER = SentimentIntensityAnalyzer()
    return (_ANALYZER.polarity_scores(text[:FRIENDLINESS_CHARS])["compound"] + 1.0) / 2.0


def customer_service(prompts, completions, keywords=None, solved_weight: float = 0.5,
                     friendly_weight: float = 0.3, length_weight: float = 0.2, target: int = 150,
                     **_) -> Scores:
    """solved_weight x keyword coverage + friendly_weight x friendliness + length_weight x
    (1 - |len - target| / target). Keywords come from the row's `keywords` field (a list or a
    comma-separated string) or, without one, from the query's content words."""
    from megagrpo.rewards import Scores, length_penalty

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

# The final answer is at the end, and math-verify's regexes slow down on long texts.
MAX_ANSWER_CHARS = 1000


def _delimited(text: str) -> str:
    """A bare expression as LaTeX math (math-verify reads math between delimiters)."""
    return text if "$" in text or "\\boxed" in text else f"${text.strip()}$"


def answer_text(completion: str) -> str:
    """What math_accuracy reads: the inside of the last <answer>...</answer> (as LaTeX math)
    when there is one, else the whole completion; at most its last MAX_ANSWER_CHARS characters."""
    end = completion.rfind("</answer>")
    start = completion.rfind("<answer>", 0, end) if end >= 0 else -1
    if start < 0:
        return completion[-MAX_ANSWER_CHARS:]
    return _delimited(completion[start + len("<answer>"):end][-MAX_ANSWER_CHARS:])


def _equal(reference: str, text: str, timeout_s: int) -> bool:
    """math-verify: does `text` hold an answer equal to `reference`? Parsing it may take
    timeout_s seconds, the comparison what is left of them (at least 1). False on any error.
    The timeouts are SIGALRM's: call this in a main thread."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        gold = parse(_delimited(reference), parsing_timeout=timeout_s)
        start = time.monotonic()
        predicted = parse(text, parsing_timeout=timeout_s)
        left = max(1, math.ceil(timeout_s - (time.monotonic() - start)))
        return bool(gold) and bool(predicted) and bool(verify(gold, predicted, timeout_seconds=left))
    except (Exception, TimeoutException):
        return False


class _MathChild:
    """`_equal` in a child process, for callers off the main thread. There SIGALRM is unusable,
    so math-verify would run without a timeout, and a short answer such as 10^{10^{10^{10}}}
    computes for ever (in C, which no Python timeout interrupts). The child runs `_equal` in its
    own main thread; one silent for timeout_s + 2 s is killed, and the next check starts another."""

    def __init__(self):
        self.proc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stop()

    def _stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                with suppress(OSError):  # a write the dead child never read
                    pipe.close()
            self.proc = None

    def _reply(self, seconds: float) -> bytes | None:
        """The child's next line (b"" when it died), None after `seconds` without one."""
        ready, _, _ = select.select([self.proc.stdout], [], [], seconds)
        return os.read(self.proc.stdout.fileno(), 64).strip() if ready else None  # one short line

    def __call__(self, reference: str, text: str, timeout_s: int) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            self._stop()
        if self.proc is None:
            # this file as a script (runpy: not through the package, which imports torch)
            code = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
            self.proc = subprocess.Popen([sys.executable, "-c", code, __file__], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            if self._reply(120) != b"ready":
                self._stop()
                raise RuntimeError("math_accuracy: the math-verify child process did not start")
        try:
            self.proc.stdin.write(json.dumps([reference, text, timeout_s]).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # died since the last check
            self._stop()
            return False
        reply = self._reply(timeout_s + 2)
        if reply not in (b"0", b"1"):  # stuck or dead
            self._stop()
        return reply == b"1"


def _serve_math_child() -> None:
    """The child of _MathChild: a JSON [reference, text, timeout_s] per line in, 1 or 0 out."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # anything else printed goes to stderr
    import math_verify  # noqa: F401 - loaded before "ready"

    out.write(b"ready\n")
    for line in sys.stdin.buffer:
        reference, text, timeout_s = json.loads(line)
        out.write(b"1\n" if _equal(reference, text, timeout_s) else b"0\n")


def math_accuracy(prompts, completions, answer=None, timeout_s: int = 5, **_) -> list[float]:
    """1.0 when the completion's final answer (see answer_text; \\boxed{} preferred) is
    mathematically equal to the row's `answer` (math-verify: LaTeX, fractions, decimals, sets,
    ...), else 0.0. Checking one completion takes at most about timeout_s seconds (+1, +2 off
    the main thread); one that runs out, or that math-verify cannot read, scores 0."""
    if answer is None:
        raise ValueError("math_accuracy needs an 'answer' field in every data row")
    if not (isinstance(timeout_s, int) and timeout_s >= 1):
        raise ValueError(f"math_accuracy: timeout_s must be a whole number of seconds >= 1, not {timeout_s!r}")
    in_main = threading.current_thread() is threading.main_thread()
    with (nullcontext(_equal) if in_main else _MathChild()) as equal:
        return [1.0 if equal(str(reference), answer_text(completion), timeout_s) else 0.0
                for completion, reference in zip(completions, answer)]


_THINK_ANSWER = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)


def think_answer_format(prompts, completions, **_) -> list[float]:
    """1.0 for `<think>...</think>` then `<answer>...</answer>` and nothing else around them,
    each tag exactly once and the answer not empty; else 0.0."""
    scores = []
    for c in completions:
        # the counts first: with each tag once the regex is linear, with many it is quadratic
        once = all(c.count(tag) == 1 for tag in ("<think>", "</think>", "<answer>", "</answer>"))
        m = once and _THINK_ANSWER.fullmatch(c)
        scores.append(1.0 if m and m.group(2).strip() else 0.0)
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


if __name__ == "__main__":  # the child process of _MathChild
    _serve_math_child()
