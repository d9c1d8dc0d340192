"""A rank's time, memory and progress: where its start-up goes (StartupTimeline), the seconds and
peak memory of each phase of a step (PhaseClock), a warning line before the kernel's OOM killer
ends a rank (MemoryWatch, told the phase by the clocks that lap with it), and the progress bar
or line (Progress). Their figures go to the sinks of metrics.py."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Optional

import torch

from megagrpo.cluster.distributed import all_gather_1d, all_reduce


class StartupTimeline:
    """Where a rank's start-up goes, from its process's start (the interpreter and imports) to
    its first rollout, phase by phase: lap(phase) ends a phase (and tells the memory watch, if it
    has one). The main rank prints one line (the slowest rank's phases) and writes startup/* at
    the run's first step to every sink."""

    def __init__(self, watch: Optional[MemoryWatch] = None):
        self.start, self.watch = process_start_time(), watch
        self.seconds, self._last = {}, self.start

    def lap(self, phase: str) -> None:
        now = time.time()
        self.seconds[phase], self._last = self.seconds.get(phase, 0.0) + now - self._last, now
        if self.watch is not None:
            self.watch.phase = phase

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
    torch's caching allocator). Each lap tells the memory watch, if it has one, the phase it ended."""

    def __init__(self, watch: Optional[MemoryWatch] = None):
        self.seconds, self.peak_rss_gib, self.gpu_used_gib, self.watch = {}, {}, {}, watch
        self.node_used = self.gpu_used = 0.0  # the largest share of the node's (GPU's) memory in use at a lap
        _reset_peak_rss()
        self._start = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase], self._start = self.seconds.get(phase, 0.0) + now - self._start, now
        if self.watch is not None:
            self.watch.phase = phase
        self.peak_rss_gib[phase] = max(self.peak_rss_gib.get(phase, 0.0), status_gib("VmHWM"))
        _reset_peak_rss()
        self.node_used = max(self.node_used, node_used_fraction())
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            self.gpu_used_gib[phase] = max(self.gpu_used_gib.get(phase, 0.0), (total - free) / 2**30)
            self.gpu_used = max(self.gpu_used, 1 - free / total)

    def metrics(self) -> dict:
        """time/<phase>, memory/peak_rss_gib/<phase>, memory/rss_gib and memory/node_used_fraction
        (the node's memory in use, a share of MemTotal), and on CUDA memory/gpu_used_gib/<phase>
        and memory/gpu_used_fraction, as the largest of any rank."""
        phases = list(self.peak_rss_gib)
        gpu = [self.gpu_used_gib[p] for p in phases if p in self.gpu_used_gib]
        peaks = all_reduce(torch.tensor([self.peak_rss_gib[p] for p in phases] + [status_gib("VmRSS"), self.node_used,
                                         self.gpu_used] + gpu, dtype=torch.float64), "max").tolist()
        out = {f"time/{p}": s for p, s in self.seconds.items()}
        out.update({f"memory/peak_rss_gib/{p}": v for p, v in zip(phases, peaks)})
        out["memory/rss_gib"], out["memory/node_used_fraction"], gpu_used = peaks[len(phases):len(phases) + 3]
        out.update({f"memory/gpu_used_gib/{p}": v for p, v in zip(phases, peaks[len(phases) + 3:])})
        if gpu:
            out["memory/gpu_used_fraction"] = gpu_used
        return out


def status_gib(field: str) -> float:
    """A /proc/self/status memory field (kB) in GiB; 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def node_memory_gib(meminfo: str = "/proc/meminfo") -> tuple[float, float]:
    """The node's MemTotal and MemAvailable in GiB (0 for what /proc does not say)."""
    node = {}
    with contextlib.suppress(OSError, ValueError, IndexError), open(meminfo) as f:
        node = {k: int(v.split()[0]) / 2**20 for k, _, v in (line.partition(":") for line in f)
                if k in ("MemTotal", "MemAvailable")}
    return node.get("MemTotal", 0.0), node.get("MemAvailable", 0.0)


def node_used_fraction(meminfo: str = "/proc/meminfo") -> float:
    """The share of the node's memory in use (1 - MemAvailable / MemTotal); 0 where /proc says
    no MemTotal."""
    total, available = node_memory_gib(meminfo)
    return 1 - available / total if total else 0.0


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class MemoryWatch(threading.Thread):
    """One line on stderr before the kernel's OOM killer ends a rank (a launcher says only `exits
    with return code = -9`): when the node has under NODE_FREE of its memory free and this rank
    holds more than the plan's peak per rank (any amount without a plan), it names the phase
    last finished (`phase`, set by the clocks that lap with this watch: StartupTimeline,
    PhaseClock), its RSS and the plan's figure, once per phase."""

    NODE_FREE = 0.05

    def __init__(self, rank: int, planned_gib: Optional[float], meminfo: str = "/proc/meminfo",
                 phase: str = "start-up"):
        super().__init__(daemon=True, name="megagrpo-memory-watch")
        self.rank, self.planned_gib, self.meminfo, self.warned = rank, planned_gib, meminfo, set()
        self.phase = phase

    def check(self) -> Optional[str]:
        """The warning line when it is due, else None."""
        total, available = node_memory_gib(self.meminfo)
        rss, phase = status_gib("VmRSS"), self.phase
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
