"""Build a tiny model (Qwen2 architecture unless --arch says otherwise) and a byte-level BPE
tokenizer, locally, no downloads.

    python tools/make_tiny_model.py --out runs/tiny/model --corpus runs/tiny/data/sft.jsonl
    python tools/make_tiny_model.py --arch llama --heads 4 --kv-heads 2 --hidden-size 256 --out runs/llama
    python tools/make_tiny_model.py --shape qwen2.5-0.5b --out runs/q05 --corpus runs/tiny/data/sft.jsonl
    python tools/make_tiny_model.py --shape qwen2.5-0.5b --layers 2 --out runs/q05-2l   # CI-sized, real vocab

--shape gives a real model's exact configuration (sizes, heads, 151,936-token vocabulary, tied
embeddings, rope theta) with random weights; any flag given as well overrides its value. Its
tokenizer has exactly vocab_size tokens: the BPE trained on the corpus, then padded with merges
of existing tokens (so the vocabulary is real BPE, and every id can be sampled and decoded).

The tokenizer is trained on the strings of the corpus JSONL files (nested ones included, plus
printable ASCII, so that any text encodes) and carries a ChatML chat template that also renders
tools and tool results (Qwen2.5's layout, shortened); <|im_end|> is the EOS token. --tool-tokens
adds <tool_call>, </tool_call>, <tool_response> and </tool_response> as single tokens (the
agentic quickstart's model).
--arch picks the architecture: qwen2 (the default), qwen3 (per-head q/k RMSNorm, no attention
bias, head_dim set apart from the hidden size), llama (Llama 3: llama3 rope scaling, theta 500k,
an untied head), mistral (an untied head, a 4,096-token sliding window) and idefics3
(SmolVLM's vision-language architecture: a SigLIP image encoder and a tied Llama language
model, with the processor and image tokens; tools/tiny_vision.py), and two mixtures of experts:
qwen3_moe (Qwen3-MoE: --experts experts of --moe-intermediate-size in every layer, top
--experts-per-token, normalised top-k weights, a tied head) and mixtral (Mixtral: experts of
--intermediate-size, an untied head). --tie-embeddings overrides
the architecture's choice; --kv-heads below --heads gives grouped-query attention.
The model is randomly initialised with transformers' own init (std 0.02) and saved as
safetensors; head_dim is 64 (vLLM's CPU attention refuses smaller heads).
"""
import argparse
import json
import os
import string
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_vision import add_image_tokens, idefics3_config, save_processor

from megagrpo.console import on_terminal, quiet_console
from megagrpo.multimodal.models import auto_model_class_of
from megagrpo.process_exit import exit_without_teardown

# ChatML. With tools, a system block lists them in one line (name(arguments)), and `tool`
# messages go back as a user turn of <tool_response> blocks, as Qwen2.5's template does; without
# tools the rendering is plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "Tools:{% for tool in tools %} {{ tool['function']['name'] }}("
    "{{ tool['function']['parameters']['properties'] | list | join(', ') }}){% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The published configurations (config.json of Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-1.5B).
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864,
                         vocab_size=151936, max_positions=32768, tie_embeddings=True, rope_theta=1e6),
    "qwen2.5-1.5b": dict(hidden_size=1536, layers=28, heads=12, kv_heads=2, intermediate_size=8960,
                         vocab_size=151936, max_positions=32768, tie_embeddings=True, rope_theta=1e6),
}


# each architecture's config class, what differs from the shared sizes, and whether its head is tied
ARCHS = {
    "qwen2": (Qwen2Config, {}, True),
    "qwen3": (Qwen3Config, {"attention_bias": False}, True),
    "llama": (LlamaConfig, {"attention_bias": False, "mlp_bias": False}, False),
    "mistral": (MistralConfig, {"sliding_window": 4096}, False),
    "idefics3": (LlamaConfig, {"attention_bias": False, "mlp_bias": False}, True),  # the language model's
    "qwen3_moe": (Qwen3MoeConfig, {"attention_bias": False, "norm_topk_prob": True}, True),
    "mixtral": (MixtralConfig, {"sliding_window": None}, False),
}


def expert_settings(args) -> dict:
    """A mixture-of-experts architecture's expert sizes (qwen3_moe: every layer sparse,
    experts of --moe-intermediate-size; mixtral: experts of --intermediate-size)."""
    if args.arch == "qwen3_moe":
        return {"num_experts": args.experts, "num_experts_per_tok": args.experts_per_token,
                "moe_intermediate_size": args.moe_intermediate_size, "decoder_sparse_step": 1}
    if args.arch == "mixtral":
        return {"num_local_experts": args.experts, "num_experts_per_tok": args.experts_per_token}
    return {}


def model_config(args, **ids):
    """The --arch configuration at the requested sizes (ids: the tokenizer's special ids)."""
    config_class, extra, tied = ARCHS[args.arch]
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.arch == "llama":  # Llama 3.1's scaling of the low frequencies
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    tie = tied if args.tie_embeddings is None else args.tie_embeddings
    return config_class(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                        head_dim=args.hidden_size // args.heads, intermediate_size=args.intermediate_size,
                        max_position_embeddings=args.max_positions, tie_word_embeddings=tie,
                        rope_parameters=rope, torch_dtype=args.dtype, **extra, **expert_settings(args), **ids)


def corpus_texts(paths: list[str]):
    yield string.printable
    for role in ("system", "user", "assistant"):
        yield f"{role}\n"
    for path in paths:
        with open(path) as f:
            for line in f:
                yield from _strings(json.loads(line))


def _strings(value):
    """Every string in a JSON value (messages lists and nested objects included)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # as Qwen2.5 has them


def build_tokenizer(paths: list[str], vocab_size: int, pad_to_size: bool = False,
                    tool_tokens: bool = False) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=on_terminal())  # off one: blank lines
    tok.train_from_iterator(corpus_texts(paths), trainer=trainer)
    if pad_to_size:
        tok = pad_vocabulary(tok, vocab_size)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None,
                                   additional_special_tokens=["<|im_start|>"])
    if tool_tokens:  # added tokens that are not special: they stay in decoded text
        fast.add_tokens(TOOL_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def pad_vocabulary(tok: Tokenizer, size: int) -> Tokenizer:
    """The trained byte-level BPE grown to exactly `size` tokens: new tokens are merges of two
    existing ones (a + b), added after the trained merges, in a fixed order."""
    state = json.loads(tok.to_str())
    vocab, merges = state["model"]["vocab"], state["model"]["merges"]
    specials = {t["content"] for t in state["added_tokens"]}
    pieces = [piece for piece, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if piece not in specials]
    missing = size - len(vocab)
    for a in pieces:
        for b in pieces:
            if missing <= 0:
                break
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append([a, b])
                missing -= 1
        if missing <= 0:
            break
    if missing > 0:
        raise SystemExit(f"cannot pad the vocabulary to {size}: only {len(vocab)} tokens reachable")
    return Tokenizer.from_str(json.dumps(state))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="output model folder")
    p.add_argument("--corpus", nargs="*", default=[], help="JSONL files to train the tokenizer on")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2, help="attention heads (head_dim = hidden/heads)")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=384)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--arch", choices=sorted(ARCHS), default="qwen2", help="the model's architecture")
    p.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="tie the head to the embedding (default: as the architecture's small models do: "
                        "qwen2, qwen3 and qwen3_moe tied, llama, mistral and mixtral not)")
    p.add_argument("--rope-theta", type=float, default=10000.0, help="(llama: its own 500k, llama3-scaled)")
    p.add_argument("--shape", choices=sorted(SHAPES),
                   help="a real model's exact configuration (other flags override its values)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="saved weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tool-tokens", action="store_true",
                   help="add the tool-call markup (<tool_call>, <tool_response> and their ends) as single "
                        "tokens, as Qwen2.5's tokenizer has them")
    p.add_argument("--image-size", type=int, default=96, help="(idefics3) image side the encoder takes")
    p.add_argument("--patch-size", type=int, default=16, help="(idefics3) the encoder's patch side")
    p.add_argument("--vision-hidden-size", type=int, default=128, help="(idefics3) encoder width (64 per head)")
    p.add_argument("--vision-layers", type=int, default=2, help="(idefics3) encoder layers")
    p.add_argument("--experts", type=int, default=8, help="(qwen3_moe, mixtral) experts per layer")
    p.add_argument("--experts-per-token", type=int, default=2, help="(qwen3_moe, mixtral) top-k experts")
    p.add_argument("--moe-intermediate-size", type=int, default=128, help="(qwen3_moe) each expert's width")
    p.add_argument("--config-only", action="store_true",
                   help="write config.json only (no weights, no tokenizer): enough for `megagrpo plan`")
    shape = p.parse_known_args(argv)[0].shape
    if shape:
        p.set_defaults(**SHAPES[shape])
    args = p.parse_args(argv)
    quiet_console()  # no progress bars (transformers' `Writing model shards`) off a terminal

    torch.manual_seed(args.seed)
    kind = "Idefics3" if args.arch == "idefics3" else ARCHS[args.arch][0].__name__.removesuffix("Config")
    name = f"{shape or 'tiny'} {kind}"
    if args.config_only:
        model_config(args).save_pretrained(args.out)
        print(f"{name} config (no weights) -> {args.out}")
        return
    tokenizer = build_tokenizer(args.corpus, args.vocab_size, pad_to_size=shape is not None,
                                tool_tokens=args.tool_tokens)
    vision = args.arch == "idefics3"
    if vision:
        add_image_tokens(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    args.vocab_size = len(tokenizer)
    config = model_config(args, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    if vision:
        config = idefics3_config(args, config, tokenizer)
    model = auto_model_class_of(config).from_config(config).to(getattr(torch, args.dtype))
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    if vision:
        save_processor(args, tokenizer, args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{name}: {n / 1e6:.2f}M parameters, vocab {len(tokenizer)}, "
          f"head_dim {args.hidden_size // args.heads} -> {args.out}")


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
