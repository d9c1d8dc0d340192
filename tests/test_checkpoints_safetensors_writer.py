"""The streaming safetensors writer: files the safetensors library reads back exactly."""
import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from megagrpo.checkpoints import safetensors_writer
from megagrpo.checkpoints.safetensors_writer import write_safetensors


def sample_tensors():
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(300, 64, generator=g),
            "layers.0.w": torch.randn(64, 64, generator=g).to(torch.bfloat16),
            "layers.0.h": torch.randn(7, 3, generator=g).to(torch.float16),
            "layers.0.t": torch.randn(128, 64, generator=g)[:, ::2],   # not contiguous
            "counts": torch.arange(10, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "scale": torch.tensor(0.5),                                 # 0-dim
            "empty": torch.zeros(0, 4)}


@pytest.mark.parametrize("reserve", [safetensors_writer.HEADER_RESERVE, 64])
def test_shards_read_back_exactly_with_checksums(tmp_path, monkeypatch, reserve):
    """reserve=64: the header outgrows its reserved room and the data is moved behind it."""
    monkeypatch.setattr(safetensors_writer, "HEADER_RESERVE", reserve)
    tensors = sample_tensors()
    write_safetensors(iter(tensors.items()), str(tmp_path), shard_mb=0.05, always_index=True)
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and set(index["weight_map"]) == set(tensors)
    loaded = {}
    for shard in shards:
        data = (tmp_path / shard).read_bytes()
        assert index["metadata"]["sha256"][shard] == hashlib.sha256(data).hexdigest()
        loaded.update(load_file(str(tmp_path / shard)))
        with safe_open(str(tmp_path / shard), "pt") as f:
            assert f.metadata() == {"format": "pt"}
    assert index["metadata"]["total_size"] == sum((tmp_path / s).stat().st_size for s in shards)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_single_file_cast_and_no_write(tmp_path):
    """One shard is model.safetensors, no index; floating point tensors cast, others kept."""
    tensors = sample_tensors()
    write_safetensors(iter(tensors.items()), str(tmp_path), dtype=torch.bfloat16)
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert not (tmp_path / "model.safetensors.index.json").exists()
    for name, tensor in tensors.items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert loaded[name].dtype == want.dtype and torch.equal(loaded[name], want), name
    consumed = []
    write_safetensors((consumed.append(k) or (k, v) for k, v in tensors.items()), str(tmp_path / "none"),
                      write=False)
    assert consumed == list(tensors) and not (tmp_path / "none").exists()
