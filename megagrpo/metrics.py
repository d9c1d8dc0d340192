"""Metrics and console output: TensorBoard scalars and sample text on the main rank, the progress
bar, and the libraries' console noise kept down."""
from __future__ import annotations

import os
import warnings

import torch

from megagrpo.cluster.distributed import all_gather_1d


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
