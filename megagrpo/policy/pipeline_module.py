"""Pipeline parallelism: a Llama-family HF decoder as a DeepSpeed PipelineModule.

The model becomes a list of layers, partitioned over the stages balanced by parameter count:

    embedding | decoder layer 0 | ... | decoder layer L-1 | final norm | log-prob head

Each rank builds only its stage's layers and reads only their tensors from the model's
safetensors files (no rank ever loads the whole model). The activations passed between
stages are (hidden, position_ids, predict_at, targets): a micro-batch is packed rows (see
packing.py) and the head at the last stage returns, for the positions that predict completion
tokens, (log p(target), entropy) from the fused chunked pass. The GRPO loss runs there too, as
the module's loss_fn, with advantages and the old/reference/sampler log-probs carried as the
micro-batch's labels. With tied embeddings the head is a TiedLayerSpec of the embedding, so
DeepSpeed sums the two stages' gradients of the shared weight.

With tensor parallelism (tp > 1) each stage's decoder layers are split over the stage's tp
ranks by DeepSpeed's AutoTP training layers: q/k/v/gate/up along their outputs (each rank a
block of whole heads), o/down along their inputs with the outputs summed over the tp group.
Embedding, norms and the head are replicated. Rank layout is DeepSpeed's (pipe, data, model)
topology (cluster/topology.py).
"""
from __future__ import annotations

import functools
import json
import os
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from megagrpo.dtypes import DTYPES
from megagrpo.policy.fused_logprobs import fused_token_logprobs, logprobs_from_logits
from megagrpo.policy.weight_gather import tensor_parallel_gather


class SafetensorsSource:
    """Reads single tensors by HF name from a model folder's safetensors files (cast to dtype,
    unless None)."""

    def __init__(self, model_path: str, dtype: torch.dtype):
        self.model_path, self.dtype = model_path, dtype
        index = os.path.join(model_path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                self.file_of = json.load(f)["weight_map"]
        else:
            from safetensors import safe_open
            single = os.path.join(model_path, "model.safetensors")
            with safe_open(single, "pt") as f:
                self.file_of = {name: "model.safetensors" for name in f.keys()}

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open
        if name not in self.file_of:
            raise KeyError(f"{self.model_path}: no tensor '{name}' in the safetensors files")
        with safe_open(os.path.join(self.model_path, self.file_of[name]), "pt") as f:
            tensor = f.get_tensor(name)
        return tensor if self.dtype is None else tensor.to(self.dtype)

    def load_into(self, module: torch.nn.Module, prefix: str) -> None:
        """Materialise a meta-device module and fill its parameters from `prefix` + name."""
        module.to_empty(device="cpu")
        with torch.no_grad():
            for name, param in module.named_parameters():
                param.copy_(self.tensor(prefix + name))


class ModelParts:
    """The HF classes of one Llama-family architecture, found on a meta-device instance."""

    def __init__(self, model_path: str, dtype: torch.dtype, attn_implementation: str):
        from transformers import AutoConfig, AutoModelForCausalLM
        self.config = AutoConfig.from_pretrained(model_path)
        self.config._attn_implementation = attn_implementation
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(self.config)
        self.decoder_layer = type(meta.model.layers[0])
        self.norm = type(meta.model.norm)
        self.rotary = type(meta.model.rotary_emb)
        self.tied = bool(getattr(self.config, "tie_word_embeddings", False))
        self.layer_params = [sum(p.numel() for p in layer.parameters()) for layer in meta.model.layers]
        self.layer_split_params = [sum(p.numel() for n, p in layer.named_parameters()
                                       if tensor_parallel_dim(f".layers.{n}", p.dim()) is not None)
                                   for layer in meta.model.layers]
        self.hidden = self.config.hidden_size
        self.vocab = self.config.vocab_size
        self.model_path, self.dtype = model_path, dtype

    @functools.cached_property
    def source(self) -> SafetensorsSource:
        return SafetensorsSource(self.model_path, self.dtype)

    def layer_counts(self) -> list[int]:
        """Parameters of each pipeline layer: embedding, decoder layers, final norm, head (a
        tied head holds its own copy of the embedding on the last stage)."""
        return [self.vocab * self.hidden, *self.layer_params, self.hidden, self.vocab * self.hidden]

    def stage_bounds(self, stages: int) -> list[int]:
        """DeepSpeed's parameter-balanced partition: stage s holds layers bounds[s]:bounds[s+1]."""
        from deepspeed.runtime.utils import partition_balanced
        return partition_balanced(weights=self.layer_counts(), num_parts=stages)

    def stage_parameters(self, stages: int, tp: int = 1) -> list[int]:
        """Parameters one rank of each stage holds under DeepSpeed's parameter-balanced
        partitioning (of whole layers), its decoder layers split over tp ranks."""
        counts, bounds = self.layer_counts(), self.stage_bounds(stages)
        split = [0, *self.layer_split_params, 0, 0]
        held = [count - part + part // tp for count, part in zip(counts, split)]
        return [sum(held[bounds[s]:bounds[s + 1]]) for s in range(stages)]

    def stage_tensor_names(self, stages: int) -> list[list[str]]:
        """The HF tensors each stage's layers read (a tied head reads the first stage's
        embedding, so it adds nothing here). Tensors of no layer go to the last stage."""
        prefixes = ["model.embed_tokens.", *[f"model.layers.{i}." for i in range(len(self.layer_params))],
                    "model.norm.", "lm_head."]
        names, bounds = list(self.source.file_of), self.stage_bounds(stages)
        by_stage = [[n for n in names if any(n.startswith(p) for p in prefixes[bounds[s]:bounds[s + 1]])]
                    for s in range(stages)]
        placed = {n for stage in by_stage for n in stage}
        by_stage[-1] += [n for n in names if n not in placed]
        return by_stage


class Embedding(torch.nn.Module):
    """Stage input (input_ids, position_ids, predict_at, targets) -> activations."""

    hf_names = {"weight": "model.embed_tokens.weight"}

    def __init__(self, parts: ModelParts):
        super().__init__()
        self.weight = torch.nn.Parameter(parts.source.tensor("model.embed_tokens.weight"))
        self.padding_idx = parts.config.pad_token_id  # no gradient for its row, as in the HF model

    def forward(self, inputs):
        input_ids, position_ids, predict_at, targets = inputs
        return F.embedding(input_ids, self.weight, self.padding_idx), position_ids, predict_at, targets


COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""Linear layers split along their outputs (weight and bias dim 0) under tensor parallelism."""
ROW_PARALLEL = ("o_proj", "down_proj")
"""Linear layers split along their inputs (weight dim 1; a bias stays whole)."""
HEAD_NORMS = ("q_norm", "k_norm")
"""Replicated norms applied to each attention head (Qwen3): each tp rank sees only its own heads,
so their gradients are summed over the tp group."""


def tensor_parallel_dim(hf_name: str, tensor_dims: int) -> Optional[int]:
    """The dimension along which tensor parallelism splits an HF tensor (None: replicated)."""
    parts = hf_name.split(".")
    if ".layers." not in hf_name or len(parts) < 2:
        return None
    if parts[-2] in COLUMN_PARALLEL:
        return 0
    if parts[-2] in ROW_PARALLEL and parts[-1] == "weight" and tensor_dims == 2:
        return 1
    return None


def split_for_tensor_parallel(layer: torch.nn.Module, tp_group, config, prefix: str) -> None:
    """Replace the linear layers of one decoder layer by DeepSpeed's AutoTP training layers,
    which keep this rank's slice (the attention keeps a block of whole heads); per-head norms
    get their gradients summed over the tp group (HEAD_NORMS)."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer, set_autotp_mode
    from deepspeed.module_inject.tp_shard import AutoTPMeta
    set_autotp_mode(training=True)
    meta = AutoTPMeta.from_model_config(config)
    for name, child in list(layer.named_modules()):
        parent_name, _, leaf = name.rpartition(".")
        kind = LinearLayer if leaf in COLUMN_PARALLEL else LinearAllreduce if leaf in ROW_PARALLEL else None
        if kind is not None and isinstance(child, torch.nn.Linear):
            setattr(layer.get_submodule(parent_name), leaf, kind(child, tp_group, name=prefix + name, tp_meta=meta))
        if leaf in HEAD_NORMS:
            for param in child.parameters():
                param.register_hook(functools.partial(_summed_over, group=tp_group))


def _summed_over(grad: torch.Tensor, group) -> torch.Tensor:
    grad = grad.contiguous()
    dist.all_reduce(grad, group=group)
    return grad


class DecoderLayer(torch.nn.Module):
    """One HF decoder layer with its rotary embedding and (packed, causal) attention mask,
    split over the stage's tp ranks when a tp group is given."""

    def __init__(self, parts: ModelParts, index: int, tp_group=None):
        super().__init__()
        self.config, self.index = parts.config, index
        with torch.device("meta"):
            self.layer = parts.decoder_layer(parts.config, index).to(parts.dtype)
        parts.source.load_into(self.layer, f"model.layers.{index}.")
        if tp_group is not None:
            split_for_tensor_parallel(self.layer, tp_group, parts.config, f"model.layers.{index}.")
        self.rotary = parts.rotary(config=parts.config)
        self.hf_names = {f"layer.{n}": f"model.layers.{index}.{n}" for n, _ in self.layer.named_parameters()}

    def forward(self, inputs):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
        hidden, position_ids, predict_at, targets = inputs
        kind = (getattr(self.config, "layer_types", None) or ["full_attention"] * (self.index + 1))[self.index]
        make_mask = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
        mask = make_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                         past_key_values=None, position_ids=position_ids)
        hidden = self.layer(hidden, attention_mask=mask, position_ids=position_ids,
                            position_embeddings=self.rotary(hidden, position_ids))
        return hidden, position_ids, predict_at, targets


class FinalNorm(torch.nn.Module):
    hf_names = {"norm.weight": "model.norm.weight"}

    def __init__(self, parts: ModelParts):
        super().__init__()
        with torch.device("meta"):
            self.norm = parts.norm(parts.hidden, eps=parts.config.rms_norm_eps).to(parts.dtype)
        parts.source.load_into(self.norm, "model.norm.")

    def forward(self, inputs):
        hidden, *rest = inputs
        return (self.norm(hidden), *rest)


def head_logprobs(head: torch.nn.Module, inputs, temperature: float, chunk_size: int, fused: bool):
    """Last layer: (K, 2) = (log p(target), entropy) at the flat positions that predict
    completion tokens, from the final hidden states and the head's weight."""
    hidden, _, predict_at, targets = inputs
    selected = hidden.reshape(-1, hidden.shape[-1])[predict_at]
    if fused:
        logp, entropy = fused_token_logprobs(selected, head.weight, targets, temperature,
                                             chunk_size, with_entropy=True)
    else:
        logp, entropy = logprobs_from_logits(F.linear(selected, head.weight), targets, temperature)
    return torch.stack([logp, entropy], dim=-1)


class LMHead(torch.nn.Module):
    """The untied output projection (lm_head.weight) with the log-prob head's forward."""

    hf_names = {"weight": "lm_head.weight"}

    def __init__(self, parts: ModelParts, head):
        super().__init__()
        self.weight = torch.nn.Parameter(parts.source.tensor("lm_head.weight"))
        self.head = head

    def forward(self, inputs):
        return self.head(self, inputs)


class DecoderPipeline(PipelineModule):
    """PipelineModule whose partitioning counts parameters from shapes (DeepSpeed's own count
    would build, and so load, every layer on every rank)."""

    def _count_layer_params(self):
        return [spec.num_params for spec in self._layer_specs]


def layer_specs(parts: ModelParts, temperature: float, chunk_size: int, fused: bool, tp_group=None) -> list:
    """The layer list, each spec carrying its (whole-model) parameter count for the partitioner."""
    head = functools.partial(head_logprobs, temperature=temperature, chunk_size=chunk_size, fused=fused)
    if parts.tied:
        embedding = TiedLayerSpec("embed", Embedding, parts, tied_weight_attr="weight")
        output = TiedLayerSpec("embed", Embedding, parts, forward_fn=head, tied_weight_attr="weight")
    else:
        embedding, output = LayerSpec(Embedding, parts), LayerSpec(LMHead, parts, head)
    decoders = [LayerSpec(DecoderLayer, parts, i, tp_group) for i in range(len(parts.layer_params))]
    specs = [embedding, *decoders, LayerSpec(FinalNorm, parts), output]
    for spec, count in zip(specs, parts.layer_counts()):
        spec.num_params = count
    return specs


def build_pipeline_module(cfg, attn_implementation: str, topology, loss_fn) -> DecoderPipeline:
    """This rank's stage (its tp slice, with tp > 1) of the policy (or reference) model, its
    weights read from the model folder's safetensors."""
    parts = ModelParts(cfg.model.name_or_path, DTYPES[cfg.model.dtype], attn_implementation)
    specs = layer_specs(parts, cfg.rollout.temperature, cfg.grpo.logprob_chunk_size, cfg.grpo.fused_logprobs,
                        topology.tp_group)
    # model.gradient_checkpointing: DeepSpeed's pipeline activation checkpointing, every
    # decoder layer recomputed in backward (its non-reentrant form, which also checkpoints a
    # layer whose inputs need no gradient)
    checkpointing = {}
    if cfg.model.gradient_checkpointing:
        checkpointing = dict(activation_checkpoint_interval=1, checkpointable_layers=[DecoderLayer.__name__],
                             activation_checkpoint_func=ds_checkpointing.non_reentrant_checkpoint)
    grid = PipeModelDataParallelTopology(num_pp=topology.pp_size, num_mp=topology.tp_size, num_dp=topology.dp_size)
    with torch.no_grad():  # (DeepSpeed broadcasts a tied weight in place as it builds the stages)
        module = DecoderPipeline(layers=specs, topology=grid, loss_fn=loss_fn,
                                 partition_method="parameters", dynamic_shape=True, **checkpointing)
    module.config = parts.config
    return module


# ---- weights out of the pipeline ----------------------------------------------------------

def gather_to_first_stage(module: DecoderPipeline, topology) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, whole tensor) for the whole model on the model group's first rank (stage
    0, tp rank 0), streamed stage by stage: each stage gathers its layers' tp slices one tensor
    at a time (all its tp ranks take part) and its tp rank 0 sends the tensor to the first rank.
    Other ranks yield nothing but must iterate to the end. A tied weight is sent once."""
    rank, first = dist.get_rank(), topology.model_group_source
    for stage in range(topology.pp_size):
        sender = topology.stage_ranks(stage)[0]
        local = _local_hf_tensors(module) if module.stage_id == stage else None
        box = [[name for name, _, _ in local] if rank == sender else None]
        if topology.model_group is not None:
            dist.broadcast_object_list(box, src=sender, group=topology.model_group)
        for i, name in enumerate(box[0]):
            if local is not None:
                _, param, owner = local[i]
                with tensor_parallel_gather(param, owner):
                    if rank == sender == first:
                        yield name, param.data
                    elif rank == sender:
                        _send_tensor(param.data, first)
            elif rank == first:
                yield name, _recv_tensor(sender)


def _send_tensor(tensor: torch.Tensor, dst: int) -> None:
    """Point-to-point: a header (dtype, rank, shape), then the data."""
    header = torch.zeros(8, dtype=torch.int64)
    header[0], header[1] = _WIRE_DTYPES.index(tensor.dtype), tensor.dim()
    header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
    dist.send(header, dst=dst)
    dist.send(tensor.contiguous(), dst=dst)


def _recv_tensor(src: int) -> torch.Tensor:
    header = torch.empty(8, dtype=torch.int64)
    dist.recv(header, src=src)
    dims = int(header[1])
    buffer = torch.empty(header[2:2 + dims].tolist(), dtype=_WIRE_DTYPES[int(header[0])])
    dist.recv(buffer, src=src)
    return buffer


_WIRE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _local_hf_tensors(module: DecoderPipeline) -> list[tuple[str, torch.nn.Parameter, torch.nn.Module]]:
    """This stage's parameters under their HF names, in layer order, with the module that owns
    each (for the tp gather). A tied head (a function of the embedding, not a module, in
    forward_funcs) adds nothing: stage 0 sends the weight."""
    out = []
    for layer in module.forward_funcs:
        if isinstance(layer, torch.nn.Module):
            for module_name, owner in layer.named_modules():
                for name, param in owner.named_parameters(recurse=False):
                    full = f"{module_name}.{name}" if module_name else name
                    if full in layer.hf_names:
                        out.append((layer.hf_names[full], param, owner))
    return out
