"""Aggregates of a run's ratings, where they go: RUN_DIR/ratings/summary.json, the "human" key
of RUN_DIR/eval_results.json (beside "before" and "after"), a console line per comparison, and
the "Human ratings" section of `megagrpo report`.

The summary is {"<first> vs <second>": aggregates.aggregate(...)}, one entry per pair of sources
that was rated (usually one: the run's step 0 against its last step).
"""
from __future__ import annotations

import html
import json
import os
import sys

from megagrpo.rating.aggregates import aggregate
from megagrpo.rating.store import RatingStore, ratings_folder


def summarize(run_dir: str, warn=lambda line: print(line, file=sys.stderr)) -> dict:
    """{comparison: its aggregates} over every rater's lines; {} when nobody has rated."""
    by_comparison: dict[tuple, list] = {}
    for row in RatingStore(run_dir).read(warn=warn):
        by_comparison.setdefault(tuple(row["comparison"]), []).append(row)
    return {f"{a} vs {b}": aggregate(rows, [a, b]) for (a, b), rows in by_comparison.items()}


def _write_json(path: str, value: dict) -> None:
    """Whole or not at all: a reader (the report, a training run's write_results) never sees half."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(partial, path)


def write_summary(run_dir: str, summary: dict) -> str:
    """summary.json, and the "human" key of eval_results.json (its other keys kept); returns
    summary.json's path."""
    path = os.path.join(ratings_folder(run_dir), "summary.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _write_json(path, summary)
    results_path = os.path.join(run_dir, "eval_results.json")
    results = {}
    if os.path.isfile(results_path):
        with open(results_path) as f:
            results = json.load(f)
    _write_json(results_path, {**results, "human": summary})
    return path


def _number(value, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _interval(stats: dict) -> str:
    ci = stats["ci95_t"]
    return f"[{_number(ci[0])}, {_number(ci[1])}]" if ci else "[n/a]"


def console_lines(summary: dict) -> list[str]:
    """One or two lines per comparison: means with their t-intervals, win rates, agreement."""
    lines = []
    for name, agg in summary.items():
        first, second = agg["sources"]
        scores, wins, agreement = agg["scores"], agg["score_win_rate"], agg["score_agreement"]
        if wins["judgments"] or any(s["items"] for s in scores.values()):
            means = ", ".join(f"{s} {_number(scores[s]['mean'])} {_interval(scores[s])}" for s in (first, second))
            lines.append(f"human ratings, {name}: mean score {means} (95% t-interval over items); {second} scored "
                         f"higher in {_number(wins[second])} of {wins['judgments']} judgments (ties half); "
                         f"Krippendorff's alpha (interval) {_number(agreement['krippendorff_alpha_interval'])} over "
                         f"{agreement['answers_with_2_raters']} answers; {len(agg['raters'])} rater(s)")
        pairwise, wins = agg["pairwise"], agg["pairwise"]["win_rate"]
        if wins["judgments"]:
            lines.append(f"human ratings, {name}, pairwise: {second} preferred in {_number(wins[second])} of "
                         f"{wins['judgments']} judgments (ties half); Krippendorff's alpha (nominal) "
                         f"{_number(pairwise['krippendorff_alpha_nominal'])} over {pairwise['items_with_2_raters']} "
                         "items")
    return lines


def report_section(run_dir: str) -> str:
    """The "Human ratings" section of `megagrpo report` (HTML), or "" when nobody has rated."""
    summary = summarize(run_dir, warn=lambda line: None)
    if not summary:
        return ""
    parts = ['<section class="panel" id="panel-human"><h2>Human ratings (megagrpo rate)</h2>',
             "<p>Blind scores 1-5: the mean over items of each item's mean over raters, with its 95% t-interval; "
             "win rate: the share of (rater, item) judgments a source won, ties half.</p>"]
    for name, agg in summary.items():
        parts.append(f"<h3>{html.escape(name)}</h3><table><tr><th>source</th><th>mean score</th><th>95% CI (t)</th>"
                     "<th>items</th><th>win rate (scores)</th><th>win rate (pairwise)</th></tr>")
        for source in agg["sources"]:
            s = agg["scores"][source]
            parts.append(f"<tr><td>{html.escape(source)}</td><td>{_number(s['mean'])}</td><td>{_interval(s)}</td>"
                         f"<td>{s['items']}</td><td>{_number(agg['score_win_rate'][source])}</td>"
                         f"<td>{_number(agg['pairwise']['win_rate'][source])}</td></tr>")
        raters = ", ".join(f"{html.escape(r)} ({c['scores']} scores, {c['choices']} choices)"
                           for r, c in agg["raters"].items())
        parts.append(f"</table><p>Raters: {raters}. Krippendorff's alpha: "
                     f"{_number(agg['score_agreement']['krippendorff_alpha_interval'])} (interval, scores, "
                     f"{agg['score_agreement']['answers_with_2_raters']} answers rated by 2+ raters), "
                     f"{_number(agg['pairwise']['krippendorff_alpha_nominal'])} (nominal, pairwise, "
                     f"{agg['pairwise']['items_with_2_raters']} items).</p>")
    parts.append("</section>")
    return "\n".join(parts)
