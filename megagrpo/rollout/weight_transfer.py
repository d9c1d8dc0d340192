"""Weight transfer over gloo: vLLM's weight-transfer API with a transport that runs on CPU.

vLLM 0.32 moves a trainer's weights into engines that run apart from it through weight-transfer
engines (`vllm.distributed.weight_transfer`: a worker side inside the engine, a trainer side in
the trainer, both picked by backend name from a factory) driven by the engine's RL control
plane (`LLM.init_weight_transfer_engine` / `start_weight_update` / `update_weights` /
`finish_weight_update`, the same routes on `vllm serve` with VLLM_SERVER_DEV_MODE=1). Its
backends (nccl, ipc, ...) all need CUDA. This module registers backend "gloo" in both factories:
the NCCL engine's protocol over a gloo group made apart from any job's world (vLLM's
`stateless_init_torch_distributed_process_group`), the trainer's sender at rank 0 and the
engine's workers after it. So CPU and GPU take the same code path apart from the transport.

    # the engine (any process: registered in vLLM's workers by megagrpo's vLLM plugin, setup.py);
    # on the CPU stack `python -m vllm.entrypoints.openai.api_server --model MODEL` (upstream-issues.md)
    vllm serve MODEL --weight-transfer-config '{"backend": "gloo"}'     # VLLM_SERVER_DEV_MODE=1
    # the trainer
    sender = GlooTrainerWeightTransferEngine.trainer_init(
        GlooTrainerInitInfo(address, port, world_size=1 + engine_workers, rank=0),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    sender.send_weights(weight_version="1")

Each update is one broadcast per tensor from the sender, loaded on arrival through vLLM's
layerwise reload (as the co-located sync's `reload_weights`).
"""
from __future__ import annotations

import datetime
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import ClassVar, Iterable

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "gloo"


def connect(address: str, port: int, rank: int, world_size: int, timeout_s: float):
    """The transfer group: a gloo process group of its own (not registered with
    torch.distributed, so its collectives are called on the group object)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    # Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) torch's rendezvous makes every rank a
    # client of the launcher's store; this group's rank 0 must host a store of its own.
    agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        return stateless_init_torch_distributed_process_group(
            address, port, rank, world_size, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    finally:
        if agent_store is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent_store


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What an engine's workers need to join the transfer group (the sender is rank 0)."""
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """The tensors of one update, in the order they are broadcast; or `streamed`: each tensor
    is preceded by a header naming it (send_stream), and an empty header ends the update."""
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    streamed: bool = False


def send_header(group, name: str = "", dtype: torch.dtype | None = None, shape=()) -> None:
    """One tensor's name, dtype and shape, from the sender (no name: the end of the update)."""
    text = json.dumps([name, str(dtype).removeprefix("torch."), list(shape)]).encode() if name else b""
    group.broadcast(torch.tensor([len(text)], dtype=torch.int64), 0).wait()
    if text:
        group.broadcast(torch.frombuffer(bytearray(text), dtype=torch.uint8), 0).wait()


def receive_header(group) -> tuple[str, torch.dtype, list[int]] | None:
    """The next header of a streamed update, or None at its end."""
    length = torch.zeros(1, dtype=torch.int64)
    group.broadcast(length, 0).wait()
    if not length.item():
        return None
    text = torch.empty(int(length.item()), dtype=torch.uint8)
    group.broadcast(text, 0).wait()
    name, dtype_name, shape = json.loads(bytes(text.tolist()).decode())
    return name, getattr(torch, dtype_name), shape


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side, inside vLLM: receives each tensor from the sender and loads it through the
    layerwise reload opened by start_weight_update."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group, self.loaded = None, []
        if device.type == "cpu":
            from megagrpo.rollout.vllm_models import skip_input_embedding_prepack
            skip_input_embedding_prepack(model)

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = connect(init_info.master_address, init_info.master_port, init_info.rank_offset + worker,
                             init_info.world_size, init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        initialize_layerwise_reload(self.model)
        self.loaded = []  # the names this update loads

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer: init_weight_transfer_engine was not called")
        headers = iter(lambda: receive_header(self.group), None) if update_info.streamed else (
            (name, getattr(torch, dtype_name), shape)
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes))
        for name, dtype, shape in headers:
            tensor = torch.empty(shape, dtype=dtype)
            self.group.broadcast(tensor, 0).wait()
            self.model.load_weights([(name, tensor.to(self.device))])
            self.loaded.append(name)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from megagrpo.rollout.vllm_models import refresh_after_reload
        finalize_layerwise_reload(self.model, self.model_config)
        refresh_after_reload(self.model, self.loaded)

    def shutdown(self) -> None:
        self.group = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of the transfer group: where it listens (rank 0, the sender) and its
    size, 1 + the engine's workers (dp x tp x pp)."""
    backend: ClassVar[str] = BACKEND
    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = 600.0


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side. Every trainer rank calls send_weights (the source's gathers are collective);
    the sender (rank 0) broadcasts each tensor while the engine receives it, its update_weights
    call running on a side thread (it returns once the engine has received every tensor)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if engine.is_sender:
            workers = GlooWeightTransferInitInfo(init_info.master_address, init_info.master_port, rank_offset=1,
                                                 world_size=init_info.world_size, timeout_s=init_info.timeout_s)
            with ThreadPoolExecutor(max_workers=1) as side:  # the workers block in the rendezvous too
                joined = side.submit(client.init_weight_transfer_engine, asdict(workers))
                engine.group = connect(init_info.master_address, init_info.master_port, 0, init_info.world_size,
                                       init_info.timeout_s)
                joined.result()
        return engine

    def send_weights(self, weight_version: str | None = None) -> None:
        """One update of every tensor of the source (their names and shapes sent ahead, as
        vLLM's NCCL engine does); weight_version names it in the engine."""
        if self.source is None:
            raise ValueError("gloo weight transfer: send_weights needs the engine made with a WeightSource "
                             "(or send a stream with send_stream)")
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return

        def broadcast_all():
            for (name, tensor), expected in zip(self.source, meta, strict=True):
                if name != expected.name or tuple(tensor.shape) != expected.shape or tensor.dtype != expected.dtype:
                    raise ValueError(f"gloo weight transfer: the source yielded {name} {tuple(tensor.shape)} "
                                     f"{tensor.dtype} where its metadata says {expected.name} {expected.shape} "
                                     f"{expected.dtype}")
                self.group.broadcast(tensor.detach().contiguous().cpu(), 0).wait()
        self._update(GlooWeightTransferUpdateInfo(names=[m.name for m in meta],
                                                  dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                                                  shapes=[list(m.shape) for m in meta]), broadcast_all, weight_version)

    def send_stream(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None) -> None:
        """One update from a stream of (name, whole tensor) whose names and shapes are not known
        ahead (the trainer's gathered buckets, or the changed layers only): each tensor goes
        with a header. Every trainer rank calls it (the stream's gathers are collective)."""
        if not self.is_sender:
            for _ in named_tensors:
                pass
            return

        def broadcast_all():
            for name, tensor in named_tensors:
                send_header(self.group, name, tensor.dtype, tensor.shape)
                self.group.broadcast(tensor.detach().contiguous().cpu(), 0).wait()
            send_header(self.group)
        self._update(GlooWeightTransferUpdateInfo(streamed=True), broadcast_all, weight_version)

    def _update(self, update: GlooWeightTransferUpdateInfo, broadcast_all, weight_version: str | None) -> None:
        """vLLM's handshake around the broadcasts: the engine's update_weights call runs on a side
        thread (it returns once the engine has received every tensor)."""
        self.client.start_weight_update()
        side = ThreadPoolExecutor(max_workers=1)
        try:
            received = side.submit(self.client.update_weights, asdict(update))
            broadcast_all()
            received.result()
        finally:
            side.shutdown(wait=False)  # after a failed broadcast the engine never returns
        self.client.finish_weight_update(weight_version)

    def shutdown(self) -> None:
        self.group = None


def register() -> None:
    """Register backend "gloo" in vLLM's worker and trainer factories (idempotent). Called in
    every vLLM process through the `vllm.general_plugins` entry point (setup.py)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    for factory, engine in ((WeightTransferEngineFactory, GlooWeightTransferEngine),
                            (WeightTransferTrainerFactory, GlooTrainerWeightTransferEngine)):
        try:
            factory.register_engine(BACKEND, engine)
        except ValueError:  # registered already in this process
            pass
