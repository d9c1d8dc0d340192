"""DeepSpeed's checkpoint folders read as files: which file is which, each loaded with the few
classes DeepSpeed pickles allowed, and what an AutoEP checkpoint records of its expert layers.
The offline converter (convert.py), AutoEP's readers (autoep.py) and the resume's re-sharding
(checkpoint.py) build on these."""
from __future__ import annotations

import glob
import math
import os
import re

import torch


class ConvertError(ValueError):
    pass


def load_checkpoint_file(path: str, mmap: bool = False):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    with torch.serialization.safe_globals([ZeroStageEnum, LossScaler, fragment_address]):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def checkpoint_files(ckpt: str):
    """Pipeline layer files, model-states files (one per model-parallel rank, under ZeRO-3 one per
    rank), ZeRO optimizer files in rank order. AutoEP's per-expert files (layer_L_expert_E_...) and
    its ZeRO-0 optimizer files (expp_rank_R_...) are left out: the AutoEP readers find their own."""
    layer_files = sorted(glob.glob(os.path.join(ckpt, "layer_*-model_states.pt")))
    model_files = sorted(f for f in glob.glob(os.path.join(ckpt, "*model_states.pt"))
                         if f not in layer_files and not EXPERT_FILE.match(os.path.basename(f)))
    optim_files = sorted((f for f in glob.glob(os.path.join(ckpt, "*optim_states.pt"))
                          if not os.path.basename(f).startswith("expp_rank_")),
                         key=lambda f: [int(n) for n in re.findall(r"\d+", os.path.basename(f))])
    return layer_files, model_files, optim_files


EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def autoep_layers(model_state: dict):
    """The AutoEP layers a model-states file records (DeepSpeed's ds_autoep_layers: per MoE layer
    its module path, expert count, ep size, this rank's ep rank, the expert placement), or None."""
    layers = model_state.get("ds_autoep_layers") or model_state.get("autoep_layers")
    return layers if isinstance(layers, list) and layers else None


def zero3_frozen_tensors(optim_files):
    """ZeRO-3's frozen parameters (a VLM's frozen vision tower) have no optimizer state: each
    rank's model-states file holds its fragment (ceil(n / world) elements, in rank order), beside
    the full shapes."""
    states = [load_checkpoint_file(f.replace("_optim_states.pt", "_model_states.pt")) for f in optim_files]
    for name, shape in (states[0].get("frozen_param_shapes") or {}).items():
        numel = math.prod(shape)
        yield name, torch.cat([state["frozen_param_fragments"][name] for state in states])[:numel].view(shape)
