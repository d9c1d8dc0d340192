"""In-place fixes to vLLM's model objects (vllm 0.32, CPU), applied wherever vLLM loads weights
that megagrpo sends: the co-located engine (generators.py) and the workers of an engine apart
from the trainer (weight_transfer.py). docs/upstream-issues.md lists both."""
from __future__ import annotations

from typing import Iterable


def refresh_tied_lm_head(model) -> None:
    """With tied embeddings the checkpoint has no lm_head weight, so vLLM's in-place reload
    puts the head's old kernel-format copy back (on CPU a prepacked GEMM weight; vllm 0.32).
    Re-derive it from the freshly loaded, shared embedding (docs/upstream-issues.md)."""
    head = getattr(model, "lm_head", None)
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


def refresh_after_reload(model, loaded: Iterable[str] = ()) -> None:
    """What an in-place reload of the model's weights leaves stale, made new (the two below);
    loaded: the names of the weights the reload took."""
    refresh_tied_lm_head(model)
    prepack_cpu_experts(model, expert_layers(loaded))


def expert_layers(names: Iterable[str]) -> set[str]:
    """The expert layers (e.g. model.layers.3.mlp.experts) whose weights are among `names`
    (checkpoint names: ...experts.E.gate_proj.weight, or 3-D ...experts.gate_up_proj)."""
    return {name[:name.index(".experts.") + len(".experts")] for name in names if ".experts." in name}


def prepack_cpu_experts(model, layers: set[str]) -> None:
    """On CPU, vLLM runs a mixture of experts' layers on prepacked weights (its grouped-GEMM
    block layout, made once at load time). An in-place reload takes the new weights in
    checkpoint order and skips that step on every load after the first (the kernel exists
    already), so the experts computed with unpacked weights: log-probs off by 0.17 on the tiny
    Qwen3-MoE after a reload of unchanged weights (vllm 0.32; docs/upstream-issues.md). Prepack
    again, in place, the `layers` that were reloaded only: a sync of some layers (a LoRA
    policy's) leaves the others packed. (With the padded width the kernel needs, a reload is
    refused.)"""
    if not layers:
        return  # a dense model, or a sync that left the experts as they were
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a build without the CPU experts
        return
    for name, layer in model.named_modules():
        if not any(name == layer_name or name.startswith(layer_name + ".") for layer_name in layers):
            continue  # not reloaded (vLLM's module: model.layers.N.mlp.experts.routed_experts)
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if type(experts) is not CPUUnquantizedExperts or experts._use_zentorch:
            continue
        if experts._padded_intermediate_size(experts.moe_config) != experts.moe_config.intermediate_size_per_partition:
            raise NotImplementedError("vLLM's CPU experts pad their width to a multiple of 32: an in-place reload of "
                                      "them is not supported here; give the experts a width divisible by 32")
        for weight in (layer.w13_weight, layer.w2_weight):
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))


def skip_input_embedding_prepack(model) -> None:
    """On CPU, vLLM prepares every vocabulary-sized embedding for a matmul when its weights load
    (`process_weights_after_loading`: a oneDNN prepacked copy of the whole [vocab, hidden]
    matrix), the input embedding too, which only looks rows up and never uses it. An in-place
    sync reloads it, so every sync paid that again (0.48 s of a 2.8 s sync on 2 ranks at the
    Qwen2.5-0.5B shape cut to 4 layers; bench/weight_sync.py), and the copy stayed in memory.
    Where the model has an LM head of its own (tied or not, it keeps its prepack), the input
    embeddings skip theirs."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    class LookupOnly(UnquantizedEmbeddingMethod):
        def process_weights_after_loading(self, layer) -> None:
            pass

    if not isinstance(getattr(model, "lm_head", None), ParallelLMHead):
        return  # a model whose logits come from its input embedding (e.g. Gemma) needs the prepack
    for layer in model.modules():
        if (isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead)
                and type(layer.quant_method) is UnquantizedEmbeddingMethod):
            layer.quant_method = LookupOnly()
            if hasattr(layer, "cpu_linear"):
                del layer.cpu_linear  # the prepacked copy made at load time
