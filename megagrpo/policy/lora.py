"""LoRA policies (model.lora): peft adapters on a frozen base model.

    model = add_adapters(model, cfg.model.lora, seed)     # before deepspeed.initialize
    with adapters_disabled(model): ...                    # the KL reference: the base itself
    merged_full_tensors(model, bucket_mb, adapted_only)   # (HF name, W + s B A): sync, export
    adapter_tensors(model)                                # PEFT's saved names: an adapter folder

Only the adapters (and modules_to_save) have requires_grad, so only they get gradients and
optimizer state; the base weights stay partitioned under ZeRO-3 as in full fine-tuning.
What vLLM and the HF export receive is the merged weight W + (alpha / r) B A, computed per
gathered bucket into a new tensor: the trainer's base weights are never modified.
After the first sync only the adapted layers move (`adapted_only`): every linear layer beside
an adapted one under the same parent goes with it, since vLLM fuses siblings (q/k/v into
qkv_proj, gate/up into gate_up_proj) and a fused layer must receive all of its parts.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Iterator, Optional

import torch

from megagrpo.config.schema import Config, ConfigError, LoraConfig, require
from megagrpo.multimodal.models import in_language_model, is_vision_language
from megagrpo.policy.moe import is_moe, is_moe_folder

ADAPTER = "default"  # peft's adapter name; the only one a policy has
ALL_LINEAR = "all-linear"


def lora_alpha(lora: LoraConfig) -> float:
    return float(lora.alpha) if lora.alpha is not None else 2.0 * lora.r


def target_modules(lora: LoraConfig, model: torch.nn.Module):
    """peft's target_modules for `model`: as configured for a dense text model. For a
    vision-language model or a mixture of experts, the full names of the language model's
    linear layers that the targets match: peft's all-linear, and short names such as q_proj,
    would also match the image encoder's and the connector's layers (docs/multimodal.md), and
    peft would adapt an MoE's 3-D expert tensors, which the merged weight sync does not merge
    (docs/moe.md)."""
    if not (hasattr(model.config, "vision_config") or is_moe(model.config)):
        return _configured_targets(lora)
    return sorted(name for name in _linear_layers(model)
                  if in_language_model(name) and any(_is_target(name, t) for t in lora.target_modules))


def _configured_targets(lora: LoraConfig):
    """model.lora.target_modules as peft takes them (all-linear as its one string)."""
    return ALL_LINEAR if ALL_LINEAR in lora.target_modules else list(lora.target_modules)


def peft_config(lora: LoraConfig, base_model: str = "", targets=None):
    """peft's LoraConfig; targets: target_modules(lora, model) where the model is known, else
    read from the base model's config (a VLM's language-model layers)."""
    import peft

    if targets is None:
        explicit = bool(base_model) and (is_vision_language(base_model) or is_moe_folder(base_model))
        targets = target_modules(lora, meta_model(base_model)) if explicit else _configured_targets(lora)
    return peft.LoraConfig(r=lora.r, lora_alpha=lora_alpha(lora), lora_dropout=lora.dropout,
                           target_modules=targets, modules_to_save=list(lora.modules_to_save) or None,
                           bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model or None)


def add_adapters(model: torch.nn.Module, lora: LoraConfig, seed: int):
    """The peft model around `model`, its adapters initialised from `seed` (A random, B = 0),
    so that every rank and every layout starts from the same adapters."""
    import peft

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, peft_config(lora, model.config.name_or_path, target_modules(lora, model)))


def adapters_disabled(module: torch.nn.Module):
    """The base model: adapters (and modules_to_save) off for the duration (the reference)."""
    return module.disable_adapter()


# ---- validation, before any model is built ---------------------------------------------------

def check_lora(cfg: Config) -> None:
    """model.lora's ranges and the layouts it supports; the target modules against the model's
    linear layers (read from its config on the meta device) when the folder is local."""
    lora = cfg.model.lora
    if lora.r == 0:
        return
    require(lora.r > 0, f"model.lora.r: {lora.r} must be > 0 (0 trains full weights)")
    require(lora_alpha(lora) > 0, f"model.lora.alpha: {lora.alpha} must be > 0, e.g. {2 * lora.r}")
    require(0 <= lora.dropout < 1, f"model.lora.dropout: {lora.dropout} must be in [0, 1)")
    require(bool(lora.target_modules), "model.lora.target_modules is empty: name the linear layers to adapt, "
            "e.g. [q_proj, v_proj], or [all-linear]")
    for key, size in (("tensor_parallel_size", cfg.parallel.tensor_parallel_size),
                      ("pipeline_parallel_size", cfg.parallel.pipeline_parallel_size)):
        require(size == 1, f"model.lora with parallel.{key}={size} is not supported: a LoRA policy runs "
                "data-parallel (ZeRO 0-3; its frozen base shards under ZeRO-3 and its optimizer state is "
                f"small); set parallel.{key}=1")
    require(not cfg.grpo.sync_ref_model, "grpo.sync_ref_model with model.lora is not supported: a LoRA policy's "
            "reference is its base model with the adapters disabled (no copy to move); set grpo.sync_ref_model=false")
    require("lm_head" not in lora.modules_to_save, "model.lora.modules_to_save: the output head (lm_head) "
            "cannot be trained beside the adapters (the fused log-prob head reads its weight); remove it")
    if os.path.isfile(os.path.join(cfg.model.name_or_path, "config.json")):
        check_target_modules(lora, cfg.model.name_or_path)


def meta_model(path: str):
    """The model of an HF folder's config on the meta device (no memory, no weights read)."""
    from transformers import AutoConfig

    from megagrpo.multimodal.models import auto_model_class_of
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return auto_model_class_of(config).from_config(config)


def _linear_layers(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The model's linear layers by name, the output head excluded."""
    head = model.get_output_embeddings()
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}


def _is_target(name: str, target: str) -> bool:
    """peft's matching of target_modules: all-linear, the name, or its last dotted parts."""
    return target == ALL_LINEAR or name == target or name.endswith("." + target)


def _is_saved(name: str, module: str) -> bool:
    """peft's matching of modules_to_save: any name ending so (no dot needed: 'norm' matches
    'input_layernorm')."""
    return name.endswith(module)


def count_trained_parameters(model_path: str, lora: LoraConfig) -> int:
    """Parameters a LoRA policy trains: r x (in + out) per adapted linear layer, plus the
    modules to save; from the model's config on the meta device."""
    model = meta_model(model_path)
    targets = target_modules(lora, model)
    targets = [targets] if isinstance(targets, str) else targets
    adapters = sum(lora.r * (m.in_features + m.out_features) for name, m in _linear_layers(model).items()
                   if any(_is_target(name, t) for t in targets))
    saved = sum(p.numel() for name, m in model.named_modules()
                if any(_is_saved(name, t) for t in lora.modules_to_save) for p in m.parameters())
    return adapters + saved


def check_target_modules(lora: LoraConfig, model_path: str) -> None:
    """Every target module and every module to save matches a module of the model."""
    model = meta_model(model_path)
    linear = _linear_layers(model)
    names = [name for name, _ in model.named_modules()]
    short = sorted({n.rsplit(".", 1)[-1] for n in linear})
    for target in lora.target_modules:
        require(any(_is_target(n, target) for n in linear),
                f"model.lora.target_modules: '{target}' matches no linear layer of {model_path}; its linear "
                f"layers are {', '.join(short)} (or use all-linear)")
    require(bool(target_modules(lora, model)), f"model.lora.target_modules: {list(lora.target_modules)} match "
            f"no linear layer of the language model of {model_path} (the image encoder is not adapted)")
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for module in lora.modules_to_save:
        require(any(_is_saved(n, module) for n in names),
                f"model.lora.modules_to_save: '{module}' matches no module of {model_path}")
        require(not (tied and module == "embed_tokens"),
                f"model.lora.modules_to_save: {model_path} ties embed_tokens to the output head, which "
                "cannot be trained beside the adapters; remove embed_tokens")


# ---- merged weights, bucket by bucket --------------------------------------------------------

def _units(model: torch.nn.Module, adapted_only: bool):
    """(params, producer) per unit of the merged stream: a LoRA layer (base weight, bias, A, B),
    a module to save (its trained copy), or a plain module's own parameters."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    base = model.get_base_model()
    adapted_parents = {name.rpartition(".")[0] for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    seen, inside = set(), None
    for name, module in base.named_modules():  # pre-order: a module's children come right after it
        if inside and name.startswith(inside):
            continue  # inside a LoRA layer or a wrapper: produced by it
        inside = None
        if isinstance(module, LoraLayer):
            layer, inside = module.get_base_layer(), name + "."
            params = [p for p in (layer.weight, layer.bias, module.lora_A[ADAPTER].weight,
                                  module.lora_B[ADAPTER].weight) if p is not None]
            yield params, _merged_layer(name, module)
        elif isinstance(module, ModulesToSaveWrapper):
            trained, inside = module.modules_to_save[ADAPTER], name + "."
            yield list(trained.parameters()), _plain(name, trained.named_parameters())
        else:
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for _, p in own)
            linear_beside_adapted = isinstance(module, torch.nn.Linear) and name.rpartition(".")[0] in adapted_parents
            if own and (not adapted_only or linear_beside_adapted):
                yield [p for _, p in own], _plain(name, own)


def _plain(prefix: str, named):
    named = list(named)

    def produce():
        for n, p in named:
            yield (f"{prefix}.{n}" if prefix else n), p.data
    return produce


def _merged_layer(name: str, module):
    def produce():
        layer = module.get_base_layer()
        A, B = module.lora_A[ADAPTER].weight.data, module.lora_B[ADAPTER].weight.data
        weight = layer.weight.data
        delta = (B.float() @ A.float()) * module.scaling[ADAPTER]
        yield f"{name}.weight", (weight.float() + delta.to(weight.device)).to(weight.dtype)
        if layer.bias is not None:
            yield f"{name}.bias", layer.bias.data
    return produce


def merged_full_tensors(model: torch.nn.Module, bucket_mb: int = 256,
                        adapted_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, whole tensor) of the merged model: W + (alpha / r) B A for adapted layers, the
    trained copy of a module to save, the base weight elsewhere. ZeRO-3 partitions are
    gathered per bucket (collective: every rank iterates to the end). adapted_only: the
    adapted layers, their linear siblings and the modules to save only."""
    from megagrpo.policy.weight_gather import stream_units
    return stream_units(_units(model, adapted_only), bucket_mb)


# ---- adapter folders -------------------------------------------------------------------------

def peft_saved_name(live_name: str) -> str:
    """A live parameter name -> its name in a PEFT adapter file (as save_pretrained writes it)."""
    name = live_name.replace(f".modules_to_save.{ADAPTER}.", ".")
    return re.sub(rf"\.(lora_[AB])\.{ADAPTER}\.", r".\1.", name)


def adapter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT name, whole tensor) of the trained parameters: the adapters and modules to save.
    Collective under ZeRO-3 (gathered one at a time)."""
    import deepspeed

    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        context = (deepspeed.zero.GatheredParameters([param]) if hasattr(param, "ds_id")
                   else contextlib.nullcontext())
        with context:
            yield peft_saved_name(name), param.data.detach().cpu().clone()


def adapter_config(lora: LoraConfig, base_model: str) -> dict:
    """adapter_config.json's contents (PEFT's format), plain JSON (peft keeps target_modules as
    a set)."""
    config = peft_config(lora, base_model).to_dict() | {"peft_type": "LORA", "task_type": "CAUSAL_LM"}
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def write_adapter_folder(tensors, config: dict, out_dir: str, write: bool = True) -> None:
    """A PEFT adapter folder (adapter_model.safetensors + adapter_config.json) that
    PeftModel.from_pretrained loads. `tensors` is iterated to the end on every rank."""
    from safetensors.torch import save_file

    state = {name: t.contiguous() for name, t in tensors}
    if write:
        os.makedirs(out_dir, exist_ok=True)
        save_file(state, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=1)


def is_adapter_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "adapter_config.json"))


def read_adapter_folder(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, {PEFT name: tensor}) of an adapter folder; ConfigError when it
    is not a LoRA adapter this merge understands."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{path}: adapter type {config.get('peft_type')!r} is not LoRA; "
                          "only LoRA adapters are merged")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ConfigError(f"{path}: adapter_config.json sets {key}; per-module ranks are not merged here "
                              "(merge it with peft's merge_and_unload)")
    weights = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        raise ConfigError(f"{path}: no adapter_model.safetensors")
    return config, load_file(weights)


def merged_tensors(config: dict, adapter: dict, base_dir: str, source: str,
                   dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of base + adapter (PEFT names, from `source`), read from the base
    folder's safetensors one tensor at a time: W + (alpha / r) B A for adapted layers, the
    adapter's copy of a module to save, the base tensor elsewhere. `dtype`: the base weights
    are cast to it first, as a run in that dtype holds them, so that the merge is the run's own
    (for bf16: bf16(W) + s B A summed in float32, then rounded)."""
    from safetensors import safe_open

    if not base_dir or not os.path.isfile(os.path.join(base_dir, "config.json")):
        raise ConfigError(f"{source}: its base model '{base_dir}' is not a local HF folder; pass the base model "
                          "folder (--model for convert, --base-model for eval)")
    files = sorted(f for f in os.listdir(base_dir) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"{base_dir}: no safetensors files (the base model of {source})")
    scale = config["lora_alpha"] / (config["r"] ** 0.5 if config.get("use_rslora") else config["r"])
    prefix, used = "base_model.model.", set()
    for file in files:
        with safe_open(os.path.join(base_dir, file), framework="pt") as f:
            for name in f.keys():
                tensor, module = f.get_tensor(name), name.removesuffix(".weight")
                tensor = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
                a, b = f"{prefix}{module}.lora_A.weight", f"{prefix}{module}.lora_B.weight"
                if name.endswith(".weight") and a in adapter:
                    delta = (adapter[b].float() @ adapter[a].float()) * scale
                    tensor = (tensor.float() + delta).to(tensor.dtype)
                    used.update((a, b))
                elif prefix + name in adapter:  # a module to save: the adapter holds its trained copy
                    tensor = adapter[prefix + name].to(tensor.dtype)
                    used.add(prefix + name)
                yield name, tensor
    unused = sorted(set(adapter) - used)
    if unused:
        raise ConfigError(f"{source}: {len(unused)} adapter tensors match no weight of {base_dir} "
                          f"(first: {unused[0]}); is that the adapter's base model?")


def checkpoint_entry(lora: LoraConfig) -> Optional[dict]:
    """What a checkpoint records of the adapters (TrainerState.layout["lora"]): a run resumes
    only with the same shapes and targets."""
    if lora.r == 0:
        return None
    return {"r": lora.r, "alpha": lora_alpha(lora), "target_modules": list(lora.target_modules),
            "modules_to_save": list(lora.modules_to_save)}
