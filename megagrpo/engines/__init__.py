"""Policy engines, one per parallel layout (DeepSpeed ZeRO 0-3 with AutoTP; DeepSpeed pipeline),
and what they run: model building, the log-prob pass, packing. The interface is in base.py."""
from __future__ import annotations


def build_engine(cfg, topology, total_steps: int):
    """The policy engine for this run's layout (a base.PolicyEngine)."""
    if topology.pp_size > 1:
        from megagrpo.engines.pipeline_engine import PipelineEngine
        return PipelineEngine(cfg, topology, total_steps)
    from megagrpo.engines.deepspeed_engine import DeepSpeedEngine
    return DeepSpeedEngine(cfg, topology, total_steps)
