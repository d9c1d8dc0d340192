"""The `deepspeed` setting (a JSON file's path or an inline mapping) read as a dict, and the
one reader of its ZeRO stage."""
from __future__ import annotations

import copy
import json
from typing import Any


def read_deepspeed_config(setting: Any) -> dict:
    """A copy of the DeepSpeed config that `setting` names or holds."""
    if isinstance(setting, str):
        with open(setting) as f:
            return json.load(f)
    return copy.deepcopy(setting)


def zero_stage(setting: Any) -> int:
    """The ZeRO stage of a DeepSpeed config (a dict, or the `deepspeed` setting)."""
    ds = setting if isinstance(setting, dict) else read_deepspeed_config(setting)
    return int(ds.get("zero_optimization", {}).get("stage", 0))
