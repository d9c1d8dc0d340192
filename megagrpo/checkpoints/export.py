"""The run's exports: output_dir/hf, the policy as an HF folder that transformers and vLLM load
unchanged, and for a LoRA policy output_dir/adapter, its adapters as a PEFT folder."""
from __future__ import annotations

import os

import torch.distributed as dist

from megagrpo.checkpoints.safetensors_writer import write_safetensors
from megagrpo.multimodal.processor import copy_processor_files
from megagrpo.policy import lora


def export(policy, tokenizer, output_dir: str, is_main: bool) -> dict[str, str]:
    """Collective: output_dir/hf, the policy as an HF folder (a LoRA policy's merged), and for a
    LoRA policy also output_dir/adapter, its adapters as a PEFT folder. Returns {what: folder}."""
    written = {"HF model": os.path.join(output_dir, "hf")}
    export_hf(policy.hf_module, policy.full_tensors(), tokenizer, written["HF model"], is_main)
    if policy.adapter_config:
        written["LoRA adapter"] = os.path.join(output_dir, "adapter")
        lora.write_adapter_folder(policy.adapter_tensors(), policy.adapter_config, written["LoRA adapter"], is_main)
    return written


def export_hf(module, tensors, tokenizer, out_dir: str, is_main: bool, shard_mb: int = 2048) -> None:
    """Collective: write an HF folder that AutoModelForCausalLM and vLLM load unchanged: the
    whole-tensor stream `tensors` (every rank iterates it) goes into safetensors shards on
    the main rank, with `module`'s config, the tokenizer and (a VLM) the processor's files."""
    write_safetensors(tensors, out_dir, shard_mb, write=is_main)
    if is_main:
        use_cache = module.config.use_cache
        module.config.use_cache = True  # off only while training with gradient checkpointing
        module.config.save_pretrained(out_dir)
        module.config.use_cache = use_cache
        if getattr(module, "generation_config", None) is not None:
            module.generation_config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        copy_processor_files(module.config.name_or_path, out_dir)  # a vision-language model's
    if dist.is_initialized():
        dist.barrier()
