"""Metrics: TensorBoard scalars and sample text on the main rank, cross-rank reductions, progress."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


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


def _comm_device() -> torch.device:
    """NCCL serves only CUDA tensors; gloo serves CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def all_gather_1d(values: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate equal-length 1-D tensors from every rank of `group` (default: all), in rank
    order; returns on CPU."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return values.cpu()
    local = values.contiguous().to(_comm_device())
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts).cpu()


def all_reduce(values: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """Element-wise sum/max/min over the ranks of `group` (default: all); returns on CPU."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        values = values.to(_comm_device(), copy=True)
        dist.all_reduce(values, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                    "min": dist.ReduceOp.MIN}[op], group=group)
    return values.cpu()


class StepStats:
    """Accumulates masked per-token sums and extrema over micro-batches; reduces across ranks."""

    def __init__(self):
        self.sums, self.maxes, self.mins = {}, {}, {}
        self.loss = 0.0

    def declare(self, means: list[str], extrema: list[str]) -> None:
        """Create these statistics empty (every rank then reduces the same names)."""
        for name in means:
            self.sums.setdefault(name, (0.0, 0.0))
        for name in extrema:
            self.maxes.setdefault(name, -float("inf"))
            self.mins.setdefault(name, float("inf"))

    def add_loss(self, share: float) -> None:
        """A micro-batch's share of the step loss (shares of one pass sum to its loss)."""
        self.loss += share

    def add_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        total, count = self.sums.get(name, (0.0, 0.0))
        self.sums[name] = (total + float((values * mask).sum()), count + float(mask.sum()))

    def add_extrema(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        self.maxes.setdefault(name, -float("inf"))
        self.mins.setdefault(name, float("inf"))
        if mask.sum() == 0:
            return
        sel = values[mask.bool()]
        self.maxes[name] = max(self.maxes.get(name, -float("inf")), float(sel.max()))
        self.mins[name] = min(self.mins.get(name, float("inf")), float(sel.min()))

    def reduce(self) -> dict:
        out = {}
        names = sorted(self.sums)
        if names:
            sums = all_reduce(torch.tensor([self.sums[n] for n in names], dtype=torch.float64))
            out.update({n: float(s / max(c, 1.0)) for n, (s, c) in zip(names, sums.tolist())})
        for table, op, suffix in ((self.maxes, "max", "max"), (self.mins, "min", "min")):
            keys = sorted(table)
            if keys:
                vals = all_reduce(torch.tensor([table[k] for k in keys], dtype=torch.float64), op)
                out.update({f"{k}/{suffix}": v for k, v in zip(keys, vals.tolist())})
        return out


def progress_bar(total: int, initial: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, disable=not enabled, desc="GRPO", unit="step",
                dynamic_ncols=True)
