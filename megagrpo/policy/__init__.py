"""Policy engines, one per parallel layout (DeepSpeed ZeRO 0-3 with AutoTP; DeepSpeed pipeline),
and what they run: model building, the log-prob pass, packing. The interface is in base.py."""
from __future__ import annotations


def build_policy(cfg, topology, total_steps: int):
    """The policy engine for this run's layout (a base.Policy)."""
    if topology.pp_size > 1:
        from megagrpo.policy.pipeline import PipelinePolicy
        return PipelinePolicy(cfg, topology, total_steps)
    from megagrpo.policy.zero import ZeroPolicy
    return ZeroPolicy(cfg, topology, total_steps)
