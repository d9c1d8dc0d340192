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

Rank layout is DeepSpeed's (pipe, data) topology: stage = rank // dp, dp rank = rank % dp.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

from megagrpo.dtypes import DTYPES
from megagrpo.engines.fused_logprobs import fused_token_logprobs, logprobs_from_logits


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

    def stage_parameters(self, stages: int) -> list[int]:
        """Parameters per stage under DeepSpeed's parameter-balanced partitioning."""
        counts, bounds = self.layer_counts(), self.stage_bounds(stages)
        return [sum(counts[bounds[s]:bounds[s + 1]]) for s in range(stages)]

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

    def forward(self, inputs):
        input_ids, position_ids, predict_at, targets = inputs
        return F.embedding(input_ids, self.weight), position_ids, predict_at, targets


class DecoderLayer(torch.nn.Module):
    """One HF decoder layer with its rotary embedding and (packed, causal) attention mask."""

    def __init__(self, parts: ModelParts, index: int):
        super().__init__()
        self.config, self.index = parts.config, index
        with torch.device("meta"):
            self.layer = parts.decoder_layer(parts.config, index).to(parts.dtype)
        parts.source.load_into(self.layer, f"model.layers.{index}.")
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


def layer_specs(parts: ModelParts, temperature: float, chunk_size: int, fused: bool) -> list:
    """The layer list, each spec carrying its parameter count for the partitioner."""
    head = functools.partial(head_logprobs, temperature=temperature, chunk_size=chunk_size, fused=fused)
    if parts.tied:
        embedding = TiedLayerSpec("embed", Embedding, parts, tied_weight_attr="weight")
        output = TiedLayerSpec("embed", Embedding, parts, forward_fn=head, tied_weight_attr="weight")
    else:
        embedding, output = LayerSpec(Embedding, parts), LayerSpec(LMHead, parts, head)
    decoders = [LayerSpec(DecoderLayer, parts, i) for i in range(len(parts.layer_params))]
    specs = [embedding, *decoders, LayerSpec(FinalNorm, parts), output]
    for spec, count in zip(specs, parts.layer_counts()):
        spec.num_params = count
    return specs


def build_pipeline_module(cfg, attn_implementation: str, stages: int, loss_fn) -> DecoderPipeline:
    """This rank's stage of the policy (or reference) model, its weights read from the model
    folder's safetensors."""
    parts = ModelParts(cfg.model.name_or_path, DTYPES[cfg.model.dtype], attn_implementation)
    specs = layer_specs(parts, cfg.rollout.temperature, cfg.grpo.logprob_chunk_size, cfg.grpo.fused_logprobs)
    # model.gradient_checkpointing: DeepSpeed's pipeline activation checkpointing, every
    # decoder layer recomputed in backward (its non-reentrant form, which also checkpoints a
    # layer whose inputs need no gradient)
    checkpointing = {}
    if cfg.model.gradient_checkpointing:
        checkpointing = dict(activation_checkpoint_interval=1, checkpointable_layers=[DecoderLayer.__name__],
                             activation_checkpoint_func=ds_checkpointing.non_reentrant_checkpoint)
    module = DecoderPipeline(layers=specs, num_stages=stages, loss_fn=loss_fn,
                             partition_method="parameters", dynamic_shape=True, **checkpointing)
    module.config = parts.config
    return module


# ---- weights out of the pipeline ----------------------------------------------------------

def gather_to_first_stage(module: DecoderPipeline, pipe_group,
                          pipe_ranks: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for the whole model on the pipeline's first-stage rank, streamed
    stage by stage: each stage sends its layers' tensors to it one at a time. Other stages
    yield nothing but must iterate to the end (they send). A tied weight is sent once."""
    stage = module.stage_id
    first = pipe_ranks[0]
    for owner_stage, owner_rank in enumerate(pipe_ranks):
        names = _local_hf_tensors(module) if stage == owner_stage else None
        box = [[(n, tuple(t.shape), t.dtype) for n, t in names] if names is not None else None]
        dist.broadcast_object_list(box, src=owner_rank, group=pipe_group)
        for i, (name, shape, dtype) in enumerate(box[0]):
            if stage == owner_stage:
                tensor = names[i][1]
                if owner_rank != first:
                    dist.send(tensor.contiguous(), dst=first)
                    continue
                yield name, tensor
            elif dist.get_rank() == first:
                buffer = torch.empty(shape, dtype=dtype)
                dist.recv(buffer, src=owner_rank)
                yield name, buffer


def _local_hf_tensors(module: DecoderPipeline) -> list[tuple[str, torch.Tensor]]:
    """This stage's parameters under their HF names, in layer order. A tied head (a function
    of the embedding, not a module, in forward_funcs) adds nothing: stage 0 sends the weight."""
    out = []
    for layer in module.forward_funcs:
        if isinstance(layer, torch.nn.Module):
            out += [(layer.hf_names[name], param.data) for name, param in layer.named_parameters()
                    if name in layer.hf_names]
    return out
