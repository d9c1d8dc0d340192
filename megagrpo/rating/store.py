"""The ratings on disk: RUN_DIR/ratings/<rater>.jsonl, one line per rating, appended the moment
it is given, never rewritten. A later rating of the same rater, item and answer replaces the
earlier one when read (last wins); the earlier line stays, so nothing is lost.

    {"item": 7, "source": "step 40", "score": 4, "rater": "alice", "time": "...", "comparison": [...]}
    {"item": 7, "choice": "step 40", "rater": "alice", "time": "...", "comparison": [...]}

`comparison` names the two sources of the session (its first and second), `choice` is a
source's name or "tie".
"""
from __future__ import annotations

import glob
import json
import os
import re
import sys
import threading
from datetime import datetime, timezone

RATER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class RatingError(ValueError):
    """A rater name or a rating that cannot be saved; the message says what is allowed."""


def check_rater(name) -> str:
    """The name, when it is safe as a file name (letters, digits, '.', '_', '-'; 1-64 of them,
    starting with a letter or digit); else RatingError."""
    if not isinstance(name, str) or not RATER.fullmatch(name):
        raise RatingError(f"rater name {name!r} cannot name a file: use 1 to 64 letters, digits, '.', '_' or '-', "
                          "starting with a letter or digit (e.g. alice or j.smith)")
    return name


def ratings_folder(run_dir: str) -> str:
    return os.path.join(run_dir, "ratings")


def _valid(row) -> bool:
    if not isinstance(row, dict) or type(row.get("item")) is not int or not isinstance(row.get("rater"), str):
        return False
    comparison = row.get("comparison")
    if not (isinstance(comparison, list) and len(comparison) == 2 and all(isinstance(s, str) for s in comparison)):
        return False
    if "score" in row:
        return row.get("source") in comparison and type(row["score"]) is int and 1 <= row["score"] <= 5
    return row.get("choice") in (*comparison, "tie")


class RatingStore:
    """Appends and reads the rating lines of one run's ratings/ folder (thread-safe appends)."""

    def __init__(self, run_dir: str):
        self.folder = ratings_folder(run_dir)
        self._lock = threading.Lock()

    def path(self, rater: str) -> str:
        return os.path.join(self.folder, f"{check_rater(rater)}.jsonl")

    def append(self, rating: dict) -> dict:
        """Write one rating (time added) as one line, flushed to disk before returning it."""
        rating = {**rating, "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        rating["comparison"] = rating.pop("comparison")  # last: the line reads item, source, score first
        if not _valid(rating):
            raise RatingError(f"not a rating: {rating}")
        path = self.path(rating["rater"])
        with self._lock:
            os.makedirs(self.folder, exist_ok=True)
            with open(path, "a+b") as f:
                f.seek(0, os.SEEK_END)
                if f.tell():  # a line torn by a kill ends before our line starts
                    f.seek(-1, os.SEEK_END)
                    torn = f.read(1) != b"\n"
                    f.seek(0, os.SEEK_END)
                    if torn:
                        f.write(b"\n")
                f.write((json.dumps(rating) + "\n").encode())
                f.flush()
                os.fsync(f.fileno())
        return rating

    def read(self, rater: str = None, warn=lambda line: print(line, file=sys.stderr)) -> list[dict]:
        """Every rating line (one rater's with `rater`), file by file in name order, each file's in
        the order written. A line that is not a rating (torn by a kill, edited by hand) is skipped
        with a warning naming it."""
        paths = [self.path(rater)] if rater else sorted(glob.glob(os.path.join(self.folder, "*.jsonl")))
        rows = []
        for path in paths:
            if not os.path.isfile(path):
                continue
            with open(path, errors="replace") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        row = None
                    if _valid(row):
                        rows.append(row)
                    else:
                        warn(f"megagrpo rate: skipped {path}, line {number}: not a rating ({line.strip()[:80]})")
        return rows
