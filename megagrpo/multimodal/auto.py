"""Which transformers auto class builds a model: image-text-to-text for a vision-language
model (its config has a vision tower), causal LM otherwise. Imports nothing heavy, so the
tools can use it before their console filters are in place (DeepSpeed warns while imported)."""
from __future__ import annotations

from megagrpo.multimodal.processor import is_vision_language


def auto_model_class_of(config):
    """The auto class for a loaded config (a hub model's, the planner's, a tool's new one)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM


def auto_model_class(path: str):
    """The auto class for the model folder at `path`."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if is_vision_language(path) else AutoModelForCausalLM
