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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import ClassVar

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
    return stateless_init_torch_distributed_process_group(
        address, port, rank, world_size, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


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
    """The tensors of one update, in the order they are broadcast."""
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side, inside vLLM: receives each tensor from the sender and loads it through the
    layerwise reload opened by start_weight_update."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        if device.type == "cpu":
            from megagrpo.rollout.generators import skip_input_embedding_prepack
            skip_input_embedding_prepack(model)

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = connect(init_info.master_address, init_info.master_port, init_info.rank_offset + worker,
                             init_info.world_size, init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer: init_weight_transfer_engine was not called")
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.group.broadcast(tensor, 0).wait()
            self.model.load_weights([(name, tensor.to(self.device))])

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from megagrpo.rollout.generators import refresh_tied_lm_head
        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_lm_head(self.model)

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
        if source is None:
            raise ValueError("gloo weight transfer needs a WeightSource (the trainer's weights)")
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
        """One update of every tensor of the source; weight_version names it in the engine."""
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        update = GlooWeightTransferUpdateInfo(names=[m.name for m in meta],
                                              dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                                              shapes=[list(m.shape) for m in meta])
        self.client.start_weight_update()
        side = ThreadPoolExecutor(max_workers=1)
        try:
            received = side.submit(self.client.update_weights, asdict(update))
            for (name, tensor), expected in zip(self.source, meta, strict=True):
                if name != expected.name or tuple(tensor.shape) != expected.shape or tensor.dtype != expected.dtype:
                    raise ValueError(f"gloo weight transfer: the source yielded {name} {tuple(tensor.shape)} "
                                     f"{tensor.dtype} where its metadata says {expected.name} {expected.shape} "
                                     f"{expected.dtype}")
                self.group.broadcast(tensor.detach().contiguous().cpu(), 0).wait()
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
