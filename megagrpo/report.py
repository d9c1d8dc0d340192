"""`megagrpo report RUN_DIR`: the picture of a run, for whoever cannot open a TensorBoard port.

At the top, the run doctor's findings (doctor.py), each with the curve that shows it. Reads
output_dir/metrics.jsonl (logging.report_to jsonl, on by default), eval_history.jsonl
and the newest eval_samples/step_*.jsonl, and writes RUN_DIR/report/: one PNG per panel
(matplotlib) and report.html, self-contained (the PNGs inlined), with a handful of held-out
samples and their rewards. A panel whose metrics the run did not log says so instead. A run
with a code reward gets one line saying which sandbox judged it (from the reward's
sandbox/<feature> metrics), on the page and on the console.
"""
from __future__ import annotations

import argparse
import base64
import glob
import html
import json
import os
import re
import sys

from megagrpo.config.schema import ConfigError
from megagrpo.doctor import CHECKS, examine
from megagrpo.run_logs import RunLogError, read_jsonl, read_series
from megagrpo.sandbox import FEATURES, describe

# (key, title, metric names or prefixes; a name ending in "/" takes every metric under it)
PANELS = [
    ("reward", "Reward: mean, min-max band, per reward function", ["train/reward", "train/rewards/"]),
    ("kl", "KL to the reference", ["train/kl"]),
    ("entropy", "Entropy of the sampled tokens", ["train/entropy"]),
    ("clipping", "Clip ratios", ["train/clip_ratio/"]),
    ("lengths", "Completion lengths (tokens) and truncation", ["train/completions/"]),
    ("importance_sampling", "Sampler vs trainer: importance sampling", ["train/sampling/"]),
    ("optimizer", "Learning rate and gradient norm", ["train/learning_rate", "train/grad_norm"]),
    ("step_time", "Step time by phase (stacked)", ["train/time/"]),
    ("held_out", "Held-out metrics", ["eval/"]),
]


def sandbox_lines(metrics: dict) -> list[str]:
    """One line per code reward of the run: the sandbox that judged it, e.g. "Sandbox of the
    code reward: bubblewrap (namespaces, seccomp, cgroups)"; a feature some steps or ranks
    lacked is given as the share of the completions that had it."""
    lines = []
    for name in sorted(metrics):
        found = re.fullmatch(r"train/rewards/(.+)/sandbox/bubblewrap", name)
        if found:
            prefix = name.removesuffix("bubblewrap")
            shares = {f: _mean(metrics.get(prefix + f, [])) for f in FEATURES}
            lines.append(f"Sandbox of the {found.group(1)} reward: {describe(**shares)}")
    return lines


def _mean(series: list[tuple[int, float]]) -> float:
    return sum(v for _, v in series) / len(series) if series else 0.0


def _matching(metrics: dict, patterns: list[str]) -> list[str]:
    return [n for n in sorted(metrics) if any(n == p or (p.endswith("/") and n.startswith(p)) for p in patterns)]


def draw_panel(key: str, title: str, names: list[str], metrics: dict, out_png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    if key == "step_time":
        phases = [n for n in names if n != "train/time/step"]
        steps = [s for s, _ in metrics[phases[0]]] if phases else []
        values = [[dict(metrics[n]).get(s, 0.0) for s in steps] for n in phases]
        if phases:
            ax.stackplot(steps, values, labels=[n.rsplit("/", 1)[-1] for n in phases])
        ax.set_ylabel("seconds")
    elif key == "reward" and {"train/reward_min", "train/reward_max"} <= set(metrics):
        steps = [s for s, _ in metrics["train/reward_min"]]
        ax.fill_between(steps, [v for _, v in metrics["train/reward_min"]], [v for _, v in metrics["train/reward_max"]],
                        alpha=0.2, label="min-max")
        for n in [n for n in names if n == "train/reward" or n.endswith("/mean")]:
            ax.plot(*zip(*metrics[n]), label=n.removeprefix("train/"))
    else:
        twin = None
        for n in names:
            axis = ax
            if key in ("lengths", "optimizer") and n.endswith(("clipped_ratio", "grad_norm")):
                twin = twin or ax.twinx()
                axis = twin
            axis.plot(*zip(*metrics[n]), marker="o" if len(metrics[n]) < 12 else None, label=n.split("/", 1)[-1],
                      color=None if axis is ax else "black", linestyle="-" if axis is ax else "--")
        if twin is not None:
            twin.legend(loc="upper right", fontsize=7)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)


def health_section(run_dir: str, metrics: dict, out_dir: str) -> list[str]:
    """The run doctor's findings (doctor.py), each with the curve that shows it: the step
    marked, the threshold drawn where it is one line."""
    findings, steps = examine(run_dir)
    parts = ['<section class="panel" id="panel-health"><h2>Health (the run doctor)</h2>']
    if not findings:
        parts.append(f"<p>No findings: the run doctor's {len(CHECKS)} checks passed on {steps} training steps.</p>")
    for i, finding in enumerate(findings):
        png = os.path.join(out_dir, f"health_{i}_{finding.check}.png")
        draw_finding(finding, metrics.get(finding.metric, []), png)
        with open(png, "rb") as f:
            data = base64.b64encode(f.read()).decode()
        parts.append(f'<div class="finding" id="finding-{i}"><p><b>{html.escape(finding.check)}</b>, step '
                     f'{finding.step}: {html.escape(finding.seen)}.<br>Likely cause: {html.escape(finding.cause)}.'
                     f'<br>Fix: {html.escape(finding.fix)}.</p><img alt="{html.escape(finding.metric)}" '
                     f'src="data:image/png;base64,{data}"></div>')
    parts.append("</section>")
    return parts


def draw_finding(finding, series: list[tuple[int, float]], out_png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 2.4), dpi=100)
    if series:
        ax.plot(*zip(*series), marker="o" if len(series) < 30 else None, label=finding.metric.removeprefix("train/"))
    ax.axvline(finding.step, color="red", linestyle=":", label=f"step {finding.step}")
    if finding.threshold is not None:
        ax.axhline(finding.threshold, color="gray", linestyle="--", label="threshold")
    ax.set_title(f"{finding.check}: {finding.metric}", fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)


def _samples(run_dir: str, count: int = 5) -> tuple[str, list[dict]]:
    files = sorted(glob.glob(os.path.join(run_dir, "eval_samples", "step_*.jsonl")))
    if not files:
        return "", []
    return os.path.basename(files[-1]), read_jsonl(files[-1])[:count]


def render(run_dir: str, out_dir: str = None) -> str:
    """Write the PNGs and report.html; returns the HTML's path."""
    metrics = read_series(run_dir)
    out_dir = out_dir or os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    steps = max((s for series in metrics.values() for s, _ in series), default=0)
    parts = [f"<h1>megagrpo run: {html.escape(os.path.abspath(run_dir))}</h1>",
             f"<p>{steps} steps logged; {len(metrics)} metrics.</p>"]
    parts += [f'<p class="sandbox">{html.escape(line)}</p>' for line in sandbox_lines(metrics)]
    parts += health_section(run_dir, metrics, out_dir)
    for key, title, patterns in PANELS:
        names = [n for n in _matching(metrics, patterns) if "/sandbox/" not in n]  # said in words above
        if key == "held_out":
            names = [n for n in names if not n.startswith("eval/distinct")]
        parts.append(f'<section class="panel" id="panel-{key}"><h2>{html.escape(title)}</h2>')
        if names:
            png = os.path.join(out_dir, f"{key}.png")
            draw_panel(key, title, names, metrics, png)
            with open(png, "rb") as f:
                data = base64.b64encode(f.read()).decode()
            parts.append(f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}">')
        else:
            parts.append(f"<p>not logged by this run ({html.escape(', '.join(patterns))})</p>")
        parts.append("</section>")
    source, samples = _samples(run_dir)
    parts.append(f'<section class="panel" id="panel-samples"><h2>Held-out samples ({html.escape(source)})</h2>')
    if samples:
        parts.append("<table><tr><th>prompt</th><th>completion</th><th>reward</th></tr>")
        for r in samples:
            completion = (r.get("completions") or [""])[0]
            reward = (r.get("reward") or [float("nan")])[0]
            images = "".join(f'<br><img class="sample" alt="image {i + 1}" src="{html.escape(uri)}">'
                             for i, uri in enumerate(r.get("images") or []) if str(uri).startswith("data:image/"))
            parts.append(f"<tr><td>{html.escape(str(r.get('prompt'))[:400])}{images}</td>"
                         f"<td><pre>{html.escape(str(completion)[:800])}</pre></td><td>{reward:.3f}</td></tr>")
        parts.append("</table>")
    else:
        parts.append("<p>no held-out samples (data.eval_file not set)</p>")
    parts.append("</section>")
    from megagrpo.rating.summary import report_section  # `megagrpo rate`'s "Human ratings"; "" when none
    parts.append(report_section(run_dir))
    page = ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>megagrpo report</title><style>"
            "body{font-family:sans-serif;margin:2em;max-width:60em}img{max-width:100%}img.sample{width:96px}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px;vertical-align:top;"
            "font-size:0.85em}pre{white-space:pre-wrap;margin:0}</style></head><body>"
            + "\n".join(parts) + "</body></html>")
    path = os.path.join(out_dir, "report.html")
    with open(path, "w") as f:
        f.write(page)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="megagrpo report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a run's output_dir (holds metrics.jsonl)")
    p.add_argument("--out", help="folder for report.html and the PNGs (default: RUN_DIR/report)")
    args = p.parse_args(argv)
    try:
        path = render(args.run_dir, args.out)
    except (RunLogError, ConfigError, OSError, json.JSONDecodeError) as e:
        print(f"megagrpo report: {e}", file=sys.stderr)
        return 2
    for line in sandbox_lines(read_series(args.run_dir)):
        print(line)
    findings, _ = examine(args.run_dir)
    print(f"health: {len(findings)} finding{'s' * (len(findings) != 1)} of the run doctor"
          + (" (`megagrpo doctor RUN_DIR` prints them)" if findings else ""))
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
