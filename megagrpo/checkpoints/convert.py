"""Offline checkpoint tools (`megagrpo convert ...`, also tools/convert_checkpoint.py).

    megagrpo convert inspect CKPT
    megagrpo convert to-hf CKPT OUT [--model HF_DIR] [--dtype float32|bfloat16] [--shard-mb N]
    megagrpo convert to-adapter CKPT OUT [--dtype ...]       (a LoRA run's checkpoint)
    megagrpo convert adapter-to-hf ADAPTER_DIR OUT [--model BASE_DIR] [--dtype ...] [--shard-mb N]
    megagrpo convert hf-to-pipeline HF_DIR OUT --pipeline-parallel-size N [--dtype ...]

CKPT is one checkpoint folder (output_dir/checkpoints/step_N). `to-hf` writes an HF folder
(sharded safetensors with an index carrying each shard's sha256, config, generation config,
tokenizer) that transformers and vLLM load unchanged; from a LoRA run's checkpoint (adapters
only) the adapters are merged into the base model (--model, default the run's), one tensor
at a time. `to-adapter` writes a LoRA checkpoint's adapters as a PEFT adapter folder
(PeftModel.from_pretrained loads it); `adapter-to-hf` merges any PEFT LoRA adapter folder
into its base (adapter_config.json's base_model_name_or_path, or --model). `hf-to-pipeline` rewrites an HF folder
so that each pipeline stage's tensors (DeepSpeed's partition by parameters, as the trainer
computes it) are one file: a pipeline run started from it has each rank read one file (the
last stage also the embedding, when tied). The result is still an HF folder. Layouts to-hf
reads:

  ZeRO 0-2   the module's weights, whole, in the model-states file
  ZeRO-3     every rank's float32 partition in its optimizer file; each parameter is
             reassembled from the ranks' slices, files memory-mapped and re-mapped every
             16 MiB read, one tensor at a time
  pipeline   DeepSpeed's layer_XX[-model_YY]-model_states.pt files, read one layer at a time
             and named as policy/pipeline_module.py names them (embedding, decoder layers,
             final norm, untied head); with tp, a layer's slices joined as that module splits them
  AutoTP     each model-parallel rank's tensors (read as above), the split ones joined
             along the dimension the model's config says is tp times larger
  AutoEP     (parallel.expert_parallel_size > 1; the model-states files' ds_autoep_layers) each
             expert-parallel rank holds its experts of every MoE layer, fused (experts.w1, w2, w3
             [E/ep, ...]). ZeRO-3: they are a parameter group of their own, partitioned over the
             ep rank's expert-data-parallel ranks (ds_zero_partition_groups); ZeRO 0-2: one file
             per layer and expert (layer_L_expert_E_mp_rank_00_model_states.pt). Joined along the
             expert dimension as the layer's placement says, then named as without AutoEP
             (policy/expert_parallel.py): gate_up_proj = cat(w1, w3, dim=1), down_proj = w2, the
             router's mlp.router.gate.weight as mlp.gate.weight

Files are read with torch.load(weights_only=True): tensors and plain containers, plus exactly
three DeepSpeed types found in optimizer files (ZeroStageEnum, LossScaler, fragment_address).
Nothing else in a checkpoint can run code while loading.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
from typing import Iterator

import torch

from megagrpo.checkpoints.autoep import autoep_tensors
from megagrpo.checkpoints.checkpoint import ADAPTER_CONFIG, MARKER
from megagrpo.checkpoints.deepspeed_files import (
    ConvertError,
    autoep_layers,
    checkpoint_files,
    load_checkpoint_file,
    zero3_frozen_tensors,
)
from megagrpo.checkpoints.safetensors_writer import write_safetensors
from megagrpo.config.schema import ConfigError
from megagrpo.dtypes import DTYPES
from megagrpo.multimodal.processor import PROCESSOR_FILES
from megagrpo.policy import lora
from megagrpo.policy.moe import checkpoint_names, is_moe_folder
from megagrpo.process_exit import exit_without_teardown

HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
                 "tokenizer.model", "added_tokens.json", *PROCESSOR_FILES)


def layout(ckpt: str) -> dict:
    """What kind of checkpoint this is, from its files (and trainer_state.json when present)."""
    if not os.path.isdir(ckpt):
        raise ConvertError(f"{ckpt}: not a folder; pass one checkpoint, e.g. output_dir/checkpoints/step_00000010")
    layer_files, model_files, optim_files = checkpoint_files(ckpt)
    if not model_files:
        raise ConvertError(f"{ckpt}: no DeepSpeed *model_states.pt files: not a megagrpo/DeepSpeed checkpoint")
    state_file = os.path.join(ckpt, "trainer_state.json")
    trainer = json.load(open(state_file)) if os.path.isfile(state_file) else {}
    zero = (load_checkpoint_file(optim_files[0], mmap=True)["optimizer_state_dict"].get("zero_stage", 0)
            if optim_files else 0)
    mp_ranks = {re.search(r"mp_rank_(\d+)", os.path.basename(f)).group(1) for f in model_files}
    kind = "pipeline" if layer_files else ("autotp" if len(mp_ranks) > 1 else f"zero-{int(zero)}")
    autoep = None if layer_files else autoep_layers(load_checkpoint_file(model_files[0], mmap=True))
    return {"kind": kind, "zero_stage": int(zero), "complete": os.path.isfile(os.path.join(ckpt, MARKER)),
            "dp_partitions": len(optim_files) // max(1, len(mp_ranks)), "model_parallel_files": len(mp_ranks),
            "layer_files": len(layer_files), "trainer_state": trainer,
            "ep": autoep[0]["ep_size"] if autoep else 1}


def hf_tensors(ckpt: str, model: str = None, info: dict = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight of the checkpoint, one at a time where the layout
    allows (ZeRO-3, pipeline); ZeRO 0-2 keep the module in one file. AutoTP shards are merged
    using the full shapes of the model's config (`model`, default: the run's). `info` is
    layout(ckpt) when the caller already has it."""
    info = info or layout(ckpt)
    layer_files, model_files, optim_files = checkpoint_files(ckpt)
    if info["kind"] == "pipeline":
        yield from _pipeline_tensors(layer_files)
    elif info.get("ep", 1) > 1:
        yield from autoep_tensors(ckpt, info, model_files, optim_files)
    elif info["kind"] == "autotp":
        yield from _merge_tensor_parallel(ckpt, info, model or info["trainer_state"].get("model"),
                                          model_files, optim_files)
    else:
        yield from _rank_tensors(info, model_files[0], optim_files)


def _rank_tensors(info, model_file, optim_files):
    """One model-parallel rank's tensors: reassembled from ZeRO-3 partitions, or as saved."""
    if info["zero_stage"] == 3:
        return _zero3_tensors(model_file, optim_files)
    return iter(load_checkpoint_file(model_file)["module"].items())


def _merge_tensor_parallel(ckpt, info, model, model_files, optim_files):
    """AutoTP: each model-parallel rank holds a slice of the split layers (the same names, a
    smaller size along the split dimension) and a copy of the others. The full shapes come from
    the model's config (built on the meta device); a slice is joined along the dimension where
    it is tp times smaller, in rank order."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if not model or not os.path.isfile(os.path.join(model, "config.json")):
        raise ConvertError(f"{ckpt}: merging tensor-parallel shards needs the model's config; "
                           f"pass --model PATH (the run's model.name_or_path), not '{model}'")
    with torch.device("meta"):
        full_shapes = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model)).named_parameters()}
    tp = info["model_parallel_files"]
    streams = []
    for rank in range(tp):
        tag = f"mp_rank_{rank:02d}"
        streams.append(_rank_tensors(info, next(f for f in model_files if tag in f),
                                     [f for f in optim_files if tag in f]))
    for pieces in zip(*streams):
        name, shards = pieces[0][0], [t for _, t in pieces]
        full = full_shapes.get(name)
        if full is None or tuple(shards[0].shape) == full:
            yield name, shards[0]
            continue
        dims = [d for d in range(len(full)) if shards[0].shape[d] * tp == full[d]]
        if len(dims) != 1:
            raise ConvertError(f"{ckpt}: cannot tell how '{name}' {tuple(shards[0].shape)} x {tp} "
                               f"splits {full}")
        yield name, torch.cat(shards, dim=dims[0])


def _pipeline_tensors(layer_files):
    """Layer files in order: embedding ("weight"), decoder layers ("layer.*"), final norm
    ("norm.weight"), untied head ("weight"), as policy/pipeline_module.py's stage modules name
    them. A tied head has no file of its own (DeepSpeed saves the tied module with its first
    layer). With tensor parallelism a layer has one file per tp rank (layer_XX-model_YY-...):
    the split tensors are joined along the dimension that pipeline_module splits."""
    from megagrpo.policy.pipeline_module import tensor_parallel_dim
    by_layer = {}
    for path in layer_files:
        index = int(re.match(r"layer_(\d+)", os.path.basename(path)).group(1))
        by_layer.setdefault(index, []).append(path)  # sorted names: tp rank order
    decoder, seen_norm = 0, False
    for index in sorted(by_layer):
        states = [load_checkpoint_file(path) for path in by_layer[index]]
        keys = states[0]
        if any(k.startswith("layer.") for k in keys):
            names = {k: f"model.layers.{decoder}.{k[len('layer.'):]}" for k in keys}
            decoder += 1
        elif "norm.weight" in keys:
            seen_norm, names = True, {"norm.weight": "model.norm.weight"}
        elif set(keys) == {"weight"}:
            names = {"weight": "lm_head.weight" if seen_norm else "model.embed_tokens.weight"}
        else:
            raise ConvertError(f"{by_layer[index][0]}: unexpected layer keys {sorted(keys)[:5]}")
        for key, name in names.items():
            dim = tensor_parallel_dim(name, states[0][key].dim())
            yield name, states[0][key] if dim is None else torch.cat([state[key] for state in states], dim=dim)


def _zero3_tensors(model_file, optim_files, window_mb: int = 16):
    """ZeRO-3: in each parameter group, parameter p (numel n, in param_shapes order) occupies
    ceil(n / world) elements of every rank's flat float32 group, at the same offset on each
    rank; the ranks' slices concatenated, cut to n, give the parameter. Frozen parameters follow.

    The optimizer files are memory-mapped; pages read stay resident while the mapping lives,
    so the files are mapped afresh every `window_mb` of parameters read: memory stays near the
    window plus one parameter, not the model."""
    import gc

    groups_shapes = load_checkpoint_file(model_file)["param_shapes"]

    def open_flat_groups():
        return [load_checkpoint_file(f, mmap=True)["optimizer_state_dict"]["fp32_flat_groups"] for f in optim_files]
    flat_groups, world, read = open_flat_groups(), len(optim_files), 0
    for index, shapes in enumerate(groups_shapes):
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            full = torch.cat([groups[index][offset:offset + part] for groups in flat_groups])[:numel]
            yield name, full.view(shape)
            offset += part
            read += part * world * full.element_size()
            if read >= window_mb * 2**20:
                del full
                flat_groups = None
                gc.collect()  # unmaps the files
                flat_groups, read = open_flat_groups(), 0
        if offset != flat_groups[0][index].numel():
            raise ConvertError(f"{optim_files[0]}: parameter group {index} holds "
                               f"{flat_groups[0][index].numel()} elements per rank, its parameters "
                               f"{offset}; not a ZeRO-3 layout this reader knows")
    yield from zero3_frozen_tensors(optim_files)


def to_hf(ckpt: str, out: str, model: str = None, dtype: str = None, shard_mb: int = 2048, log=print) -> None:
    info = layout(ckpt)
    if not info["complete"]:
        raise ConvertError(f"{ckpt}: incomplete checkpoint (no {MARKER} marker); convert a complete one")
    model = model or info["trainer_state"].get("model")
    if not model or not os.path.isfile(os.path.join(model, "config.json")):
        raise ConvertError(f"{ckpt}: the HF folder for config and tokenizer is unknown or missing "
                           f"('{model}'); pass --model PATH (the run's model.name_or_path)")
    if os.path.isfile(os.path.join(ckpt, ADAPTER_CONFIG)):  # a LoRA policy: merge into the base, as the run did
        dtype = dtype or info["trainer_state"].get("layout", {}).get("dtype")
        tensors = lora.merged_tensors(*_adapter(ckpt, info), model, ckpt, DTYPES[dtype] if dtype else None)
    else:
        tied = json.load(open(os.path.join(model, "config.json"))).get("tie_word_embeddings", False)
        tensors = ((n, t) for n, t in hf_tensors(ckpt, model, info) if not (tied and n == "lm_head.weight"))
        tensors = checkpoint_format(tensors, model)
    log(f"{ckpt}: {info['kind']} -> {out}")
    write_safetensors(tensors, out, shard_mb, DTYPES[dtype] if dtype else None, always_index=True)
    _copy_side_files(model, out, dtype)


def checkpoint_format(tensors: Iterator[tuple[str, torch.Tensor]], model: str):
    """A mixture of experts' tensors under its checkpoint's names (per expert, as the run's
    export writes them: policy/moe.py), read off the model built on the meta device
    (lora.meta_model); a dense model's as they are."""
    if not is_moe_folder(model):
        return tensors
    return checkpoint_names(tensors, lora.meta_model(model))


def _adapter(ckpt: str, info: dict) -> tuple[dict, dict]:
    """(adapter_config.json, {PEFT name: tensor}) of a LoRA run's checkpoint."""
    with open(os.path.join(ckpt, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    return config, {lora.peft_saved_name(n): t for n, t in hf_tensors(ckpt, None, info)}


def to_adapter(ckpt: str, out: str, dtype: str = None, log=print) -> None:
    info = layout(ckpt)
    if not info["complete"]:
        raise ConvertError(f"{ckpt}: incomplete checkpoint (no {MARKER} marker); convert a complete one")
    if not os.path.isfile(os.path.join(ckpt, ADAPTER_CONFIG)):
        raise ConvertError(f"{ckpt}: not a LoRA run's checkpoint (no {ADAPTER_CONFIG}); use to-hf")
    config, tensors = _adapter(ckpt, info)
    log(f"{ckpt}: {len(tensors)} adapter tensors -> {out}")
    cast = DTYPES[dtype] if dtype else None
    lora.write_adapter_folder(((n, t.to(cast) if cast else t) for n, t in tensors.items()), config, out)


def adapter_to_hf(adapter_dir: str, out: str, model: str = None, dtype: str = None, shard_mb: int = 2048,
                  log=print) -> None:
    """A PEFT LoRA adapter folder merged into its base model, written as an HF folder."""
    if not lora.is_adapter_folder(adapter_dir):
        raise ConvertError(f"{adapter_dir}: not a PEFT adapter folder (no adapter_config.json)")
    config, adapter = lora.read_adapter_folder(adapter_dir)
    model = model or config.get("base_model_name_or_path")
    log(f"{adapter_dir} + base {model} -> {out}")
    cast = DTYPES[dtype] if dtype else None
    write_safetensors(lora.merged_tensors(config, adapter, model, adapter_dir, cast), out, shard_mb, cast,
                      always_index=True)
    _copy_side_files(model, out, dtype)


def hf_to_pipeline(model: str, out: str, stages: int, dtype: str = None, log=print) -> None:
    from megagrpo.policy.pipeline_module import ModelParts

    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ConvertError(f"{model}: not an HF model folder (no config.json)")
    if os.path.realpath(model) == os.path.realpath(out):
        raise ConvertError(f"{out}: the output folder is the model folder; write to another one")
    parts = ModelParts(model, None, "sdpa")
    layers = len(parts.layer_counts())
    if not 1 <= stages <= layers:
        raise ConvertError(f"--pipeline-parallel-size {stages}: the model has {layers} pipeline "
                           "layers (embedding, decoder layers, norm, head); use 1 to that many")
    by_stage = parts.stage_tensor_names(stages)
    stage_file = {name: f"model-stage{s + 1:03d}-of-{stages:03d}.safetensors"
                  for s, names in enumerate(by_stage) for name in names}
    log(f"{model} -> {out}: {stages} stage files ({', '.join(str(len(n)) for n in by_stage)} tensors)")
    tensors = ((name, parts.source.tensor(name)) for names in by_stage for name in names)
    write_safetensors(tensors, out, dtype=DTYPES[dtype] if dtype else None, always_index=True,
                      shard_of=stage_file.__getitem__, metadata={"pipeline_parallel_size": stages})
    _copy_side_files(model, out, dtype)


def _copy_side_files(model: str, out: str, dtype: str = None) -> None:
    """Config, generation config, tokenizer and processor files; the config's dtype set to the output's."""
    for name in HF_SIDE_FILES:
        if os.path.isfile(os.path.join(model, name)):
            shutil.copy(os.path.join(model, name), os.path.join(out, name))
    if dtype:
        config = json.load(open(os.path.join(model, "config.json")))
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f, indent=1)


def inspect(ckpt: str) -> str:
    info = layout(ckpt)
    trainer = info["trainer_state"]
    experts = f", AutoEP expert-parallel size {info['ep']}" if info.get("ep", 1) > 1 else ""
    lines = [f"checkpoint: {ckpt}", f"layout: {info['kind']} (ZeRO stage {info['zero_stage']}, "
             f"{info['dp_partitions']} data-parallel partition(s), {info['model_parallel_files']} "
             f"model-parallel file(s), {info['layer_files']} pipeline layer file(s){experts})",
             f"complete: {info['complete']}"]
    for key in ("step", "total_steps", "world_size", "dp_size", "layout", "model"):
        if key in trainer:
            lines.append(f"{key}: {trainer[key]}")
    if info["kind"] != "autotp" or trainer.get("model"):
        total, count = 0, 0
        lines.append("tensors:")
        for name, tensor in hf_tensors(ckpt, trainer.get("model"), info):
            lines.append(f"  {name:<56} {str(tuple(tensor.shape)):<16} {str(tensor.dtype).replace('torch.', '')}")
            total += tensor.numel()
            count += 1
        lines.append(f"{count} tensors, {total / 1e6:.2f}M parameters")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="megagrpo convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="print what a checkpoint holds: step, layout, tensors")
    i.add_argument("checkpoint")
    h = sub.add_parser("to-hf", help="write an HF folder (sharded safetensors, index with checksums)")
    h.add_argument("checkpoint")
    h.add_argument("out")
    h.add_argument("--model", help="HF folder with config and tokenizer (default: the run's model)")
    h.add_argument("--dtype", choices=sorted(DTYPES),
                   help="output dtype (default: as stored; a LoRA checkpoint merged in the run's dtype)")
    h.add_argument("--shard-mb", type=int, default=2048, help="shard size in MiB (default 2048)")
    a = sub.add_parser("to-adapter", help="write a LoRA run's adapters as a PEFT adapter folder")
    a.add_argument("checkpoint")
    a.add_argument("out")
    a.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: as stored)")
    m = sub.add_parser("adapter-to-hf", help="merge a PEFT LoRA adapter folder into its base: an HF folder")
    m.add_argument("adapter")
    m.add_argument("out")
    m.add_argument("--model", help="the base model's HF folder (default: the adapter's base_model_name_or_path)")
    m.add_argument("--dtype", choices=sorted(DTYPES),
                   help="output dtype, the base cast to it before the merge (default: the base's)")
    m.add_argument("--shard-mb", type=int, default=2048, help="shard size in MiB (default 2048)")
    s = sub.add_parser("hf-to-pipeline", help="rewrite an HF folder as one safetensors file per "
                                              "pipeline stage (still an HF folder)")
    s.add_argument("model", help="HF model folder")
    s.add_argument("out")
    s.add_argument("--pipeline-parallel-size", type=int, required=True,
                   help="stages, as parallel.pipeline_parallel_size of the run that will load it")
    s.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: as stored)")
    args = p.parse_args(argv)
    try:
        if args.command == "inspect":
            print(inspect(args.checkpoint))
        elif args.command == "to-hf":
            to_hf(args.checkpoint, args.out, args.model, args.dtype, args.shard_mb)
        elif args.command == "to-adapter":
            to_adapter(args.checkpoint, args.out, args.dtype)
        elif args.command == "adapter-to-hf":
            adapter_to_hf(args.adapter, args.out, args.model, args.dtype, args.shard_mb)
        else:
            hf_to_pipeline(args.model, args.out, args.pipeline_parallel_size, args.dtype)
    except (ConvertError, ConfigError) as e:
        print(f"megagrpo convert: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
