"""A vision-language model's parts, read from its config and its parameter names: whether a
model takes images, which transformers auto class builds it (image-text-to-text for a VLM,
causal LM otherwise), and which names belong to its image encoder, its connector and its
language model. Imports nothing heavy, so the tools can use it before their console filters are
in place (DeepSpeed warns while it is imported)."""
from __future__ import annotations

import json
import os

VISION_TOWER_PREFIXES = ("vision_model.", "visual.", "vision_tower.")  # Idefics3/SmolVLM, Qwen-VL, LLaVA
CONNECTOR_PREFIXES = ("connector.", "multi_modal_projector.")  # Idefics3, LLaVA (Qwen-VL's merger is in visual.)


def in_vision_tower(name: str) -> bool:
    """Whether a parameter or module name of a VLM is part of its image encoder."""
    return any(f".{prefix}" in f".{name}" for prefix in VISION_TOWER_PREFIXES)


def in_language_model(name: str) -> bool:
    """Whether a parameter or module name of a VLM is part of its language model (neither the
    image encoder nor the connector that projects into the language model)."""
    return not in_vision_tower(name) and not any(f".{prefix}" in f".{name}" for prefix in CONNECTOR_PREFIXES)


def model_config(path: str) -> dict:
    """config.json of a local model folder ({} for a hub name or a folder without one)."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return {}
    with open(config_file) as f:
        return json.load(f)


def is_vision_language(path: str) -> bool:
    """Whether the model at `path` takes images (its config has a vision tower)."""
    return "vision_config" in model_config(path)


def auto_model_class_of(config):
    """The auto class for a loaded config (a hub model's, the planner's, a tool's new one)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM


def auto_model_class(path: str):
    """The auto class for the model folder at `path`."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if is_vision_language(path) else AutoModelForCausalLM
