"""Experiment configuration: the schema (schema.py: a dataclass per section, a docstring per
field), loading with overrides (loading.py), checks (validation.py), the DeepSpeed JSON reader
(deepspeed_json.py) and the generated reference page (docs.py)."""
