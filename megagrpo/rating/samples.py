"""The two sources of answers a rating session compares, and the items they share.

A source is one held-out evaluation's samples file, rows {"index", "prompt", "reference",
"completions", "images", ...}: a run's eval_samples/step_N.jsonl (written before training, every
logging.eval_steps and after the last step) or `megagrpo eval --output DIR`'s
DIR/eval_samples.jsonl. Named on the command line as

    RUN_DIR           a run's last evaluation (alone, as `megagrpo rate RUN_DIR`: its first and last)
    RUN_DIR:STEP      that step's evaluation
    DIR               an eval output folder (DIR/eval_samples.jsonl), or a samples .jsonl file

An item is a held-out prompt present in both sources (same index, same prompt text), with the
first completion of each. Which source wrote which answer is hidden from the rater: `order`
draws the A/B order of each item for each rater from a seed.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import sys


class SampleError(ValueError):
    """A source that cannot be found, read or paired; the message says what to pass instead."""


@dataclasses.dataclass
class Source:
    name: str  # how the ratings name it: "step 40", "../other:step 40", "../eval/eval_samples.jsonl"
    path: str  # its samples file
    rows: dict  # {held-out index: row}


@dataclasses.dataclass
class Item:
    id: int  # the held-out index
    prompt: str
    reference: str | None
    images: list[str]  # data:image/ URIs only
    answers: dict[str, str]  # {source name: its first completion}


def step_files(folder: str) -> dict[int, str]:
    """{step: path} of a run's eval_samples/step_N.jsonl, by step."""
    found = {}
    for path in glob.glob(os.path.join(folder, "eval_samples", "step_*.jsonl")):
        step = re.fullmatch(r"step_(\d+)\.jsonl", os.path.basename(path))
        if step:
            found[int(step.group(1))] = path
    return dict(sorted(found.items()))


def _split(spec: str) -> tuple[str, int | None]:
    """(folder or file, step or None) of RUN_DIR, RUN_DIR:STEP, DIR or FILE."""
    found = re.fullmatch(r"(.+):(\d+)", spec)
    if found and not os.path.exists(spec):
        return found.group(1), int(found.group(2))
    return spec, None


def home_of(spec: str) -> str:
    """The folder whose ratings/ a session writes: the run's (or eval output's) folder."""
    where, _ = _split(spec)
    return (os.path.dirname(where) or ".") if os.path.isfile(where) else where


def resolve(spec: str, home: str) -> tuple[str, str]:
    """(name, samples file) of a source spec; names are relative to `home`."""
    where, step = _split(spec)
    relative = os.path.relpath(os.path.abspath(where), os.path.abspath(home))
    steps = step_files(where) if os.path.isdir(where) else {}
    if step is None and steps:
        step = max(steps)
    if step is not None:
        if step not in steps:
            raise SampleError(f"{where}: no held-out samples at step {step} (eval_samples/step_{step:08d}.jsonl); "
                              f"its steps: {', '.join(map(str, steps)) or 'none'}")
        return (f"step {step}" if relative == "." else f"{relative}:step {step}"), steps[step]
    path = os.path.join(where, "eval_samples.jsonl") if os.path.isdir(where) else where
    if not os.path.isfile(path):
        raise SampleError(f"{spec}: no held-out samples. Name a run's output_dir (its eval_samples/step_N.jsonl, "
                          "written when data.eval_file is set), RUN_DIR:STEP, a `megagrpo eval --output` folder "
                          "(eval_samples.jsonl) or a samples .jsonl file")
    return os.path.relpath(os.path.abspath(path), os.path.abspath(home)), path


def load_rows(path: str, warn=lambda line: print(line, file=sys.stderr)) -> dict[int, dict]:
    """{index: row} of a samples file. A torn last line (a run killed while writing it) is
    skipped with a warning; any other bad line is a SampleError naming it."""
    with open(path, errors="replace") as f:
        lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
    rows = {}
    for number, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if number == lines[-1][0]:
                warn(f"megagrpo rate: skipped the last line of {path} (line {number}): torn")
                continue
            raise SampleError(f"{path}, line {number}: not JSON ({e})") from None
        if not isinstance(row, dict) or type(row.get("index")) is not int or "prompt" not in row:
            raise SampleError(f"{path}, line {number}: not a held-out sample (needs an integer index and a prompt)")
        rows[row["index"]] = row
    return rows


def load_sources(run_dir: str, against: str = None) -> list[Source]:
    """The session's two sources: RUN_DIR's first and last evaluation (before and after GRPO),
    or, with `against`, RUN_DIR (its last evaluation, or RUN_DIR:STEP) and `against`."""
    home = home_of(run_dir)
    if against is None:
        where, step = _split(run_dir)
        steps = step_files(where) if os.path.isdir(where) else {}
        if step is not None:
            raise SampleError(f"{run_dir}: one step to compare with what? Name the other: --against OTHER")
        if len(steps) < 2:
            raise SampleError(f"{run_dir}: {len(steps)} held-out evaluation(s) to compare here; the default compares "
                              "a run's first and last (eval_samples/step_N.jsonl: set data.eval_file when training). "
                              "Compare with another source: --against OTHER")
        named = [resolve(f"{where}:{min(steps)}", home), resolve(f"{where}:{max(steps)}", home)]
    else:
        named = [resolve(run_dir, home), resolve(against, home)]
    if os.path.samefile(named[0][1], named[1][1]):
        raise SampleError(f"both sources are {named[0][1]}: compare two different evaluations")
    return [Source(name, path, load_rows(path)) for name, path in named]


def prompt_text(prompt) -> str:
    """A prompt as text: a string as it is, chat messages as "role: content" lines."""
    if not isinstance(prompt, list):
        return str(prompt)
    lines = []
    for message in prompt:
        if not isinstance(message, dict):
            lines.append(str(message))
            continue
        content = message.get("content")
        if isinstance(content, list):  # parts: text and images
            content = " ".join(str(p.get("text", "")) if isinstance(p, dict) and p.get("type") == "text"
                               else "[image]" for p in content)
        lines.append(f"{message.get('role', '?')}: {content}")
    return "\n".join(lines)


def pair(first: Source, second: Source, count: int = None) -> tuple[list[Item], list[int]]:
    """The items both sources hold (by held-out index, the first `count`), and the indices both
    hold with different prompt texts (left out: not the same question)."""
    items, differ = [], []
    for index in sorted(first.rows.keys() & second.rows.keys()):
        a, b = first.rows[index], second.rows[index]
        if prompt_text(a["prompt"]) != prompt_text(b["prompt"]):
            differ.append(index)
            continue
        images = [u for u in a.get("images") or [] if isinstance(u, str) and u.startswith("data:image/")]
        reference = a.get("reference")
        items.append(Item(index, prompt_text(a["prompt"]), None if reference is None else str(reference), images,
                          {first.name: _first_completion(a), second.name: _first_completion(b)}))
    if not items:
        raise SampleError(f"{first.path} and {second.path} share no held-out prompt (same index, same prompt text): "
                          "were they evaluated on the same held-out file?")
    return items[:count] if count else items, differ


def _first_completion(row: dict) -> str:
    completions = row.get("completions") or [""]
    return completions[0] if isinstance(completions[0], str) else json.dumps(completions[0])


def order(seed: int, rater: str, item: int, sources: list[str]) -> list[str]:
    """The sources as answers A and B of `item` for `rater`: a coin drawn from a hash of the
    three, so the same rater sees the same order when they come back."""
    coin = hashlib.sha256(f"{seed}/{rater}/{item}".encode()).digest()[0] & 1
    return list(reversed(sources)) if coin else list(sources)
