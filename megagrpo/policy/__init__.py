"""The policy: the model being trained under DeepSpeed, one class per parallel layout (ZeroPolicy:
ZeRO 0-3 with AutoTP; PipelinePolicy: DeepSpeed pipeline), its frozen reference, and what they
run: model building, the log-prob pass, packing, the weight gathers. The interface is base.py."""
from __future__ import annotations


def build_policy(cfg, topology, total_steps: int):
    """The policy for this run's layout (a base.Policy)."""
    if topology.pp_size > 1:
        from megagrpo.policy.pipeline import PipelinePolicy
        return PipelinePolicy(cfg, topology, total_steps)
    from megagrpo.policy.zero import ZeroPolicy
    return ZeroPolicy(cfg, topology, total_steps)
