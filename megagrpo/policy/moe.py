"""Mixture-of-experts policies: the routers' routes, recorded, replayed and counted.

Every router of the model (transformers' top-k router: softmax over the experts, the top k
taken, their weights renormalised where the architecture does) gets a forward hook:
  - record: the experts each token was sent to, per layer (the routes of the last forward);
  - replay: the routes given instead of the router's own choice. The gate weights are still
    the current router's probabilities, read at the replayed experts (and renormalised as the
    architecture does), so the router keeps its gradient; with the router's own routes
    replayed, the forward is bit-identical to one without the hook;
  - count: each expert's share of the real tokens per layer (the expert-load metrics), and,
    when asked, the router logits for the load-balancing loss.

Under DeepSpeed's AutoEP (parallel.expert_parallel_size > 1) the routers are AutoEP's, hooked
after deepspeed.initialize, their routes replaced through expert_parallel.replace_routes.

Routing replay R2 (rollout.routing_replay=r2): the routes of the old-policy pass are
replayed in every update pass over the same micro-batch, so a step's updates never move a
token to other experts than those its old log-prob was computed with (docs/moe.md).

Routing replay R3 (rollout.routing_replay=r3): the experts the sampler chose for every token it
fed come with the completion (Completion.routes) and are replayed in every pass, reference,
old-policy and update alike, so the trainer scores the tokens through the experts that sampled
them; the update passes replay the old-policy pass's routes, which hold the sampler's. A
generator records its routes through `trace` (HFGenerator) or vLLM's routed experts.

Also here: the checks of MoE layouts (check_moe), and the experts' checkpoint names, which the
weight sync and the export use (checkpoint_names).
"""
from __future__ import annotations

import math
import os
from typing import Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F

from megagrpo.config.schema import Config, require
from megagrpo.multimodal.models import model_config
from megagrpo.policy.expert_parallel import is_autoep_layer, replace_routes, router_modules

ROUTERS = {"qwen3_moe": "Qwen3MoeTopKRouter", "mixtral": "MixtralTopKRouter"}
"""model_type -> the transformers router class hooked here (softmax top-k routers)."""


EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""config.json keys of mixture-of-experts models (Qwen2/3-MoE, Mixtral, DeepSeek, ...)."""


def check_moe(cfg: Config) -> None:
    """A mixture-of-experts model goes where its path is tested, or is refused with the reason."""
    model = model_config(cfg.model.name_or_path)
    if not model:
        return  # a hub name: read when it loads
    experts = next((key for key in EXPERT_KEYS if model.get(key)), None)
    if experts is None:
        require(cfg.parallel.expert_parallel_size == 1,
                f"parallel.expert_parallel_size: {cfg.parallel.expert_parallel_size} with a dense model "
                f"('{cfg.model.name_or_path}' has no experts); use 1")
        return
    kind, p = model.get("model_type"), cfg.parallel
    where = f"model.name_or_path: '{cfg.model.name_or_path}' is a mixture-of-experts model ({kind}, {experts}=" \
            f"{model[experts]})"
    require(kind in ROUTERS, f"{where}; megagrpo trains {', '.join(ROUTERS)} so far (their softmax top-k routers "
            "are the ones routing replay and the expert metrics hook; docs/moe.md)")
    for key, value, why in [
            ("parallel.tensor_parallel_size", p.tensor_parallel_size,
             "AutoTP has no split plan for the 3-D expert tensors; ZeRO-3 partitions them"),
            ("parallel.pipeline_parallel_size", p.pipeline_parallel_size,
             "the pipeline's layer map holds dense decoder layers only"),
            ("parallel.sequence_parallel_size", p.sequence_parallel_size,
             "routes are recorded and replayed per packed row, which sp would split")]:
        require(value == 1, f"{key}: {value} with {where}: not supported ({why}); use 1")
    require(cfg.model.lora.r == 0 or p.expert_parallel_size == 1,
            f"model.lora.r: {cfg.model.lora.r} with parallel.expert_parallel_size {p.expert_parallel_size} and "
            f"{where}: not supported (AutoEP's expert layers under PEFT are not built); use "
            "expert_parallel_size=1 for LoRA")
    require(not cfg.model.tiled_mlp, f"model.tiled_mlp with {where}: not supported (the tiles wrap a dense MLP); "
            "set model.tiled_mlp=false")
    r = cfg.rollout
    require(r.routing_replay != "r3" or not (r.servers or r.placement == "disaggregated"),
            f"rollout.routing_replay: r3 with {where} and rollout.{'servers' if r.servers else 'placement'}: not "
            "available: `vllm serve` 0.32 does not return the sampler's routes over HTTP; use r2 (or the "
            "co-located engine)")
    ep, experts_count = p.expert_parallel_size, int(model[experts])
    require(ep >= 1 and experts_count % ep == 0,
            f"parallel.expert_parallel_size: {ep} must be >= 1 and divide the {experts_count} experts of {where}")
    world = int(os.environ.get("WORLD_SIZE", ep))
    require(world % ep == 0, f"parallel.expert_parallel_size: {ep} does not divide the world size {world}; launch "
            f"a multiple of {ep} ranks")
    require(cfg.model.router_aux_loss_coef >= 0,
            f"model.router_aux_loss_coef: {cfg.model.router_aux_loss_coef} must be >= 0 (0: off)")


def is_moe(config) -> bool:
    """Whether an HF config describes a mixture-of-experts model trained here."""
    return getattr(config, "model_type", None) in ROUTERS


def is_moe_folder(path: str) -> bool:
    """is_moe for a model folder, read from its config.json (False for a hub name)."""
    return model_config(path).get("model_type") in ROUTERS


class Routing:
    """The routers of one model in layer order, hooked. Set `replay` (per layer, (N, k) expert
    ids for the N tokens of the next forward) before a forward to replay routes; `real_tokens`
    ((N,) bool) says which of the N are not padding (logprobs.py sets it per forward)."""

    def __init__(self, model: torch.nn.Module):
        self.autoep = any(is_autoep_layer(m) for m in model.modules())
        if self.autoep:  # DeepSpeed's AutoEP replaced the MoE blocks (expert_parallel.py)
            self.routers = router_modules(model)
        else:
            kind = ROUTERS[model.config.model_type]
            self.routers = [m for m in model.modules() if type(m).__name__ == kind]
        self.num_experts = int(self.routers[0].num_experts)
        self.top_k = int(self.routers[0].top_k)
        self.replay: Optional[list[torch.Tensor]] = None  # R2: per layer, the routes to use
        self.sampler: Optional[tuple[list[torch.Tensor], torch.Tensor]] = None  # R3 (use_sampler_routes)
        self.sampler_flips = torch.zeros(2, dtype=torch.float64)  # tokens flipped, tokens the sampler fed
        self.trace: Optional[list[torch.Tensor]] = None  # when a list: every forward's routes, (N, layers, k)
        self.real_tokens: Optional[torch.Tensor] = None
        self.routes: list[Optional[torch.Tensor]] = [None] * len(self.routers)  # used by the last forward
        self.own_routes: list[Optional[torch.Tensor]] = [None] * len(self.routers)  # the routers' own choice
        self.keep_logits = False
        self.old, self.replay_old, self.aux_coef = [], False, 0.0
        self.logits: list[Optional[torch.Tensor]] = [None] * len(self.routers)
        self.load = torch.zeros(len(self.routers), self.num_experts, dtype=torch.float64)
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    @property
    def route_dtype(self) -> torch.dtype:
        """The smallest integer type that holds an expert id: routes are kept per token."""
        return torch.uint8 if self.num_experts <= 256 else torch.int16

    def _hook(self, layer: int):
        def hook(router, inputs, output):
            if self.autoep:  # (scores, experts, tokens per expert); the logits kept apart
                own = output[1].detach()
                output, experts, logits = replace_routes(router, output, self._replay_at(layer, own))
            else:  # transformers' (logits, scores, experts)
                logits, scores, experts = output
                own = experts.detach()
                replay = self._replay_at(layer, own)
                if replay is not None:
                    experts = replay.to(experts.device, torch.long)
                    chosen = F.softmax(logits.float(), dim=-1).gather(-1, experts)
                    if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalises
                        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
                    output = (logits, chosen.to(scores.dtype), experts)
            self.own_routes[layer] = own.to(self.route_dtype)
            self.routes[layer] = experts.detach().to(self.route_dtype)
            if self.keep_logits:
                self.logits[layer] = logits
            if self.trace is not None and layer == len(self.routers) - 1:
                self.trace.append(torch.stack(self.routes, dim=1).cpu())
            return output
        return hook

    def _replay_at(self, layer: int, own: torch.Tensor) -> Optional[torch.Tensor]:
        """The experts to use in `layer` instead of the router's own (None: its own): R2's
        routes of the old-policy pass, else the sampler's (R3) where it fed the token."""
        if self.replay is not None:
            return self.replay[layer]
        if self.sampler is None:
            return None
        routes, fed = self.sampler
        return torch.where(fed[:, None], routes[layer].to(own.device, own.dtype), own)

    def use_sampler_routes(self, routes: Optional[list], starts: list[int], lengths: list[int], positions: int,
                           device) -> None:
        """Replay the sampler's routes (R3) in the next forwards: routes[i] ((T, layers, k), the
        sampler's experts for the first T tokens of sequence i, or None), laid out at the flat
        positions starts[i]..starts[i]+T-1 of a forward over `positions` tokens. Tokens the
        sampler never fed (a sequence's last token, padding) keep the router's own choice.
        Under R2's replay (set by before_update) they are not laid out: that replay wins."""
        if routes is None or self.replay is not None:
            self.sampler = None
            return
        replay = torch.zeros(positions, len(self.routers), self.top_k, dtype=self.route_dtype)
        fed = torch.zeros(positions, dtype=torch.bool)
        for sequence, (route, start, length) in enumerate(zip(routes, starts, lengths)):
            if route is None:
                continue
            route = torch.from_numpy(np.asarray(route).astype(np.int64))  # vLLM: uint8, or uint16 past 256 experts
            if route.dim() != 3 or route.shape[1:] != replay.shape[1:] or len(route) > length:
                raise ValueError(f"the sampler's routes of sequence {sequence} have shape {tuple(route.shape)}; "
                                 f"expected (at most {length} tokens, {len(self.routers)} layers, top {self.top_k}): "
                                 "was the generator given another model than the trainer?")
            replay[start:start + len(route)] = route.to(self.route_dtype)
            fed[start:start + len(route)] = True
        self.sampler = ([replay[:, layer].to(device) for layer in range(len(self.routers))], fed.to(device))

    def count_sampler_flips(self) -> None:
        """Count the last forward's tokens whose router chose other experts than the sampler
        did, in any layer (moe/sampler_route_flips: what R3 replays over)."""
        if self.sampler is not None:
            routes, fed = self.sampler
            self.sampler_flips += torch.tensor([self.flipped_tokens(self.own_routes, routes, fed),
                                                int((fed & self._real(len(fed), fed.device)).sum())],
                                               dtype=torch.float64)

    def _real(self, n: int, device) -> torch.Tensor:
        real = self.real_tokens
        return torch.ones(n, dtype=torch.bool, device=device) if real is None else real.to(device)

    def recorded(self) -> list[torch.Tensor]:
        """The last forward's routes, per layer (N, k), to replay later."""
        return [r.clone() for r in self.routes]

    def count_load(self) -> None:
        """Add the last forward's real tokens to each layer's per-expert counts."""
        for layer, routes in enumerate(self.routes):
            real = self._real(routes.shape[0], routes.device)
            counts = torch.bincount(routes[real].reshape(-1).long(), minlength=self.num_experts)
            self.load[layer] += counts.double().cpu()

    def flipped_tokens(self, routes: list[torch.Tensor], old: list[torch.Tensor],
                       among: Optional[torch.Tensor] = None) -> int:
        """The real tokens (of those `among`, when given) whose experts in `routes` differ from
        `old` in any layer: the route flips between two passes over the same tokens."""
        real = self._real(old[0].shape[0], old[0].device)
        if among is not None:
            real = real & among
        differs = torch.zeros_like(real)
        for now, before in zip(routes, old):
            differs |= (now.sort(dim=-1).values != before.sort(dim=-1).values).any(dim=-1)
        return int((differs & real).sum())

    # ---- one training step's update passes ----------------------------------------------------

    def begin_step(self, old_routes: list, replay: bool, aux_coef: float) -> None:
        """old_routes: per micro-batch, the old-policy pass's routes ([] when there was none);
        replay: replay them in the update passes (R2); aux_coef: the load-balancing loss's."""
        self.old, self.replay_old, self.aux_coef = old_routes, replay, aux_coef
        self.keep_logits = aux_coef > 0
        self.flips = torch.zeros(3, dtype=torch.float64)  # used routes flipped, own routes flipped, real tokens
        self.aux = torch.zeros(2, dtype=torch.float64)  # loss summed, forwards

    def before_update(self, micro_batch: int) -> None:
        self.replay = self.old[micro_batch] if self.replay_old and self.old else None

    def after_update(self, micro_batch: int, pass_index: int, weight: float):
        """Count the forward (load in the first pass; route flips against the old-policy pass
        in later ones, where the weights have moved) and return its share of the
        load-balancing loss (weight x aux_coef x loss; 0 when off). The replayed routes stay
        set until the next forward: gradient checkpointing recomputes it in backward."""
        if pass_index == 0:
            self.count_load()
        elif self.old:
            old = self.old[micro_batch]
            real = int(self._real(old[0].shape[0], old[0].device).sum())
            self.flips += torch.tensor([self.flipped_tokens(self.routes, old),
                                        self.flipped_tokens(self.own_routes, old), real], dtype=torch.float64)
        if self.aux_coef <= 0:
            return 0.0
        loss = self.aux_loss()
        self.aux += torch.tensor([float(loss.detach()), 1.0], dtype=torch.float64)
        return self.aux_coef * weight * loss

    def end_step(self, reduce_sum) -> dict:
        """The step's MoE metrics, summed over the ranks by reduce_sum: expert load per layer,
        route flips (moe/route_flips: tokens whose experts in an update pass differ from the
        old-policy pass's, 0 under replay; moe/route_flips_own: those whose router chose
        differently, which replay overrode; moe/sampler_route_flips: tokens the sampler fed whose
        router chose other experts than the sampler did, which R3 overrides) and the
        load-balancing loss."""
        out = self.load_metrics(reduce_sum)
        flips, aux, sampler = reduce_sum(self.flips), reduce_sum(self.aux), reduce_sum(self.sampler_flips.clone())
        self.sampler_flips.zero_()
        if sampler[1] > 0:
            out["moe/sampler_route_flips"] = float(sampler[0] / sampler[1])
        if flips[2] > 0:
            out["moe/route_flips"] = float(flips[0] / flips[2])
            out["moe/route_flips_own"] = float(flips[1] / flips[2])
        if aux[1] > 0:
            out["moe/aux_loss"] = float(aux[0] / aux[1])
        self.keep_logits, self.old, self.replay = False, [], None
        return out

    def aux_loss(self) -> torch.Tensor:
        """The last forward's load-balancing loss over its real tokens: the Switch
        Transformer's, as transformers computes it over all the layers' router logits."""
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        real = self._real(self.logits[0].shape[0], self.logits[0].device)
        return load_balancing_loss_func(tuple(logits[real] for logits in self.logits), self.num_experts,
                                        self.top_k, None)

    def load_metrics(self, reduce_sum) -> dict:
        """Expert load per layer since the last call, summed over the ranks by `reduce_sum`:
        the largest and smallest expert's share of the tokens routed, and the entropy of the
        shares over log(experts) (1: perfectly even). Also the worst layer's of each."""
        counts = reduce_sum(self.load.clone())
        self.load.zero_()
        out = {}
        for layer, row in enumerate(counts):
            total = float(row.sum())
            if total == 0:
                continue
            share = row / total
            entropy = -float((share[share > 0] * share[share > 0].log()).sum()) / math.log(self.num_experts)
            out[f"moe/layer_{layer}/load_max"] = float(share.max())
            out[f"moe/layer_{layer}/load_min"] = float(share.min())
            out[f"moe/layer_{layer}/load_entropy"] = entropy
        if out:
            for what, worst in (("load_max", max), ("load_min", min), ("load_entropy", min)):
                out[f"moe/{what}"] = worst(v for k, v in out.items() if k.endswith("/" + what))
        return out


def checkpoint_names(tensors: Iterator[tuple[str, torch.Tensor]], module: torch.nn.Module):
    """An MoE model's (name, tensor) stream under its checkpoint's names: transformers holds the
    experts of a layer as 3-D tensors (experts.gate_up_proj, experts.down_proj) and writes them
    back per expert (experts.E.gate_proj.weight, or Mixtral's block_sparse_moe.experts.E.w1),
    which vLLM's loaders and every other reader take. transformers' own reverse conversion,
    one tensor at a time."""
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in tensors:
        yield from revert_weight_conversion(module, {name: tensor}).items()


def checkpoint_slots(module: torch.nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """checkpoint_names inverted: for each checkpoint name of the module's weights that is not
    a parameter's own, (parameter name, the flat indices of the parameter it fills). The
    conversion only rearranges elements, so running it over each parameter's element indices
    says where every element of a per-expert tensor goes."""
    slots = {}
    for name, param in module.named_parameters():
        index = torch.arange(param.numel()).view(param.shape)
        for converted, where in checkpoint_names([(name, index)], module):
            if converted != name:
                slots[converted] = (name, where)
    return slots


def routing_of(model) -> Optional[Routing]:
    """The Routing attached to a (DeepSpeed-wrapped) model, or None for a dense one."""
    module = getattr(model, "module", model)
    return getattr(module, "megagrpo_routing", None)


def attach_routing(model: torch.nn.Module) -> Optional[Routing]:
    """Hook the routers of an MoE model: transformers' before deepspeed.initialize, AutoEP's
    after it (it replaces the MoE blocks); None for a dense model."""
    if not is_moe(model.config):
        return None
    model.megagrpo_routing = Routing(model)
    return model.megagrpo_routing
