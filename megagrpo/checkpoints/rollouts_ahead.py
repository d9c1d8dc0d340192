"""The batches sampled ahead (rollout.max_staleness) in a checkpoint: one JSON file per rank,
rollouts_ahead_rank<r>.json, of plain fields and lists (token ids, log-probs, versions), and
an MoE sampler's routes (routing replay r3) as {"shape", "dtype", "base64"} of their bytes.

Nothing is unpickled: a checkpoint may be copied from another cluster or user. A file is read
as JSON and only the fields of AheadBatch, Completion and Trajectory are accepted; anything else
is refused by name. JSON keeps floats exactly (shortest repr round-trips), so a resumed run
trains on the same log-probs.

    {"format": "megagrpo.rollouts_ahead", "version": 1,
     "batches": [{"step": 3, "indices": [1, 2], "version": 2, "seconds": 0.5,
                  "groups": [[{"kind": "completion", "token_ids": [..], "logprobs": [..], ...}]]}]}
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os

import numpy as np

from megagrpo.config.schema import ConfigError

FORMAT, VERSION = "megagrpo.rollouts_ahead", 1
BATCH_FIELDS = ("step", "indices", "groups", "version", "seconds")


def file_name(rank: int) -> str:
    return f"rollouts_ahead_rank{rank}.json"


def _kinds() -> dict:
    from megagrpo.policy.batch import Completion
    from megagrpo.rollout.agent import Trajectory
    return {"completion": Completion, "trajectory": Trajectory}


def to_dict(batch) -> dict:
    """An AheadBatch as plain JSON data."""
    names = {cls: kind for kind, cls in _kinds().items()}
    groups = None if batch.groups is None else [
        [{"kind": names[type(c)], **dataclasses.asdict(c), "routes": _routes_to_json(c.routes)} for c in group]
        for group in batch.groups]
    return {"step": batch.step, "indices": list(batch.indices), "groups": groups,
            "version": batch.version, "seconds": batch.seconds}


ROUTE_DTYPES = ("uint8", "int16", "uint16")  # the samplers' route types (policy/moe.py, vLLM)


def _routes_to_json(routes):
    if routes is None:
        return None
    routes = np.ascontiguousarray(routes)
    return {"shape": list(routes.shape), "dtype": str(routes.dtype),
            "base64": base64.b64encode(routes.tobytes()).decode("ascii")}


def _routes_from_json(data, where: str):
    if data is None:
        return None
    try:
        if data["dtype"] not in ROUTE_DTYPES:
            raise ValueError(f"dtype {data['dtype']!r}, not one of {ROUTE_DTYPES}")
        flat = np.frombuffer(base64.b64decode(data["base64"], validate=True), dtype=data["dtype"])
        return flat.reshape([int(n) for n in data["shape"]]).copy()
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: not batches megagrpo saved (routes: {e})") from None


def from_dict(data: dict, where: str):
    """The AheadBatch `data` describes; ConfigError naming `where` for anything not one."""
    from megagrpo.rollout.ahead import AheadBatch

    kinds = _kinds()

    def completion(c):
        cls = kinds.get(c.get("kind")) if isinstance(c, dict) else None
        if cls is None:
            raise ConfigError(f"{where}: not batches megagrpo saved (a completion of kind "
                              f"{c.get('kind') if isinstance(c, dict) else type(c).__name__!r})")
        values = {k: v for k, v in c.items() if k != "kind"}
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"{where}: not batches megagrpo saved (unknown fields {sorted(unknown)})")
        return cls(**{**values, "routes": _routes_from_json(values.get("routes"), where)})

    if not isinstance(data, dict) or set(data) != set(BATCH_FIELDS):
        raise ConfigError(f"{where}: not batches megagrpo saved (a batch with fields "
                          f"{sorted(data) if isinstance(data, dict) else type(data).__name__})")
    groups = None if data["groups"] is None else [[completion(c) for c in g] for g in data["groups"]]
    return AheadBatch(data["step"], data["indices"], groups, data["version"], data["seconds"])


def save(folder: str, rank: int, batches: list) -> None:
    with open(os.path.join(folder, file_name(rank)), "w") as f:
        json.dump({"format": FORMAT, "version": VERSION, "batches": [to_dict(b) for b in batches]}, f)


def read(path: str) -> list:
    """The batches in one rank's file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not batches megagrpo saved (not JSON: {e})") from None
    if not (isinstance(data, dict) and data.get("format") == FORMAT and data.get("version") == VERSION
            and isinstance(data.get("batches"), list)):
        raise ConfigError(f"{path}: not batches megagrpo saved (format {FORMAT} version {VERSION})")
    return [from_dict(b, path) for b in data["batches"]]


def load_rollouts_ahead(state: dict, rank: int, max_staleness: int) -> list:
    """This rank's batches sampled ahead that the checkpoint `state` came from saved (none when
    it was saved with rollout.max_staleness 0): they resume on the layout they were sampled for,
    and only with batches sampled ahead (the prompt order's state is past them)."""
    folder = state["path"]
    names = os.listdir(folder)
    pickled = sorted(n for n in names if n.startswith("rollouts_ahead_rank") and n.endswith(".pt"))
    if pickled:  # megagrpo before this format: torch.save's pickles, which are not loaded
        raise ConfigError(f"{os.path.join(folder, pickled[0])}: batches sampled ahead in the old pickled format, "
                          "which this version does not unpickle (a checkpoint may come from elsewhere). Resume "
                          "from a checkpoint saved by this version, or resume this one with the megagrpo "
                          "version that saved it")
    if not any(n.startswith("rollouts_ahead_rank") for n in names):
        return []
    path = os.path.join(folder, file_name(rank))
    if state.get("resharded") or not os.path.isfile(path):
        raise ConfigError(f"{folder}: its batches sampled ahead (rollout.max_staleness) are saved per "
                          f"rank and resume on the layout they were sampled for (dp {state['dp_size']}); resume "
                          "with that layout")
    batches = read(path)
    if max_staleness == 0 and batches:  # every rank samples as many batches ahead: its own file tells
        raise ConfigError(f"{folder} holds batches sampled ahead for the steps after it (saved with "
                          "rollout.max_staleness > 0); resume it with rollout.max_staleness > 0")
    return batches
