"""vLLM's settings from the config, written once for both ways megagrpo runs vLLM: the engine
inside the trainer process (rollout/generators.py's VLLMGenerator: keyword arguments of
`vllm.LLM`) and `vllm serve` on the generating ranks (rollout/serving.py: the same settings as
command-line flags).

    settings = vllm_settings(cfg, model_path, seed, generator_tp, on_gpu)
    vllm.LLM(**settings, ...the engine's own...)
    ["vllm serve", *serve_flags(settings), ...the server's own...]
"""
from __future__ import annotations

from megagrpo.config.schema import Config, ConfigError, max_sequence_length
from megagrpo.policy.moe import is_moe_folder


def vllm_settings(cfg: Config, model: str, seed: int, generator_tp: int, on_gpu: bool) -> dict:
    """The settings an engine and a server share (vLLM's EngineArgs names)."""
    r = cfg.rollout
    max_len = r.max_model_len or max_sequence_length(cfg)
    settings = {"model": model, "dtype": cfg.model.dtype, "seed": seed, "tensor_parallel_size": generator_tp,
                "max_model_len": max_len, "logprobs_mode": "processed_logprobs",  # as the trainer computes them
                # multi-turn rollouts send each trajectory's growing prefix again every turn
                "enable_prefix_caching": r.max_turns > 1,
                "gpu_memory_utilization": r.gpu_memory_utilization}
    if r.routing_replay == "r3" and is_moe_folder(model):  # the sampler's routes with each completion
        if not on_gpu:
            raise ConfigError(
                "rollout.routing_replay: r3 needs the sampler's routes, which vLLM 0.32 returns "
                "(enable_return_routed_experts) only under its Model Runner V2, which needs Triton on a GPU: not on "
                "the CPU build. Use r2, or rollout.engine: hf (transformers' sampler records its routes; docs/moe.md)")
        # vLLM keeps the routes beside the KV cache's blocks, and needs prefix caching for that
        settings.update(enable_return_routed_experts=True, enable_prefix_caching=True)
    if not on_gpu:
        settings.update(
            enforce_eager=True,
            # On CPU vLLM sizes its KV cache as a share of RAM minus this process's RSS, which is
            # fragile next to a trainer; reserve a fixed size instead (gpu_memory_utilization is
            # then ignored).
            kv_cache_memory_bytes=int(r.cpu_kv_cache_gb * 2**30),
            # A seeded request whose prompt is prefilled in chunks fails on CPU ("CPU Generator
            # does not use offset", vllm 0.32): prefill whole prompts (docs/upstream-issues.md).
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(4096, max_len))
    return settings


def serve_flags(settings: dict) -> list[str]:
    """The settings as `vllm serve` flags: --key-name value; true is --key-name, false --no-key-name."""
    flags = []
    for key, value in settings.items():
        name = key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{name}" if value else f"--no-{name}")
        else:
            flags += [f"--{name}", str(value)]
    return flags
