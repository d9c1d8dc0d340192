"""Does a plan fit a node: the verdict with the switches that would help (`megagrpo plan
--check-memory`), and the longest sequence that trains within a node's memory. The bytes
themselves come from planning.py's peak model."""
from __future__ import annotations

from typing import Optional

import torch

from megagrpo.config.schema import Config
from megagrpo.planning import Plan, _gib, peak_memory, peak_total


def node_memory_bytes() -> tuple[int, str]:
    """What a node's ranks share: this node's RAM on CPU (MemTotal), one GPU's memory per rank
    on CUDA."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "per GPU"
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    return total, "RAM of this node"


def memory_verdict(plan: Plan, cfg: Config, ranks_per_node: int, node_bytes: int, what: str) -> Optional[str]:
    """None when the peak fits; else what does not fit and the switches that would help."""
    shared = ranks_per_node if what.startswith("RAM") else 1
    total = peak_total(plan.peak)
    need = shared * total
    if need <= node_bytes * NODE_HEADROOM:
        return None
    switches = []
    if plan.zero_stage < 3 and plan.pp == 1:
        switches.append("ZeRO-3 (deepspeed=configs/ds_zero3.json or ds_zero3_bf16.json) shards the trainer state "
                        "over the data-parallel ranks")
    if plan.dp > 1 or plan.zero_stage == 3:
        switches.append("more nodes (more data-parallel ranks split the ZeRO state further)")
    activations = plan.peak["activations"]
    if not cfg.model.gradient_checkpointing:
        switches.append(f"model.gradient_checkpointing=true (activations now {_gib(activations)})")
    if activations > 0.1 * total:
        switches.append(f"a smaller grpo.max_tokens_per_microbatch (activations {_gib(activations)} grow with it)")
    if cfg.grpo.kl_coef > 0 and plan.peak["reference"]:
        switches.append(f"grpo.kl_coef=0 (no reference model: {_gib(plan.peak['reference'])})")
    if plan.peak["teacher"]:
        switches.append(f"teacher.offload=true under ZeRO-3, or the teacher served apart with teacher.url (the "
                        f"teacher holds {_gib(plan.peak['teacher'])} here)")
    if plan.peak["logprob_head"] > 0.1 * total and cfg.grpo.logprob_chunk_size > 128:
        switches.append(f"a smaller grpo.logprob_chunk_size (the log-prob head's "
                        f"{_gib(plan.peak['logprob_head'])} grow with it)")
    if what.startswith("per GPU"):
        switches.append("ZeRO offload (configs/ds_zero3_offload.json) moves optimizer state to host RAM")
    return (f"does not fit: {shared} rank(s) x {_gib(total)} at the peak = {_gib(need)}, "
            f"more than {NODE_HEADROOM:.0%} of the {_gib(node_bytes)} {what}. Would help: " + "; ".join(switches))


NODE_HEADROOM = 0.9
"""Share of a node's memory the ranks may plan to use (the rest: the OS, page cache, launcher)."""


def longest_row(cfg: Config, plan: Plan, ranks_per_node: int, node_bytes: int, what: str) -> int:
    """The most tokens a micro-batch (one sequence alone in it, under sp its packed row) can hold
    with the peak inside the node's budget; 0 when nothing fits."""
    shared = ranks_per_node if what.startswith("RAM") else 1

    def fits(tokens: int) -> bool:
        return shared * peak_total(peak_memory(cfg, plan, plan.params_trained, tokens)) <= node_bytes * NODE_HEADROOM

    low, high = 0, 1024
    while fits(high) and high < 2**24:
        low, high = high, high * 2
    while high - low > 256:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low
