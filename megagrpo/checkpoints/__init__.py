"""Checkpoints: atomic save and resume, offline conversion, the streaming safetensors writer."""
