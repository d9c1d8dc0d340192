"""The model's own processor (AutoProcessor) turns a prompt's chat and images into tokens and
image tensors; this module keeps both with the prompt and hands them to the engines.

A prompt with images has two token forms:
  token_ids     the processor's: each image placeholder expanded into the model's vision tokens.
                The trainer scores these, and they are what vLLM reports it ran.
  template_ids  the chat template's tokens with one placeholder per image: what vLLM is given,
                beside the images, since vLLM expands placeholders itself (given ids already
                expanded, vLLM 0.32 expands Idefics3's again: measured, docs/multimodal.md).
The two are checked against each other at every vLLM call (VLLMGenerator).

The image tensors of a prompt (pixel_values and the model's companions: pixel_attention_mask,
image_grid_thw) are kept per prompt and joined per forward pass in the order the prompts' image
tokens appear in the flattened input_ids: the VLMs place image features into image-token
positions in that order, so one concatenation serves padded batches and packed rows alike.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

import torch

# Processors that batch images per text row ((rows, images, ...)): joined on the image axis (1).
# Qwen-VL's flatten every image's patches on axis 0 (pixel_values (patches, dim), image_grid_thw
# (images, 3)) and are joined there.
IMAGES_PER_ROW = {"idefics3", "smolvlm", "idefics2"}


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
"""A processor's files beside the tokenizer's, which exports and conversions copy."""


@dataclass
class VisionPrompt:
    images: list                 # RGB PIL images, in the order of their placeholders
    template_ids: list[int]      # the chat template's tokens, one placeholder per image
    tensors: dict = field(default_factory=dict)  # the processor's image tensors for this prompt


def copy_processor_files(model_path: str, out_dir: str) -> None:
    """The processor's files of the model folder at `model_path` (if any) into `out_dir`."""
    if not model_path or not os.path.isdir(model_path):
        return
    for name in PROCESSOR_FILES:
        if os.path.isfile(os.path.join(model_path, name)):
            shutil.copy(os.path.join(model_path, name), os.path.join(out_dir, name))


def load_processor(path: str):
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(path)


def encode_prompt(processor, messages: list, images: list, tools=None) -> tuple[list[int], VisionPrompt]:
    """(token_ids, VisionPrompt) of one chat whose image parts are bare {"type": "image"}."""
    extra = {"tools": tools} if tools else {}
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    template_ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    encoded = processor(text=[text], images=[images] if images else None, add_special_tokens=False,
                        return_tensors="pt")
    tensors = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask", "token_type_ids",
                                                           "mm_token_type_ids")}
    return encoded["input_ids"][0].tolist(), VisionPrompt(images=images, template_ids=template_ids, tensors=tensors)


def join_image_tensors(visions: list, model_type: str, dtype: torch.dtype, device) -> dict:
    """The model's image keyword arguments for a forward pass over rows whose image tokens
    appear in the order of `visions` (None entries: rows without images). {} if none has any."""
    present = [v.tensors for v in visions if v is not None and v.tensors]
    if not present:
        return {}
    axis = 1 if model_type in IMAGES_PER_ROW else 0
    joined = {}
    for key in present[0]:
        value = torch.cat([t[key] for t in present], dim=axis)
        joined[key] = value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
    return joined
