"""Metrics and console output: TensorBoard scalars and sample text on the main rank, the progress
bar, and the libraries' console noise kept down."""
from __future__ import annotations

import os
import time
import warnings

import torch

from megagrpo.cluster.distributed import all_gather_1d, all_reduce


class MetricsLogger:
    """Writes to <output_dir>/tensorboard when report_to is tensorboard and this is rank 0."""

    def __init__(self, output_dir: str, enabled: bool):
        self.writer = None
        self.log_dir = os.path.join(output_dir, "tensorboard")
        if enabled:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(self.log_dir)

    def scalars(self, step: int, values: dict) -> None:
        if self.writer:
            for name, value in values.items():
                self.writer.add_scalar(name, float(value), step)
            self.writer.flush()

    def text(self, step: int, tag: str, text: str) -> None:
        if self.writer:
            self.writer.add_text(tag, text, step)

    def close(self) -> None:
        if self.writer:
            self.writer.close()


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
    # one gather for every per-completion statistic: (N, functions + 4) on each dp rank
    columns = [advantages, batch.completion_lens, batch.truncated, batch.prompt_lens + batch.completion_lens]
    per_completion = torch.cat([per_function] + [c.cpu().float()[:, None] for c in columns], dim=1)
    gathered = all_gather_1d(per_completion.reshape(-1), dp_group).view(-1, per_completion.shape[1])
    *function_columns, global_adv, lengths, truncated, tokens = gathered.unbind(dim=1)
    for name, values in zip(reward_names, function_columns):
        out[f"rewards/{name}/mean"] = values.mean()
        out[f"rewards/{name}/std"] = values.std()
    out["advantages/mean"], out["advantages/std"] = global_adv.mean(), global_adv.std()
    out.update({"completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
                "completions/max_length": lengths.max(), "completions/clipped_ratio": truncated.mean(),
                "tokens_per_second": tokens.sum() / max(seconds, 1e-9)})
    return out


class PhaseClock:
    """Seconds and peak resident memory of each phase of a step, lap by lap (a phase lapped
    twice adds up its seconds and keeps the larger peak). The peak is this process's high-water
    mark (Linux VmHWM), reset at every lap through /proc/self/clear_refs, so a phase's peak
    includes its transients; 0 where /proc has neither."""

    def __init__(self):
        self.seconds, self.peak_rss_gib = {}, {}
        _reset_peak_rss()
        self._start = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase], self._start = self.seconds.get(phase, 0.0) + now - self._start, now
        self.peak_rss_gib[phase] = max(self.peak_rss_gib.get(phase, 0.0), _status_gib("VmHWM"))
        _reset_peak_rss()

    def metrics(self) -> dict:
        """time/<phase>, and memory/peak_rss_gib/<phase> and memory/rss_gib as the largest of any
        rank."""
        phases = list(self.peak_rss_gib)
        peaks = all_reduce(torch.tensor([self.peak_rss_gib[p] for p in phases] + [_status_gib("VmRSS")],
                                        dtype=torch.float64), "max").tolist()
        out = {f"time/{p}": s for p, s in self.seconds.items()}
        out.update({f"memory/peak_rss_gib/{p}": v for p, v in zip(phases, peaks)})
        out["memory/rss_gib"] = peaks[-1]
        return out


def _status_gib(field: str) -> float:
    """A /proc/self/status memory field (kB) in GiB; 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def samples_markdown(prompt, texts: list[str], rewards: list[float]) -> str:
    """A prompt and its completions with their rewards, as a TensorBoard text table."""
    rows = "\n".join(f"| {r:.3f} | {t[:300]!r} |".replace("\n", " ") for t, r in zip(texts, rewards))
    return f"**prompt:** {str(prompt)[:300]!r}\n\n| reward | completion |\n|---|---|\n{rows}"


def quiet_library_output() -> None:
    """A run's console shows megagrpo's lines, the progress bar and real warnings. vLLM logs
    INFO lines on every step and rank (prefix-cache resets, reload timings): its level is
    WARNING unless VLLM_LOGGING_LEVEL says otherwise. DeepSpeed and vLLM call collectives
    that torch marks deprecated (FutureWarning on every first use per rank): nothing a user
    can act on, so those are not shown."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def progress_bar(total: int, initial: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, disable=not enabled, desc="GRPO", unit="step",
                dynamic_ncols=True)
