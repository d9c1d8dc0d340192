"""Expert parallelism through DeepSpeed's AutoEP: its config section, the HF-named weights out of
an AutoEP model, and its routers' routes recorded and replayed.

With a top-level DeepSpeed section {"expert_parallel": {"enabled": true, "autoep_size": ep, ...}},
`deepspeed.initialize` replaces each MoE block of the model (`model.layers.N.mlp`) by an
`AutoEPMoELayer`: a `router` (`TokenChoiceTopKRouter`, gate weight [E, H], whole on every rank)
and `experts` (`GroupedExperts`) holding only this rank's E/ep experts; tokens go to the ranks that
own their experts by all-to-all over the layer's expert-parallel group (`layer.ep_group`, the group
`groups._get_expert_parallel_group(param.group_name)`, named "ep_size_<ep>"). Under ZeRO-3 the expert
tensors are also partitioned over the expert-data-parallel group. Names, AutoEP -> transformers:

    mlp.router.gate.weight          -> mlp.gate.weight                (also aliased: mlp.gate.gate.weight)
    mlp.experts.w1, w3 [E/ep, I, H] -> mlp.experts.gate_up_proj [E, 2I, H] = cat(all w1, all w3, dim=1)
    mlp.experts.w2     [E/ep, H, I] -> mlp.experts.down_proj    [E, H, I]
    mlp.shared_experts(_gate).*     -> the preset's names (Qwen2-MoE: mlp.shared_expert(_gate).*)

ep rank r holds experts [r E/ep, (r+1) E/ep) (the layer's placement descriptor says so). Everything
else keeps its name. The routers must be hooked after `deepspeed.initialize` (it replaces them).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megagrpo.policy.weight_gather import stream_units, whole_unit

_LOGITS = "_megagrpo_gate_logits"  # where each router keeps its last gate output


def deepspeed_section(model_type: str, ep_size: int) -> dict:
    """The DeepSpeed "expert_parallel" section for an HF model_type (qwen3_moe, qwen2_moe, mixtral).

    use_grouped_mm: each projection runs as one grouped GEMM over the local experts instead of a
    Python loop of 3 x E/ep matmuls that first reads the per-expert token counts to the host (a
    device sync in every MoE layer, every forward and recompute). DeepSpeed itself swaps in its
    Triton kernel where torch._grouped_mm is slow (sm8x); the loop is only the fallback for a torch
    without _grouped_mm, where asking for grouped GEMM would fail at initialize."""
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    preset = next((name for name, p in PRESET_MODELS.items() if model_type in p.hf_model_types), None)
    if preset is None:
        raise ValueError(f"AutoEP has no preset for model_type '{model_type}' (presets: {sorted(PRESET_MODELS)})")
    if ep_size < 1:
        raise ValueError(f"expert-parallel size must be >= 1, got {ep_size}")
    return {"enabled": True, "autoep_size": int(ep_size), "preset_model": preset,
            "use_grouped_mm": hasattr(torch, "_grouped_mm")}


def is_autoep_layer(module: torch.nn.Module) -> bool:
    return getattr(type(module), "_is_autoep_layer", False)


def _preset(layer):
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    return PRESET_MODELS[layer.model_family]


def hf_name(relative: str, layer) -> str:
    """A parameter's name inside an AutoEP layer (router.gate.weight, ...) under the HF block's."""
    preset = _preset(layer)
    head, _, rest = relative.partition(".")
    if head == "router":  # the router's Linear `gate` is the HF router itself
        return f"{preset.router_pattern}.{rest[len('gate.'):] if rest.startswith('gate.') else rest}"
    hf = {"shared_experts": preset.shared_experts_pattern, "shared_experts_gate": preset.shared_experts_gate_pattern}
    return f"{hf.get(head) or head}.{rest}"


def _gather_experts(local: torch.Tensor, layer) -> torch.Tensor:
    """[E/ep, ...] on each rank of the layer's ep group -> [E, ...] in expert order, on every rank."""
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank

    group, local = layer.ep_group, local.contiguous()
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return local.clone()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local, group=group)
    full = torch.cat(parts)
    order = [e for r in range(size) for e in autoep_experts_for_rank(layer.expert_placement_descriptor, r)]
    if order != list(range(full.shape[0])):  # a non-contiguous placement: put expert e at row e
        full = full[torch.argsort(torch.tensor(order, device=full.device))]
    return full


def _experts(name: str, layer):
    preset = _preset(layer)
    if preset.expert_storage != "fused_3d" or preset.expert_w3 is not None:
        raise NotImplementedError(f"{name}: AutoEP preset '{layer.model_family}' stores experts other than as "
                                  "fused 3-D gate_up/down tensors")
    if layer.folding_group_handles is not None and layer.folding_group_handles.spec.tp_size > 1:
        raise NotImplementedError(f"{name}: AutoEP folded with tensor parallelism is not gathered here")

    def produce():
        w = layer.experts
        prefix = f"{name}.{preset.experts_pattern}"
        yield f"{prefix}.{preset.expert_w1}", _gather_experts(torch.cat([w.w1.data, w.w3.data], dim=1), layer)
        yield f"{prefix}.{preset.expert_w2}", _gather_experts(w.w2.data, layer)
    return produce


def hf_named_tensors(module: torch.nn.Module, bucket_mb: int = 256,
                     trained_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, whole tensor) for every parameter of an AutoEP model (engine.module) under the
    names the model has without AutoEP, each once (like weight_gather.named_full_tensors, which it
    is for a model without AutoEP layers). Collective: every rank iterates it to the end, the
    same sequence. The tensors are valid until the next one is taken: copy what you keep."""
    def units():
        seen, layer_name, layer = set(), None, None
        for module_name, owner in module.named_modules():  # pre-order: a layer, then its submodules
            if is_autoep_layer(owner):
                layer_name, layer = module_name, owner
            elif layer is not None and not module_name.startswith(layer_name + "."):
                layer_name, layer = None, None
            if layer is not None and owner is layer.experts:
                params = [owner.w1, owner.w2, owner.w3]
                seen.update(id(p) for p in params)
                if not trained_only or any(p.requires_grad for p in params):
                    yield params, _experts(layer_name, layer)
                continue
            for name, param in owner.named_parameters(recurse=False):
                if id(param) in seen or (trained_only and not param.requires_grad):
                    continue  # tied (or aliased) weights are sent once, under their first name
                seen.add(id(param))
                full = f"{module_name}.{name}" if module_name else name
                if layer is not None:
                    full = f"{layer_name}.{hf_name(full[len(layer_name) + 1:], layer)}"
                yield [param], whole_unit(full, param, owner)
    return stream_units(units(), bucket_mb)


# ---- routers ------------------------------------------------------------------------------------

def router_modules(module: torch.nn.Module) -> list:
    """AutoEP's routers (TokenChoiceTopKRouter) in layer order. Each is made to keep its last gate
    output (the router logits, which its forward does not return) for replace_routes."""
    routers = [m.router for m in module.modules() if is_autoep_layer(m)]
    for router in routers:
        if not getattr(router, "_megagrpo_keeps_logits", False):
            router.gate.register_forward_hook(lambda gate, inputs, out, r=router: setattr(r, _LOGITS, out))
            router._megagrpo_keeps_logits = True
    return routers


def replace_routes(router, output: tuple, experts: Optional[torch.Tensor] = None):
    """For a forward hook on an AutoEP router: its output (top_scores [T,k] float32, experts [T,k]
    int64, tokens per expert [E] int32) with `experts` ((T, k) ids, None: the router's own) routed
    instead, the gate weights recomputed from the logits at them exactly as the router does.
    Returns (output, the experts used, the logits [T, E] of this forward)."""
    top_scores, chosen, _ = output
    logits = router.__dict__.pop(_LOGITS, None)
    if logits is None:
        raise RuntimeError("AutoEP router without its logits: get the routers with router_modules() first")
    if experts is None:
        return output, chosen, logits
    from deepspeed.moe.ep_count import count_tokens_per_expert

    experts = experts.to(chosen.device, torch.long)
    if router.score_func == "softmax":
        scores = F.softmax(logits.to(torch.float32), dim=1)
    else:
        scores = torch.sigmoid(logits.to(torch.float32))
    top = scores.gather(dim=1, index=experts)
    if router.route_norm:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    top = (top * router.route_scale).to(top_scores.dtype)
    return (top, experts, count_tokens_per_expert(experts, router.num_experts)), experts, logits
