"""Experiment configuration: the schema (schema.py), YAML + overrides (loading.py), validation."""
from megagrpo.config.schema import *  # noqa: F401,F403
