"""Metrics and console output: every metric to every sink (TensorBoard, metrics.jsonl, W&B) on
the main rank, the progress bar (or a compact line per logged step when stdout is not a
terminal), and the libraries' console noise kept down."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
import threading
import time
import warnings
from typing import Optional

import torch

from megagrpo.cluster.distributed import all_gather_1d, all_reduce
from megagrpo.config.schema import SINKS, ConfigError, require


def report_sinks(report_to) -> list[str]:
    """logging.report_to as a list of sinks (config/loading.py has written a single name as a
    list, all and none out). Unknown names, and wandb when it is not installed, are refused here."""
    names = [report_to] if isinstance(report_to, str) else report_to
    require(isinstance(names, list) and all(isinstance(n, str) for n in names),
            f"logging.report_to: {report_to!r} must be a name or a list of names from {', '.join(SINKS)}, none, all")
    if "all" in names:
        names = list(SINKS)
    unknown = [n for n in names if n not in SINKS + ("none",)]
    if unknown:
        raise ConfigError(f"logging.report_to: unknown sink {unknown[0]!r}; use {', '.join(SINKS)}, none or all")
    names = [n for n in dict.fromkeys(names) if n != "none"]
    if "wandb" in names:
        import importlib.util
        require(importlib.util.find_spec("wandb") is not None,
                "logging.report_to has wandb but the wandb package is not installed: pip install wandb "
                "(or `pip install -e .[wandb]`), or remove wandb from logging.report_to")
    return names


class MetricsLogger:
    """Every metric to every sink of logging.report_to, on the main rank only, from this one
    place: TensorBoard event files (output_dir/tensorboard), output_dir/metrics.jsonl (one JSON
    object per logged step: {"step": N, name: value, ...}), and W&B (project, run name and
    tags from logging.*, the resolved config as the run's config; its id kept in
    output_dir/wandb_run_id, so a resumed run continues it). Every sink gets the same names and
    steps; a resumed run first drops what came after its checkpoint (resumed_at)."""

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


RUN_LOGS = ("metrics.jsonl", "eval_history.jsonl", "prompts_seen.jsonl")
"""The run's append-only logs in output_dir, one JSON object with a "step" per line."""


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


class StartupTimeline:
    """Where a rank's start-up goes, from its process's start (the interpreter and imports) to
    its first rollout, phase by phase: lap(phase) ends a phase. The main rank prints one line
    (the slowest rank's phases) and writes startup/* at the run's first step to every sink."""

    def __init__(self):
        self.start = process_start_time()
        self.seconds, self._last = {}, self.start

    def lap(self, phase: str) -> None:
        now = time.time()
        self.seconds[phase], self._last = self.seconds.get(phase, 0.0) + now - self._last, now
        _last_phase[0] = phase

    def slowest(self) -> dict:
        """The phases of the job's slowest rank (the one whose process start lies furthest
        back), each in seconds, and their total: the job starts its first rollout together."""
        phases = list(self.seconds) + ["total"]
        mine = torch.tensor([self.seconds[p] for p in self.seconds] + [self._last - self.start], dtype=torch.float64)
        every = all_gather_1d(mine).view(-1, len(phases))
        return dict(zip(phases, every[every[:, -1].argmax()].tolist()))

    @staticmethod
    def line(slowest: dict) -> str:
        phases = ", ".join(f"{p} {s:.1f}" for p, s in slowest.items() if p != "total")
        return f"ready in {slowest['total']:.1f} s from the process start: {phases} (the slowest rank)"


def process_start_time() -> float:
    """This process's start as a Unix time (Linux /proc; elsewhere: now)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


class PhaseClock:
    """Seconds and peak resident memory of each phase of a step, lap by lap (a phase lapped
    twice adds up its seconds and keeps the larger peak). The peak is this process's high-water
    mark (Linux VmHWM), reset at every lap through /proc/self/clear_refs, so a phase's peak
    includes its transients; 0 where /proc has neither. On CUDA also the GPU memory in use at
    the phase's end (the whole device's: the trainer's and vLLM's, which allocates outside
    torch's caching allocator)."""

    def __init__(self):
        self.seconds, self.peak_rss_gib, self.gpu_used_gib = {}, {}, {}
        _reset_peak_rss()
        self._start = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase], self._start = self.seconds.get(phase, 0.0) + now - self._start, now
        _last_phase[0] = phase
        self.peak_rss_gib[phase] = max(self.peak_rss_gib.get(phase, 0.0), _status_gib("VmHWM"))
        _reset_peak_rss()
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            self.gpu_used_gib[phase] = max(self.gpu_used_gib.get(phase, 0.0), (total - free) / 2**30)

    def metrics(self) -> dict:
        """time/<phase>, memory/peak_rss_gib/<phase> and memory/rss_gib, and on CUDA
        memory/gpu_used_gib/<phase>, as the largest of any rank."""
        phases = list(self.peak_rss_gib)
        gpu = [self.gpu_used_gib[p] for p in phases if p in self.gpu_used_gib]
        peaks = all_reduce(torch.tensor([self.peak_rss_gib[p] for p in phases] + [_status_gib("VmRSS")] + gpu,
                                        dtype=torch.float64), "max").tolist()
        out = {f"time/{p}": s for p, s in self.seconds.items()}
        out.update({f"memory/peak_rss_gib/{p}": v for p, v in zip(phases, peaks)})
        out["memory/rss_gib"] = peaks[len(phases)]
        out.update({f"memory/gpu_used_gib/{p}": v for p, v in zip(phases, peaks[len(phases) + 1:])})
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


_last_phase = ["start-up"]  # the phase a PhaseClock or the start-up timeline lapped last


class MemoryWatch(threading.Thread):
    """One line on stderr before the kernel's OOM killer ends a rank (a launcher says only `exits
    with return code = -9`): when the node has under NODE_FREE of its memory free and this rank
    holds more than the plan's peak per rank (any amount without a plan), it names the phase
    last finished, its RSS and the plan's figure, once per phase."""

    NODE_FREE = 0.05

    def __init__(self, rank: int, planned_gib: Optional[float], meminfo: str = "/proc/meminfo"):
        super().__init__(daemon=True, name="megagrpo-memory-watch")
        self.rank, self.planned_gib, self.meminfo, self.warned = rank, planned_gib, meminfo, set()

    def check(self) -> Optional[str]:
        """The warning line when it is due, else None."""
        node = {}
        with contextlib.suppress(OSError, ValueError, IndexError), open(self.meminfo) as f:
            node = {k: int(v.split()[0]) / 2**20 for k, _, v in (line.partition(":") for line in f)
                    if k in ("MemTotal", "MemAvailable")}
        total, available = node.get("MemTotal", 0.0), node.get("MemAvailable", 0.0)
        rss, phase = _status_gib("VmRSS"), _last_phase[0]
        if not total or available > self.NODE_FREE * total or phase in self.warned or (
                self.planned_gib is not None and rss <= self.planned_gib):
            return None
        self.warned.add(phase)
        plan = (f"above the plan's {self.planned_gib:.2f} GiB per rank" if self.planned_gib is not None
                else "(no plan of host memory for this layout)")
        return (f"[megagrpo] rank {self.rank}: the node has {available:.2f} of {total:.2f} GiB free and this "
                f"rank holds {rss:.2f} GiB, {plan}, after the '{phase}' phase; the kernel may end the run "
                "(a rank it kills exits with -9). `megagrpo plan --check-memory` says what would fit")

    def run(self) -> None:
        while True:
            time.sleep(0.5)
            line = self.check()
            if line:
                print(line, file=sys.stderr, flush=True)


def samples_markdown(prompt, texts: list[str], rewards: list[float]) -> str:
    """A prompt and its completions with their rewards, as a TensorBoard text table."""
    rows = "\n".join(f"| {r:.3f} | {t[:300]!r} |".replace("\n", " ") for t, r in zip(texts, rewards))
    return f"**prompt:** {str(prompt)[:300]!r}\n\n| reward | completion |\n|---|---|\n{rows}"


def quiet_library_output() -> None:
    """A run's console shows megagrpo's lines, the progress bar and real warnings. vLLM logs
    INFO lines on every step and rank (prefix-cache resets, reload timings): its level is
    WARNING unless VLLM_LOGGING_LEVEL says otherwise. The upstream warnings known not to apply
    to a megagrpo job are filtered, and progress bars of model loading and data preparation
    are drawn on a terminal only (megagrpo/console.py, docs/upstream-issues.md). DeepSpeed and
    vLLM call collectives that torch marks deprecated (FutureWarning on every first use per
    rank): nothing a user can act on, so those are not shown; nor is torch's warning that a
    barrier uses the current CUDA device, which in a world of one DeepSpeed leaves unbound and
    init_distributed sets to the rank's GPU (docs/upstream-issues.md)."""
    from megagrpo.console import quiet_console

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    quiet_console()
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"barrier\(\): using the device under current context",
                            category=UserWarning)


class Progress:
    """The run's progress on the main rank: a tqdm bar on a terminal; where stdout is not one
    (SLURM, nohup, a pipe), one compact line every `every` steps instead of carriage returns:
    step, reward, KL, step time, tokens/s and the time left."""

    def __init__(self, total: int, initial: int, enabled: bool, every: int):
        self.total, self.every, self.enabled = total, every, enabled
        self.bar = None
        self.start, self.first = time.perf_counter(), initial
        if enabled and sys.stdout.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=initial, desc="GRPO", unit="step", dynamic_ncols=True)

    def update(self, step: int, metrics: dict) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{metrics['reward']:.3f}", step_s=f"{metrics['time/step']:.1f}")
        elif self.enabled and (step % self.every == 0 or step == self.total):
            left = (time.perf_counter() - self.start) / max(1, step - self.first) * (self.total - step)
            print(f"[megagrpo] step {step}/{self.total} reward {metrics['reward']:.3f} "
                  f"kl {metrics.get('kl', 0.0):.4f} step {metrics['time/step']:.2f}s "
                  f"tokens/s {metrics.get('tokens_per_second', 0.0):.0f} eta {_clock(left)}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
