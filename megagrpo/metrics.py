"""Metrics and where they go: every metric to every sink of logging.report_to (TensorBoard,
metrics.jsonl, W&B) on the main rank; the step's rollout metrics, gathered over the dp ranks;
a step's samples as a text table. A rank's time, memory and progress: monitoring.py; the
libraries' console noise: console.py."""
from __future__ import annotations

import json
import os
import secrets
from typing import Optional

import torch

from megagrpo.cluster.distributed import all_gather_1d
from megagrpo.config.schema import SINKS, ConfigError, require
from megagrpo.run_logs import cut_logs_after


def check_report_to(report_to) -> None:
    """logging.report_to, as config/loading.py wrote it out (a list of sinks: a single name made
    a list of one, all and none expanded): unknown names, and wandb when it is not installed,
    are refused here."""
    require(isinstance(report_to, list) and all(isinstance(n, str) for n in report_to),
            f"logging.report_to: {report_to!r} must be a name or a list of names from {', '.join(SINKS)}, none, all")
    unknown = [n for n in report_to if n not in SINKS]
    if unknown:
        raise ConfigError(f"logging.report_to: unknown sink {unknown[0]!r}; use {', '.join(SINKS)}, none or all")
    if "wandb" in report_to:
        import importlib.util
        require(importlib.util.find_spec("wandb") is not None,
                "logging.report_to has wandb but the wandb package is not installed: pip install wandb "
                "(or `pip install -e .[wandb]`), or remove wandb from logging.report_to")


class MetricsLogger:
    """Every metric to every sink of logging.report_to, on the main rank only, from this one
    place: TensorBoard event files (output_dir/tensorboard), output_dir/metrics.jsonl (one JSON
    object per logged step: {"step": N, name: value, ...}), and W&B (project, run name and
    tags from logging.*, the resolved config as the run's config; its id kept in
    output_dir/wandb_run_id, so a resumed run continues it). Every sink gets the same names and
    steps; a resumed run first drops what came after its checkpoint (resumed_at). The resolved
    config goes to output_dir/config.yaml."""

    def __init__(self, output_dir: str, logging_cfg, enabled: bool, config: Optional[dict] = None):
        sinks = logging_cfg.report_to if enabled else []
        self.enabled = enabled
        self.output_dir, self.log_dir = output_dir, os.path.join(output_dir, "tensorboard")
        self.writer = self.jsonl = self.wandb = None
        if "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(self.log_dir)
        if "jsonl" in sinks:
            os.makedirs(output_dir, exist_ok=True)
            self.jsonl = open(os.path.join(output_dir, "metrics.jsonl"), "a")
        if "wandb" in sinks:
            self.wandb = _start_wandb(output_dir, logging_cfg, config)
        if enabled and config is not None:  # the resolved config, for `megagrpo doctor` and later readers
            import yaml
            os.makedirs(output_dir, exist_ok=True)
            with open(os.path.join(output_dir, "config.yaml"), "w") as f:
                yaml.safe_dump(config, f, sort_keys=False)

    def resumed_at(self, step: int) -> None:
        """The run resumed from its step-`step` checkpoint: what the killed attempt logged after
        that step goes, so that no step appears twice: metrics.jsonl and the run's other logs
        cut back (cut_logs_after), TensorBoard's later events purged from view (purge_step).
        W&B keeps the steps it has and takes the run from past them. Main rank only."""
        if not self.enabled:
            return
        if self.jsonl:
            self.jsonl.close()
        cut_logs_after(self.output_dir, step)
        if self.jsonl:
            self.jsonl = open(os.path.join(self.output_dir, "metrics.jsonl"), "a")
        if self.writer:
            from torch.utils.tensorboard import SummaryWriter
            self.writer.close()
            self.writer = SummaryWriter(self.log_dir, purge_step=step + 1)

    def scalars(self, step: int, values: dict) -> None:
        values = {name: float(value) for name, value in values.items()}
        if self.writer:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()
        if self.jsonl:
            self.jsonl.write(json.dumps({"step": step, **values}) + "\n")
            self.jsonl.flush()
        if self.wandb:
            self.wandb.log(values, step=step)

    def finding(self, step: int, check: str, line: str) -> None:
        """A run doctor's finding to every sink: doctor/<check> = 1 at its step, and its line as
        text (TensorBoard's text tab; a W&B alert)."""
        self.scalars(step, {f"doctor/{check}": 1.0})
        self.text(step, "doctor", line)
        if self.wandb:
            self.wandb.alert(title=f"megagrpo doctor: {check}", text=line, level="WARN")

    def how_to_watch(self) -> str:
        """The commands that show what this logger wrote."""
        ways = ([f"tensorboard --logdir {self.log_dir}"] if self.writer else []) + (
            [f"megagrpo report {self.output_dir}"] if self.jsonl else [])
        return f"Watch with: {' or '.join(ways)}" if ways else ""

    def text(self, step: int, tag: str, text: str) -> None:
        if self.writer:
            self.writer.add_text(tag, text, step)

    def close(self) -> None:
        if self.writer:
            self.writer.close()
        if self.jsonl:
            self.jsonl.close()
        if self.wandb:
            self.wandb.finish()


def _start_wandb(output_dir: str, logging_cfg, config: Optional[dict]):
    """A W&B run in output_dir/wandb; WANDB_MODE (online, offline, disabled) as the user sets it.
    Its id is kept in output_dir/wandb_run_id: a run started again in the same output_dir (a
    resume) continues the same W&B run."""
    import wandb
    id_file = os.path.join(output_dir, "wandb_run_id")
    os.makedirs(output_dir, exist_ok=True)
    if os.path.isfile(id_file):
        with open(id_file) as f:
            run_id = f.read().strip()
    else:
        run_id = secrets.token_hex(4)  # (W&B's own ids: 8 characters of [a-z0-9])
        with open(id_file, "w") as f:
            f.write(run_id + "\n")
    try:
        return wandb.init(project=logging_cfg.wandb_project, dir=output_dir, config=config, id=run_id,
                          resume="allow", name=logging_cfg.run_name or os.path.basename(os.path.normpath(output_dir)),
                          tags=list(logging_cfg.wandb_tags) or None)
    except Exception as e:  # noqa: BLE001 - wandb raises its own errors (no login, no network)
        raise ConfigError(f"logging.report_to has wandb, but W&B could not start ({type(e).__name__}: {e}); "
                          "log in with `wandb login`, run with WANDB_MODE=offline (sync later with "
                          "`wandb sync`), or remove wandb from logging.report_to") from None


def rollout_metrics(rewards: torch.Tensor, per_function: torch.Tensor, advantages: torch.Tensor,
                    batch, reward_names: list[str], num_generations: int, seconds: float,
                    dp_group=None) -> dict:
    """Rewards (total and per function), advantages, completion lengths and tokens per second
    (over the step's `seconds`) of the step over every dp rank. `rewards` is already global;
    the per-completion columns are gathered."""
    grouped = rewards.view(-1, num_generations)
    out = {"reward": rewards.mean(), "reward_std": rewards.std(),
           "reward_min": rewards.min(), "reward_max": rewards.max(),
           "frac_reward_zero_std": (grouped.std(dim=1) < 1e-6).float().mean()}
    # one gather for every per-completion statistic: (N, functions + 6) on each dp rank
    repeated, distinct = repetition(batch.completion_ids, batch.completion_lens, num_generations)
    columns = [advantages, batch.completion_lens, batch.truncated, batch.prompt_lens + batch.completion_lens,
               repeated, distinct]
    per_completion = torch.cat([per_function] + [c.cpu().float()[:, None] for c in columns], dim=1)
    gathered = all_gather_1d(per_completion.reshape(-1), dp_group).view(-1, per_completion.shape[1])
    *function_columns, global_adv, lengths, truncated, tokens, repeated, distinct = gathered.unbind(dim=1)
    for name, values in zip(reward_names, function_columns):
        out[f"rewards/{name}/mean"] = values.mean()
        out[f"rewards/{name}/std"] = values.std()
    out["advantages/mean"], out["advantages/std"] = global_adv.mean(), global_adv.std()
    out.update({"completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
                "completions/max_length": lengths.max(), "completions/clipped_ratio": truncated.mean(),
                "completions/repeated_ngrams": repeated.mean(), "completions/distinct_2": distinct.mean(),
                "tokens_per_second": tokens.sum() / max(seconds, 1e-9)})
    return out


def repetition(completion_ids: torch.Tensor, completion_lens: torch.Tensor, num_generations: int,
               n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion (row), two measures of repeated content on its token ids: the share of its
    n-grams that repeat an earlier n-gram of the same completion (0: none; a completion looping
    on one phrase nears 1), and its group's distinct-2 (the group's distinct bigrams over all its
    bigrams: 1 when the G completions share none, about 1/G when they are the same text)."""
    rows = [ids[:length] for ids, length in zip(completion_ids.cpu().long(), completion_lens.cpu().tolist())]
    repeated = [1 - _gram_keys(ids, n).unique().numel() / max(1, len(ids) - n + 1) if len(ids) >= n else 0.0
                for ids in rows]
    distinct = []
    for start in range(0, len(rows), num_generations):
        group = rows[start:start + num_generations]
        bigrams = torch.cat([_gram_keys(ids, 2) for ids in group])
        distinct += [bigrams.unique().numel() / bigrams.numel() if bigrams.numel() else 1.0] * len(group)
    return torch.tensor(repeated), torch.tensor(distinct)


def _gram_keys(ids: torch.Tensor, n: int) -> torch.Tensor:
    """One int64 key per n-gram of `ids` (a polynomial hash; int64 arithmetic wraps around)."""
    count = max(0, len(ids) - n + 1)
    keys = torch.zeros(count, dtype=torch.long)
    for k in range(n):
        keys = keys * 1_000_003 + ids[k:k + count]
    return keys


def samples_markdown(prompt, texts: list[str], rewards: list[float]) -> str:
    """A prompt and its completions with their rewards, as a TensorBoard text table."""
    rows = "\n".join(f"| {r:.3f} | {t[:300]!r} |".replace("\n", " ") for t, r in zip(texts, rewards))
    return f"**prompt:** {str(prompt)[:300]!r}\n\n| reward | completion |\n|---|---|\n{rows}"
