"""Writing safetensors shards one tensor at a time, so memory holds one tensor, not a shard.

A safetensors file is an 8-byte header length, a JSON header (names, dtypes, shapes, byte
offsets) and the tensors' bytes. The header comes first but is only known once a shard is
complete, so each file reserves HEADER_RESERVE bytes for it, streams the data after that, and
writes the header last, padded with spaces (the format allows trailing whitespace in the
header). Transformers, vLLM and the safetensors library read these files unchanged.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct

import torch

HEADER_RESERVE = 1 << 20   # room for ~5000 tensor entries; a larger header moves the data once
INDEX = "model.safetensors.index.json"
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
               torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
               torch.float8_e5m2: "F8_E5M2"}


class ShardWriter:
    """One safetensors file, written tensor by tensor."""

    def __init__(self, path: str):
        self.path, self.entries, self.size = path, {}, 0
        self.file = open(path, "wb")
        self.file.seek(8 + HEADER_RESERVE)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().cpu().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        self.entries[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                              "data_offsets": [self.size, self.size + nbytes]}
        if nbytes:
            self.file.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
        self.size += nbytes

    def close(self) -> None:
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.entries},
                            separators=(",", ":")).encode()
        if len(header) <= HEADER_RESERVE:
            self.file.seek(0)
            self.file.write(struct.pack("<Q", HEADER_RESERVE) + header.ljust(HEADER_RESERVE, b" "))
            self.file.close()
            return
        # too many tensors for the reserved room: write the header to a new file, then the data
        self.file.close()
        padded = header.ljust(-(-len(header) // 8) * 8, b" ")
        with open(self.path, "rb") as src, open(self.path + ".tmp", "wb") as dst:
            dst.write(struct.pack("<Q", len(padded)) + padded)
            src.seek(8 + HEADER_RESERVE)
            shutil.copyfileobj(src, dst, 2**24)
        os.replace(self.path + ".tmp", self.path)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**24), b""):
            digest.update(block)
    return digest.hexdigest()


def write_safetensors(tensors, out_dir: str, shard_mb: int = 2048, dtype=None, write: bool = True,
                      always_index: bool = False, shard_of=None, metadata: dict = None) -> None:
    """Stream (HF name, tensor) pairs into safetensors shards of about shard_mb each, floating
    point ones optionally cast to `dtype`; memory holds one tensor at a time. `shard_of(name)`,
    if given, names each tensor's shard instead (a shard's tensors must come together). One
    shard is written as model.safetensors unless always_index; otherwise an index maps names to
    shards and records each shard's sha256 (plus `metadata`). With write=False the stream is
    only consumed (ranks that must take part in its collectives but write nothing)."""
    if not write:
        for _ in tensors:
            pass
        return
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):
        if name.endswith(".safetensors") or name == INDEX:
            os.remove(os.path.join(out_dir, name))
    shards: list[str] = []
    weight_map: dict[str, str] = {}
    writer = None
    for name, tensor in tensors:
        if shard_of is not None:
            shard = shard_of(name)
            if shards and shard != shards[-1] and shard in shards:
                raise ValueError(f"tensor '{name}' of shard {shard} comes after another shard's")
        elif writer is None or writer.size >= shard_mb * 2**20:
            shard = f"model-{len(shards) + 1:05d}.safetensors"
        else:
            shard = shards[-1]
        if writer is None or shard != shards[-1]:
            if writer is not None:
                writer.close()
            shards.append(shard)
            writer = ShardWriter(os.path.join(out_dir, shard))
        writer.add(name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor)
        weight_map[name] = shard
    if writer is not None:
        writer.close()
    if len(shards) == 1 and not always_index:
        os.replace(os.path.join(out_dir, shards[0]), os.path.join(out_dir, "model.safetensors"))
        return
    checksums = {s: sha256_of(os.path.join(out_dir, s)) for s in shards}
    total = sum(os.path.getsize(os.path.join(out_dir, s)) for s in shards)
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total, "sha256": checksums, **(metadata or {})},
                   "weight_map": weight_map}, f, indent=1)
