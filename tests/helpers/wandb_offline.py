"""Read back an offline W&B run (WANDB_MODE=offline): its history rows, config, name and tags.

The run's `run-<id>.wandb` file is W&B's transaction log: a 7-byte header (":W&B", magic,
version), then 32 KiB blocks of chunks, each with a 7-byte header (CRC32C, length, type:
1 full, 2 first, 3 middle, 4 last) around serialised `wandb_internal_pb2.Record` protobufs.
"""
import glob
import json
import os
import struct

BLOCK, HEADER = 32768, 7


def records(path: str) -> list:
    from wandb.proto import wandb_internal_pb2
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # the rest of a block too short for a chunk header: padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk, pos = data[pos + HEADER:pos + HEADER + length], pos + HEADER + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
    parsed = []
    for raw in out:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        parsed.append(record)
    return parsed


def read_run(wandb_dir: str) -> dict:
    """{"history": [{name: value, "_step": N}], "config": {...}, "name", "tags", "project"} of
    the one offline run under wandb_dir."""
    paths = glob.glob(os.path.join(wandb_dir, "offline-run-*", "run-*.wandb"))
    assert len(paths) == 1, paths
    run = {"history": [], "config": {}}
    for record in records(paths[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            run["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                   for item in record.history.item})
        elif kind == "run":
            run.update(name=record.run.display_name, tags=list(record.run.tags), project=record.run.project)
            run["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            run["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
    return run
