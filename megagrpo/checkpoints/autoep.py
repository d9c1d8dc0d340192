"""AutoEP's checkpoints (parallel.expert_parallel_size > 1; policy/expert_parallel.py).

DeepSpeed saves each rank's E/ep experts of a layer as AutoEP names them (experts.w1, w3, w2;
router.gate), under ZeRO-3 partitioned over the ranks holding the same experts, and records
the layers (ds_autoep_layers: module path, expert count, ep size, the placement of experts).
Here they are read back two ways:
  - offline (`megagrpo convert to-hf`): the ranks' shards joined into transformers' names
    (experts.gate_up_proj = [w1, w3] over all experts, down_proj = w2, gate), equal to the
    run's HF export;
  - for a resume onto another ep size, inside DeepSpeed's universal checkpoint: its per-name
    folders renamed from AutoEP's layout to transformers' (a run without AutoEP resumes) or
    back (a run with AutoEP resumes a checkpoint saved without it).
"""
from __future__ import annotations

import math
import os
import re
import shutil
from typing import Optional

import torch

from megagrpo.checkpoints.deepspeed_files import (
    ConvertError,
    autoep_layers,
    checkpoint_files,
    load_checkpoint_file,
    zero3_frozen_tensors,
)


def autoep_tensors(ckpt, info, model_files, optim_files):
    """AutoEP: the experts of each MoE layer joined from the ep ranks' shards, all tensors under
    the names the model has without AutoEP (the live export's, policy/expert_parallel.py)."""
    from types import SimpleNamespace

    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    from megagrpo.policy.expert_parallel import hf_name

    if info["model_parallel_files"] > 1:
        raise ConvertError(f"{ckpt}: AutoEP with {info['model_parallel_files']} model-parallel ranks (AutoEP + AutoTP "
                           "folding) is not read offline")
    first = load_checkpoint_file(model_files[0], mmap=True)
    layers = autoep_layers(first)
    family = (first.get("ds_config") or {}).get("expert_parallel", {}).get("preset_model")
    preset = PRESET_MODELS.get(family)
    if preset is None or preset.expert_storage != "fused_3d" or preset.expert_w3 is not None:
        raise ConvertError(f"{ckpt}: AutoEP preset '{family}' is not one whose experts this reader joins "
                           "(fused 3-D gate_up/down tensors: qwen3_moe, mixtral)")
    if info["zero_stage"] == 3:
        tensors = _autoep_zero3_tensors(model_files, optim_files)
    else:
        tensors = _autoep_expert_file_tensors(ckpt, model_files[0], layers)
    paths, stub, fused = [entry["module_path"] for entry in layers], SimpleNamespace(model_family=family), {}
    experts = f"{preset.experts_pattern}."
    for name, tensor in tensors:
        path = next((p for p in paths if name.startswith(p + ".")), None)
        if path is None:
            yield name, tensor
            continue
        relative = name[len(path) + 1:]
        if relative in ("experts.w1", "experts.w3"):  # gate_up_proj [E, 2I, H] = cat(w1, w3, dim=1)
            fused.setdefault(path, {})[relative[-2:]] = tensor
            if len(fused[path]) == 2:
                parts = fused.pop(path)
                yield f"{path}.{experts}{preset.expert_w1}", torch.cat([parts["w1"], parts["w3"]], dim=1)
        elif relative == "experts.w2":
            yield f"{path}.{experts}{preset.expert_w2}", tensor
        elif relative.partition(".")[0] == preset.router_pattern != "router":
            continue  # the layer's alias of its router (ZeRO 0-2 state dicts hold both names)
        else:
            yield f"{path}.{hf_name(relative, stub)}", tensor
    if fused:
        raise ConvertError(f"{ckpt}: AutoEP layers {sorted(fused)} lack experts.w1 or experts.w3")


def _autoep_join(name, shards, entry, logical_shape):
    """{ep rank: [E/ep, ...]} -> [E, ...], each expert where the layer's placement puts it
    (DeepSpeed's affine map of the placement, as its universal conversion joins them)."""
    from deepspeed.checkpoint.autoep_affine import autoep_metadata_to_affine_map

    expert_map = autoep_metadata_to_affine_map(entry, logical_shape, name)
    missing = {r for r, shape in expert_map.shard_shapes.items() if math.prod(shape) and r not in shards}
    if missing:
        raise ConvertError(f"{name}: no shard of ep ranks {sorted(missing)}")
    return expert_map.rebuild(shards)


def _autoep_zero3_tensors(model_files, optim_files, window_mb: int = 16):
    """ZeRO-3 under AutoEP: as _zero3_tensors, but each parameter group is partitioned over its own
    ranks (ds_zero_partition_groups: partition_count, this rank's partition_rank). The experts'
    group holds, on each rank, slices of its ep rank's experts (E/ep of them) partitioned over the
    ranks with that ep rank: a parameter's slices are joined per ep rank, then the ep ranks' along
    the expert dimension. Files memory-mapped and re-mapped every `window_mb`, as there."""
    import gc

    optim_files = sorted(optim_files, key=lambda f: int(re.search(r"zero_pp_rank_(\d+)", os.path.basename(f)).group(1)))
    states = [load_checkpoint_file(f.replace("_optim_states.pt", "_model_states.pt")) for f in optim_files]
    shapes = [state["param_shapes"] for state in states]
    experts = [{f"{e['expert_key_prefix']}.{w}": e for e in autoep_layers(state) or [] for w in ("w1", "w2", "w3")}
               for state in states]

    def open_optim():
        return [load_checkpoint_file(f, mmap=True)["optimizer_state_dict"] for f in optim_files]
    optim, read = open_optim(), 0
    partitions = [o.get("ds_zero_partition_groups") or [] for o in optim]
    for index, group in enumerate(shapes[0]):
        if any(list(s[index]) != list(group) for s in shapes):
            raise ConvertError(f"{optim_files[0]}: the ranks' parameter group {index} names differ; not an AutoEP "
                               "ZeRO-3 layout this reader knows")
        where = [(p[index]["partition_count"], p[index]["partition_rank"]) if index < len(p) else (len(optim_files), r)
                 for r, p in enumerate(partitions)]
        offsets = [0] * len(optim_files)
        for name in group:
            pieces = {}  # ep rank (None: not an expert) -> {partition rank: (rank, offset, part)}
            for rank, (count, partition) in enumerate(where):
                part = math.ceil(math.prod(shapes[rank][index][name]) / count)
                entry = experts[rank].get(name)
                pieces.setdefault(entry and entry["ep_rank"], {}).setdefault(partition, (rank, offsets[rank], part))
                offsets[rank] += part
            local = {}
            for ep_rank, by_partition in pieces.items():
                rank = next(iter(by_partition.values()))[0]
                count = where[rank][0]
                if sorted(by_partition) != list(range(count)):
                    raise ConvertError(f"{optim_files[0]}: '{name}' has partitions {sorted(by_partition)} of "
                                       f"{count} (ep rank {ep_rank}); incomplete checkpoint?")
                shape = shapes[rank][index][name]
                flat = torch.cat([optim[r]["fp32_flat_groups"][index][o:o + n]
                                  for r, o, n in (by_partition[p] for p in range(count))])
                local[ep_rank] = flat[:math.prod(shape)].view(shape)
                read += flat.numel() * flat.element_size()
            if None in local:
                yield name, local[None]
            else:
                entry = experts[0][name]
                yield name, _autoep_join(name, local, entry, (entry["num_experts"], *shapes[0][index][name][1:]))
            del local
            if read >= window_mb * 2**20:
                optim = None
                gc.collect()  # unmaps the files
                optim, read = open_optim(), 0
        for rank, offset in enumerate(offsets):
            if offset != optim[rank]["fp32_flat_groups"][index].numel():
                raise ConvertError(f"{optim_files[rank]}: parameter group {index} holds "
                                   f"{optim[rank]['fp32_flat_groups'][index].numel()} elements, its parameters "
                                   f"{offset}; not an AutoEP ZeRO-3 layout this reader knows")
    yield from zero3_frozen_tensors(optim_files)


def _autoep_expert_file_tensors(ckpt, model_file, layers):
    """ZeRO 0-2 under AutoEP: the module (all but the experts) in the model-states file, then each
    layer's experts, one file per expert ({prefix}.w1.E, w2.E, w3.E: [I, H], [H, I], [I, H]),
    stacked in expert order."""
    yield from load_checkpoint_file(model_file)["module"].items()
    mp = re.search(r"mp_rank_(\d+)", os.path.basename(model_file)).group(1)
    for entry in sorted(layers, key=lambda e: e["moe_layer_id"]):
        prefix, stacked = entry["expert_key_prefix"], {"w1": [], "w2": [], "w3": []}
        for expert in range(entry["num_experts"]):
            path = os.path.join(ckpt, f"layer_{entry['moe_layer_id']}_expert_{expert}_mp_rank_{mp}_model_states.pt")
            if not os.path.isfile(path):
                raise ConvertError(f"{ckpt}: no {os.path.basename(path)} ({prefix}, expert {expert} of "
                                   f"{entry['num_experts']}); incomplete checkpoint?")
            state = load_checkpoint_file(path)
            for w, tensors in stacked.items():
                tensors.append(state[f"{prefix}.{w}.{expert}"])
        for w in ("w1", "w2", "w3"):
            yield f"{prefix}.{w}", torch.stack(stacked.pop(w))


# ---- universal checkpoints: renamed across AutoEP and transformers --------------------------------

def autoep_of(path: str) -> Optional[tuple[list, str]]:
    """(AutoEP layers, preset) a checkpoint was saved with (its model-states file's
    ds_autoep_layers and DeepSpeed config), or None: saved without AutoEP."""
    _, model_files, _ = checkpoint_files(path)
    state = load_checkpoint_file(model_files[0], mmap=True)
    layers = autoep_layers(state)
    if layers is None:
        return None
    return layers, (state.get("ds_config") or {}).get("expert_parallel", {}).get("preset_model")


def _preset(name: str):
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    preset = PRESET_MODELS.get(name)
    if preset is None or preset.expert_storage != "fused_3d" or preset.expert_w3 is not None:
        raise ValueError(f"AutoEP preset '{name}': its experts are not fused 3-D gate_up/down tensors; "
                         "they are not renamed between AutoEP and transformers' names")
    return preset


def _state_files(folder: str) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".pt"))


def experts_to_hf(zero: str, layers: list, preset_name: str) -> None:
    """A universal checkpoint's zero/ folder, saved with AutoEP, under transformers' names (as
    policy/expert_parallel.py names the live model's): per MoE layer L and state (fp32, exp_avg,
    exp_avg_sq), L.experts.gate_up_proj = cat(experts.w1, experts.w3, dim=1) and
    L.experts.down_proj = experts.w2 (whole: [E, ...]), L.router.gate.* -> L.gate.*, shared experts
    as the preset names them."""
    from types import SimpleNamespace

    from deepspeed.checkpoint.constants import PARAM

    from megagrpo.policy.expert_parallel import hf_name

    preset, stub = _preset(preset_name), SimpleNamespace(model_family=preset_name)
    for entry in layers:
        layer, experts = entry["module_path"], entry["expert_key_prefix"]
        hf = f"{layer}.{preset.experts_pattern}"
        w1, w2, w3 = (os.path.join(zero, f"{experts}.{w}") for w in ("w1", "w2", "w3"))
        keys = _state_files(w1)
        if keys != _state_files(w3) or keys != _state_files(w2):
            raise RuntimeError(f"{zero}: {experts}.w1/w2/w3 hold different states")
        for target, parts in ((f"{hf}.{preset.expert_w1}", (w1, w3)), (f"{hf}.{preset.expert_w2}", (w2,))):
            os.makedirs(os.path.join(zero, target))
            for key in keys:
                loaded = [torch.load(os.path.join(part, key), weights_only=True) for part in parts]
                tensors = [t[PARAM] if isinstance(t, dict) else t for t in loaded]
                torch.save(torch.cat(tensors, dim=1) if len(tensors) > 1 else tensors[0],
                           os.path.join(zero, target, key))
        for part in (w1, w2, w3):
            shutil.rmtree(part)
        for name in os.listdir(zero):
            if name.startswith(f"{layer}.") and not name.startswith(f"{hf}."):
                renamed = f"{layer}.{hf_name(name[len(layer) + 1:], stub)}"
                if renamed != name:
                    os.rename(os.path.join(zero, name), os.path.join(zero, renamed))


def experts_to_autoep(zero: str, preset_name: str) -> None:
    """The inverse of experts_to_hf, for a checkpoint saved without AutoEP loaded by a model with
    it: L.experts.gate_up_proj [E, 2I, H] split into experts.w1 and w3, down_proj as w2, each
    marked as DeepSpeed's universal expert tensors are (whole, [E, ...]: each ep rank's experts
    are sliced out at load); L.gate.* -> L.router.gate.*; shared experts renamed back."""
    from deepspeed.checkpoint.constants import CAT_DIM, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, PARAM

    preset = _preset(preset_name)
    _, model_files, _ = checkpoint_files(os.path.dirname(zero))  # ZeRO-3 keeps a parameter flat there: its shape
    shapes = {name: tuple(shape) for group in load_checkpoint_file(model_files[0], mmap=True)["param_shapes"]
              for name, shape in group.items()}
    gate_up = f".{preset.experts_pattern}.{preset.expert_w1}"
    back = {preset.router_pattern: "router.gate", preset.shared_experts_pattern: "shared_experts",
            preset.shared_experts_gate_pattern: "shared_experts_gate"}
    for layer in [n[:-len(gate_up)] for n in os.listdir(zero) if n.endswith(gate_up)]:
        source = {w: os.path.join(zero, f"{layer}.{preset.experts_pattern}.{w}")
                  for w in (preset.expert_w1, preset.expert_w2)}
        for w in ("w1", "w2", "w3"):
            os.makedirs(os.path.join(zero, f"{layer}.experts.{w}"))
        for key in _state_files(source[preset.expert_w1]):
            fused, down = (torch.load(os.path.join(source[w], key), weights_only=True).view(
                shapes[os.path.basename(source[w])]) for w in (preset.expert_w1, preset.expert_w2))
            half = fused.shape[1] // 2
            for w, tensor in (("w1", fused[:, :half]), ("w3", fused[:, half:]), ("w2", down)):
                torch.save({PARAM: tensor.contiguous(), CAT_DIM: 0, EP_IS_EXPERT_PARAM: True,
                            EP_NUM_EXPERTS: tensor.shape[0]}, os.path.join(zero, f"{layer}.experts.{w}", key))
        for folder in source.values():
            shutil.rmtree(folder)
        for name in os.listdir(zero):
            head, _, rest = name[len(layer) + 1:].partition(".") if name.startswith(f"{layer}.") else ("", "", "")
            if head in back and head:
                os.rename(os.path.join(zero, name), os.path.join(zero, f"{layer}.{back[head]}.{rest}"))
