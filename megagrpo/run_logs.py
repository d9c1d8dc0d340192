"""A run's append-only logs in its output_dir (metrics.jsonl, eval_history.jsonl,
prompts_seen.jsonl): read back by `megagrpo report` and `megagrpo doctor`, cut back by a resume.
Standard library only, so the commands that read a run start in a blink."""
from __future__ import annotations

import json
import os
import sys

RUN_LOGS = ("metrics.jsonl", "eval_history.jsonl", "prompts_seen.jsonl")
"""The run's append-only logs in output_dir, one JSON object with a "step" per line."""


class RunLogError(ValueError):
    """A run log that cannot be read; the message names the file (and line) and the fix."""


def read_jsonl(path: str, warn=lambda line: print(line, file=sys.stderr)) -> list[dict]:
    """Its rows ([] when there is no such file). A last line that does not parse (a run killed
    while writing it; the next attempt cuts it) is skipped, saying so; a bad line before the
    last is an error naming it."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
    rows = []
    for number, line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number != lines[-1][0]:
                raise RunLogError(f"{path}, line {number}: not JSON ({e}); only the last line may be torn") from None
            warn(f"megagrpo: skipped the last line of {path} (line {number}): torn, the run was "
                 "killed while writing it")
    return rows


def read_series(run_dir: str, warn=lambda line: print(line, file=sys.stderr)) -> dict[str, list[tuple[int, float]]]:
    """{name: [(step, value), ...]} from metrics.jsonl (a resumed run's repeated step: the last
    value) and eval_history.jsonl (as eval/<name>)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise RunLogError(f"{run_dir}: no metrics.jsonl; runs write it with logging.report_to containing jsonl "
                          "(the default). Point the command at a run's output_dir")
    series: dict[str, dict[int, float]] = {}
    for prefix, name in (("", "metrics.jsonl"), ("eval/", "eval_history.jsonl")):
        for row in read_jsonl(os.path.join(run_dir, name), warn):
            step = int(row.pop("step"))
            for key, value in row.items():
                if isinstance(value, (int, float)):
                    series.setdefault(prefix + key, {})[step] = float(value)
    return {k: sorted(v.items()) for k, v in series.items()}


def cut_logs_after(output_dir: str, step: int) -> None:
    """Keep the rows of each of RUN_LOGS up to `step` (a resumed run logs the later ones again),
    and drop a last line torn by a kill mid-write. Rewritten whole, then renamed over."""
    for name in RUN_LOGS:
        path = os.path.join(output_dir, name)
        if not os.path.isfile(path):
            continue
        kept = []
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn line: the attempt was killed while writing it
                if row.get("step", 0) <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
