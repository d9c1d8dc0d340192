"""The run doctor: reads a run's curves the way the seed does, and says what it sees.

A rising reward is healthy; the doctor looks for the rest. Each check reads the metrics a run
already logs (train/*), in the trainer after every logged step and afterwards from
metrics.jsonl (`megagrpo doctor RUN_DIR`): the same numbers and the same thresholds
(doctor.* in the run's config.yaml) give the same findings. A finding is one line: what was
seen, at which step, the likely cause, and the fix with the config key to change. A check
fires once per episode of trouble: it stays quiet while its condition holds, and the episode
ends after doctor.window logged steps without it.

| check | reads | the seed's row, or what our runs teach |
| --- | --- | --- |
| kl | train/kl | KL above about 0.8: drifted too far |
| entropy | train/entropy | entropy that keeps falling foretells mode collapse |
| zero_advantage | train/frac_reward_zero_std | groups that all score the same teach nothing |
| reward_swing | train/reward | rewards that swing: a noisy reward, too few samples |
| repetition | train/completions/repeated_ngrams, distinct_2 | repeated content: entropy too low |
| grad_spike | train/grad_norm | unstable training: the learning rate too high |
| non_finite | train/loss, train/grad_norm | the same, past the point of return |
| sampler_gap | train/sampling/sampling_logp_difference/mean | sampler and trainer disagree |
| memory | train/memory/* | out of memory ahead: the batch too large |
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from megagrpo.config.schema import Config, ConfigError, DoctorConfig, require
from megagrpo.run_logs import RunLogError, read_series

Series = dict[str, list[tuple[int, float]]]


@dataclass(frozen=True)
class Finding:
    """One episode of trouble, as seen at its first step."""
    check: str
    step: int
    seen: str
    cause: str
    fix: str
    metric: str                       # the curve that shows it (a logged name)
    threshold: Optional[float] = None  # drawn on that curve, where it is one line

    def line(self) -> str:
        return f"doctor: step {self.step}: {self.seen}. Likely cause: {self.cause}. Fix: {self.fix}"


class Doctor:
    """The checks over a run's logged metrics, step by step: observe() takes a logged step's
    metrics (names as logged: train/...) and returns the findings that step opens."""

    def __init__(self, cfg: Config):
        self.cfg, self.d = cfg, cfg.doctor
        self.series: Series = {}
        self.quiet_for: dict[str, int] = {}  # each open episode's check -> its clear steps since
        self.findings: list[Finding] = []

    def observe(self, step: int, metrics: dict) -> list[Finding]:
        for name, value in metrics.items():
            if name.startswith("train/"):
                self.series.setdefault(name, []).append((step, float(value)))
        if not any(n.startswith("train/") for n in metrics):
            return []  # a step that logged no training metrics (start-up, held-out only)
        opened = []
        for name, check in CHECKS.items():
            finding = check(self, step)
            if finding is not None:
                if name not in self.quiet_for:
                    opened.append(finding)
                self.quiet_for[name] = 0
            elif name in self.quiet_for:
                self.quiet_for[name] += 1
                if self.quiet_for[name] >= self.d.window:
                    del self.quiet_for[name]  # the episode is over; the next one is news
        self.findings += opened
        return opened

    def replay(self, series: Series) -> int:
        """Observe a run's logged series ({name: [(step, value), ...]}, as run_logs.read_series
        reads them) step by step; returns the training steps read. A resumed run replays its log
        (cut back to its checkpoint), so its open episodes stay open."""
        by_step: dict[int, dict] = {}
        for name, values in series.items():
            for step, value in values:
                by_step.setdefault(step, {})[name] = value
        steps = [s for s in sorted(by_step) if any(n.startswith("train/") for n in by_step[s])]
        for step in steps:
            self.observe(step, by_step[step])
        return len(steps)

    # ---- what the checks read ------------------------------------------------------------------

    def last(self, name: str) -> Optional[float]:
        values = self.series.get(name)
        return values[-1][1] if values else None

    def window(self, name: str, full: bool = True) -> list[float]:
        """The last doctor.window values of `name` ([] until the window is full, when `full`)."""
        values = [v for _, v in self.series.get(name, [])[-self.d.window:]]
        return values if len(values) == self.d.window or not full else []


# ---- the checks: each returns a Finding while its condition holds, else None -------------------

def kl_drift(doc: Doctor, step: int) -> Optional[Finding]:
    kl, g = doc.last("train/kl"), doc.cfg.grpo
    if kl is None or not kl > doc.d.kl_max:
        return None
    return Finding(
        "kl", step, f"KL to the reference {kl:.3g} > {doc.d.kl_max:g} (doctor.kl_max)",
        "the policy has drifted too far from the reference: a learning rate too high, or a KL penalty too weak",
        f"lower grpo.learning_rate (now {g.learning_rate:g}) or raise grpo.kl_coef (now {g.kl_coef:g})",
        "train/kl", doc.d.kl_max)


def entropy_collapse(doc: Doctor, step: int) -> Optional[Finding]:
    values, d = doc.window("train/entropy"), doc.d
    if not values:
        return None
    now = statistics.fmean(values)
    start = statistics.fmean(v for _, v in doc.series["train/entropy"][:d.window])
    falling = now < d.entropy_fraction * start and _slope(values) < 0
    if not (now < d.entropy_min or falling):
        return None
    how = (f"{now:.3g} nats per token over the last {d.window} steps, under doctor.entropy_min {d.entropy_min:g}"
           if now < d.entropy_min else
           f"{now:.3g} nats per token and still falling, {now / start:.0%} of its start {start:.3g} "
           f"(doctor.entropy_fraction {d.entropy_fraction:g})")
    return Finding(
        "entropy", step, f"the policy's entropy collapsed: {how}",
        "the samples of a group become the same (mode collapse ahead): a temperature too low, or a learning "
        "rate that sharpens the policy faster than it learns",
        f"raise rollout.temperature (now {doc.cfg.rollout.temperature:g}), add grpo.entropy_coef (e.g. 0.001; "
        f"now {doc.cfg.grpo.entropy_coef:g}) or clip higher with grpo.epsilon_high (e.g. 0.28)",
        "train/entropy", d.entropy_min)


def zero_advantage(doc: Doctor, step: int) -> Optional[Finding]:
    values, d, g = doc.window("train/frac_reward_zero_std"), doc.d, doc.cfg.grpo
    if not values or not statistics.fmean(values) > d.max_zero_advantage:
        return None
    reward = statistics.fmean(doc.window("train/reward", full=False) or [math.nan])
    return Finding(
        "zero_advantage", step, f"{statistics.fmean(values):.0%} of the groups over the last {d.window} steps had "
        f"completions that all scored the same (doctor.max_zero_advantage {d.max_zero_advantage:g}); mean reward "
        f"{reward:.3g}",
        "nothing to learn: the task is too easy or too hard for the model, the reward is constant, or the "
        "samples of a group are all the same",
        f"prompts of the right difficulty (data.train_file), more completions per prompt (grpo.num_generations, "
        f"now {g.num_generations}), rollout.temperature (now {doc.cfg.rollout.temperature:g}), or "
        f"grpo.dynamic_sampling=true (resamples groups with no spread)",
        "train/frac_reward_zero_std", d.max_zero_advantage)


def reward_swing(doc: Doctor, step: int) -> Optional[Finding]:
    values, d, g = doc.window("train/reward"), doc.d, doc.cfg.grpo
    if not values:
        return None
    steps = [s for s, _ in doc.series["train/reward"][-d.window:]]
    slope, intercept = statistics.linear_regression(steps, values) if len(set(steps)) > 1 else (0.0, values[0])
    swing = statistics.pstdev(v - (slope * s + intercept) for s, v in zip(steps, values))
    low = min(v for _, v in doc.series.get("train/reward_min", doc.series["train/reward"]))
    high = max(v for _, v in doc.series.get("train/reward_max", doc.series["train/reward"]))
    trend = abs(slope) * (steps[-1] - steps[0])
    if not (swing > d.reward_swing * max(high - low, 1e-12) and swing > trend):
        return None
    return Finding(
        "reward_swing", step, f"the mean reward swings by {swing:.3g} (std around its trend over the last {d.window} "
        f"steps), {swing / max(high - low, 1e-12):.0%} of its range {high - low:.3g} (doctor.reward_swing "
        f"{d.reward_swing:g}), more than it trends ({trend:.3g})",
        "a noisy reward function, or too few samples per step to average its noise out",
        f"more samples per step (grpo.per_device_train_batch_size, now {g.per_device_train_batch_size}; "
        f"grpo.gradient_accumulation_steps, now {g.gradient_accumulation_steps}) or a smoother reward "
        "(partial credit in rewards.functions instead of 0 or 1)",
        "train/reward")


def repetition(doc: Doctor, step: int) -> Optional[Finding]:
    d = doc.d
    repeated = doc.window("train/completions/repeated_ngrams")
    distinct = doc.window("train/completions/distinct_2")
    loops = bool(repeated) and statistics.fmean(repeated) > d.max_repeated_ngrams
    same = bool(distinct) and statistics.fmean(distinct) < d.min_distinct_2
    if not (loops or same):
        return None
    seen = (f"completions repeat themselves: {statistics.fmean(repeated):.0%} of their 4-grams repeat an earlier "
            f"one (doctor.max_repeated_ngrams {d.max_repeated_ngrams:g})" if loops else
            f"the completions of a group are the same text: distinct-2 {statistics.fmean(distinct):.3g} "
            f"(doctor.min_distinct_2 {d.min_distinct_2:g})")
    return Finding(
        "repetition", step, f"{seen}, over the last {d.window} steps",
        "repeated content: the policy's entropy is too low, or a reward pays for length",
        f"raise rollout.temperature (now {doc.cfg.rollout.temperature:g}) or grpo.entropy_coef (now "
        f"{doc.cfg.grpo.entropy_coef:g}); with a length reward, cap rollout.max_new_tokens (now "
        f"{doc.cfg.rollout.max_new_tokens})",
        "train/completions/repeated_ngrams" if loops else "train/completions/distinct_2",
        d.max_repeated_ngrams if loops else d.min_distinct_2)


def grad_spike(doc: Doctor, step: int) -> Optional[Finding]:
    history, d, g = doc.series.get("train/grad_norm", []), doc.d, doc.cfg.grpo
    before = [v for _, v in history[-4 * d.window - 1:-1] if math.isfinite(v)]
    if not before or not math.isfinite(history[-1][1]):
        return None
    median = statistics.median(before)
    if not (median > 0 and history[-1][1] > d.grad_norm_spike * median):
        return None
    return Finding(
        "grad_spike", step, f"the gradient norm spiked to {history[-1][1]:.3g}, {history[-1][1] / median:.0f}x "
        f"its median {median:.3g} over the previous steps (doctor.grad_norm_spike {d.grad_norm_spike:g})",
        "unstable training: the learning rate too high",
        f"lower grpo.learning_rate (now {g.learning_rate:g}), add grpo.warmup_steps (now {g.warmup_steps}), keep "
        f"grpo.max_grad_norm at 1 or lower (now {g.max_grad_norm:g}), raise grpo.kl_coef (now {g.kl_coef:g})",
        "train/grad_norm", d.grad_norm_spike * median)


def non_finite(doc: Doctor, step: int) -> Optional[Finding]:
    bad = [n for n in ("train/loss", "train/grad_norm") if doc.last(n) is not None and not math.isfinite(doc.last(n))]
    if not bad:
        return None
    g = doc.cfg.grpo
    return Finding(
        "non_finite", step, f"{' and '.join(n.removeprefix('train/') for n in bad)} went non-finite "
        f"({', '.join(f'{doc.last(n)}' for n in bad)})",
        "unstable training: the learning rate too high (or, in bfloat16, an overflow)",
        f"resume from the last checkpoint with a lower grpo.learning_rate (now {g.learning_rate:g}), "
        f"grpo.max_grad_norm (now {g.max_grad_norm:g}) and a higher grpo.kl_coef (now {g.kl_coef:g})",
        bad[0])


def sampler_gap(doc: Doctor, step: int) -> Optional[Finding]:
    name = "train/sampling/sampling_logp_difference/mean"
    gap, d, g = doc.last(name), doc.d, doc.cfg.grpo
    if gap is None or not gap > d.max_sampler_gap:
        return None
    return Finding(
        "sampler_gap", step, f"the sampler's and the trainer's log-probs of the sampled tokens differ by {gap:.3g} "
        f"nats per token on average (doctor.max_sampler_gap {d.max_sampler_gap:g})",
        "the sampler (vLLM) is off the trainer's policy: bfloat16 kernels, samples from older weights "
        "(rollout.max_staleness), or a weight sync that missed some weights",
        f"keep grpo.importance_sampling_correction on (now {g.importance_sampling_correction}), mask the worst "
        f"tokens with grpo.off_policy_mask_threshold, lower rollout.max_staleness (now "
        f"{doc.cfg.rollout.max_staleness}), or model.dtype=float32 (now {doc.cfg.model.dtype})",
        name, d.max_sampler_gap)


def memory(doc: Doctor, step: int) -> Optional[Finding]:
    d, g = doc.d, doc.cfg.grpo
    peaks = {n: doc.last(n) for n in doc.series if n.startswith("train/memory/peak_rss_gib/")
             and doc.series[n][-1][0] == step}
    node = [(n, doc.last(n)) for n in ("train/memory/node_used_fraction", "train/memory/gpu_used_fraction")
            if doc.last(n) is not None and doc.series[n][-1][0] == step and doc.last(n) > d.max_node_memory]
    plan = doc.last("train/memory/planned_peak_gib")
    peak_name = max(peaks, key=peaks.get) if peaks else None
    over_plan = plan and peak_name and peaks[peak_name] > d.max_plan_memory * plan
    if not (node or over_plan):
        return None
    seen = (f"the {'GPU' if 'gpu' in node[0][0] else 'node'} has {node[0][1]:.0%} of its memory in use "
            f"(doctor.max_node_memory {d.max_node_memory:g})" if node else
            f"a rank peaked at {peaks[peak_name]:.2f} GiB in its '{peak_name.rsplit('/', 1)[-1]}' phase, "
            f"{peaks[peak_name] / plan:.2f}x the plan's {plan:.2f} GiB (doctor.max_plan_memory {d.max_plan_memory:g})")
    return Finding(
        "memory", step, seen, "out of memory ahead: the batch too large for this node",
        f"smaller micro-batches (grpo.max_tokens_per_microbatch, now {g.max_tokens_per_microbatch}), fewer sequences "
        f"per step (grpo.per_device_train_batch_size, now {g.per_device_train_batch_size}) with more "
        f"grpo.gradient_accumulation_steps, model.gradient_checkpointing=true; `megagrpo plan --check-memory` "
        "says what fits",
        node[0][0] if node else peak_name, d.max_node_memory if node else d.max_plan_memory * plan)


CHECKS: dict[str, Callable[[Doctor, int], Optional[Finding]]] = {
    "kl": kl_drift, "entropy": entropy_collapse, "zero_advantage": zero_advantage, "reward_swing": reward_swing,
    "repetition": repetition, "grad_spike": grad_spike, "non_finite": non_finite, "sampler_gap": sampler_gap,
    "memory": memory}


def _slope(values: list[float]) -> float:
    return statistics.linear_regression(range(len(values)), values)[0] if len(values) > 1 else 0.0


def check_doctor(d: DoctorConfig) -> None:
    """doctor.*'s ranges."""
    require(d.window >= 2, f"doctor.window: {d.window} must be >= 2 (logged steps a trend check looks back over)")
    for key in ("kl_max", "entropy_min", "reward_swing", "max_sampler_gap", "max_plan_memory", "max_node_memory",
                "grad_norm_spike"):
        require(getattr(d, key) > 0, f"doctor.{key}: {getattr(d, key)} must be > 0")
    for key in ("entropy_fraction", "max_zero_advantage", "max_repeated_ngrams", "min_distinct_2"):
        require(0 <= getattr(d, key) <= 1, f"doctor.{key}: {getattr(d, key)} must be in [0, 1]")


# ---- a run read afterwards -----------------------------------------------------------------------

def examine(run_dir: str, overrides: list[str] = ()) -> tuple[list[Finding], int]:
    """The findings of a finished or running run, from its metrics.jsonl, with the thresholds of
    its config.yaml (defaults where the run has none) and `doctor.key=value` overrides; and the
    number of training steps read."""
    from megagrpo.config.loading import read_config
    saved = os.path.join(run_dir, "config.yaml")
    cfg = read_config(saved if os.path.isfile(saved) else None, list(overrides))
    check_doctor(cfg.doctor)
    doctor = Doctor(cfg)
    steps = doctor.replay(read_series(run_dir))
    return doctor.findings, steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="megagrpo doctor",
        description="Read a run's logged metrics (metrics.jsonl; finished or still running) and print what the "
                    "run doctor finds: each finding's step, what was seen, the likely cause and the fix. Exit "
                    "status: 0 no findings, 1 findings, 2 an error. Checks and thresholds: docs/monitoring.md.")
    p.add_argument("run_dir", help="a run's output_dir (holds metrics.jsonl and config.yaml)")
    p.add_argument("overrides", nargs="*",
                   help="threshold overrides, e.g. doctor.kl_max=0.5 doctor.window=10 (default: the run's own)")
    args = p.parse_args(argv)
    bad = [o for o in args.overrides if not o.startswith("doctor.")]
    if bad:
        print(f"megagrpo doctor: {bad[0]!r}: only doctor.* thresholds can be changed here "
              "(e.g. doctor.kl_max=0.5)", file=sys.stderr)
        return 2
    try:
        findings, steps = examine(args.run_dir, args.overrides)
    except (RunLogError, ConfigError, OSError) as e:
        print(f"megagrpo doctor: {e}", file=sys.stderr)
        return 2
    for finding in findings:
        print(finding.line())
    print(f"megagrpo doctor: {len(findings)} finding{'s' * (len(findings) != 1)} in {steps} training steps of "
          f"{args.run_dir} ({len(CHECKS)} checks)")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
