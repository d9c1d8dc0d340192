"""Optional warm start: a short supervised pass over {"prompt", "completion"} rows, or
multi-turn {"prompt", "turns": [assistant, tool, ..., assistant]} rows (with --tools).

    python tools/warm_start.py --model runs/tiny/model --data runs/tiny/data/sft.jsonl \
        --out runs/tiny/warm --steps 600
    python tools/warm_start.py --tools python --model runs/agent/model --data runs/agent/data/sft.jsonl \
        --out runs/agent/warm

The loss covers the assistant's tokens and their EOS only; the prompt is rendered with the
tokenizer's chat template exactly as the GRPO trainer renders it (with the tools' schemas),
and tool messages are tokenised exactly as the multi-turn rollout inserts them
(megagrpo.rollout.agent.ToolMessageRenderer), outside the loss. One process, plain PyTorch
AdamW. This is a separate, documented step of the quickstart: it gives the tiny model a policy
that GRPO can improve within minutes on 2 CPU cores.

A vision-language model's rows may carry images (an `images` field, paths relative to the data
file): its processor renders them as the GRPO trainer does (megagrpo/multimodal), and the whole
model, image encoder included, trains.
"""
import argparse
import json
import os
import random
import sys
import time

import torch
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megagrpo.config.schema import ImagesConfig
from megagrpo.console import quiet_console
from megagrpo.multimodal.images import row_images
from megagrpo.multimodal.models import auto_model_class, is_vision_language
from megagrpo.multimodal.processor import encode_prompt, join_image_tensors, load_processor
from megagrpo.process_exit import exit_without_teardown
from megagrpo.rollout.agent import ToolMessageRenderer
from megagrpo.rollout.tools import PYTHON_SCHEMA


def encode(tokenizer, row: dict, tools=None, renderer=None, processor=None, base_dir="") -> tuple:
    """(input ids, labels, the prompt's VisionPrompt or None)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    vision = None
    if processor is not None and row.get("images"):
        messages, images = row_images(row, messages, "warm start row", base_dir, ImagesConfig())
        ids, vision = encode_prompt(processor, messages, images, tools)
    else:
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                               **({"tools": tools} if tools else {}))
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    labels = [-100] * len(ids)
    turns = row["turns"] if "turns" in row else [{"role": "assistant", "content": row["completion"]}]
    pending_tools = []
    for turn in turns + [None]:
        if turn is not None and turn["role"] == "tool":
            pending_tools.append(turn)
            continue
        if pending_tools:
            tool_ids, _ = renderer.render(pending_tools, model_ended_with_eos=True)
            ids, labels, pending_tools = ids + tool_ids, labels + [-100] * len(tool_ids), []
        if turn is not None:
            turn_ids = tokenizer(turn["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids, labels = ids + turn_ids, labels + turn_ids
    return ids, labels, vision


def similar_lengths(batch: list, parts: int) -> list[list]:
    """The batch sorted by length and cut into `parts` micro-batches of (nearly) equal counts
    (one part: the batch as sampled)."""
    if parts == 1:
        return [batch]
    ordered = sorted(batch, key=lambda example: len(example[0]))
    size = -(-len(ordered) // parts)
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


def pad(part: list, pad_id: int, model) -> dict:
    """input_ids, attention_mask and labels of a micro-batch, right-padded to its longest row,
    and the rows' image tensors (a vision-language model)."""
    width = max(len(ids) for ids, _, _ in part)
    images = join_image_tensors([vision for _, _, vision in part], model.config.model_type, model.dtype, "cpu")
    return {"input_ids": torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _, _ in part]),
            "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _, _ in part]),
            "labels": torch.tensor([labels + [-100] * (width - len(labels)) for _, labels, _ in part]), **images}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="HF model folder to start from")
    p.add_argument("--data", required=True, help="JSONL with prompt and completion fields")
    p.add_argument("--out", required=True, help="output HF model folder")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=1,
                   help="cut each batch into this many micro-batches of rows of similar length, each "
                        "padded to its longest: less padding where lengths vary (multi-turn rows: "
                        "2 took 2/3 of the time); 1 (default): the batch as sampled")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tools", nargs="*", default=[], choices=["python"],
                   help="tools whose schemas the prompts show (as rollout.tools does)")
    p.add_argument("--max-tool-response-tokens", type=int, default=256,
                   help="as rollout.max_tool_response_tokens")
    args = p.parse_args(argv)
    if args.micro_batches < 1:
        p.error(f"--micro-batches {args.micro_batches}: give 1 or more")
    quiet_console()  # no progress bars (transformers' `Loading weights`, `Writing model shards`) off a terminal

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = auto_model_class(args.model).from_pretrained(args.model, dtype=torch.float32)
    processor = load_processor(args.model) if is_vision_language(args.model) else None
    base_dir = os.path.dirname(os.path.abspath(args.data))
    with open(args.data) as f:
        tools = [PYTHON_SCHEMA] if "python" in args.tools else None
        renderer = ToolMessageRenderer(tokenizer, args.max_tool_response_tokens)
        examples = [encode(tokenizer, json.loads(line), tools, renderer, processor, base_dir)
                    for line in f if line.strip()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / args.steps))
    start = time.time()
    model.train()
    for step in range(args.steps):
        batch = rng.sample(examples, min(args.batch_size, len(examples)))
        # the token mean over the whole batch; in micro-batches of similar lengths, their sum
        # (less padding: the same gradient up to rounding, in 2/3 of the time on multi-turn rows)
        mean = {} if args.micro_batches == 1 else {  # one batch: the model's own token mean
            "num_items_in_batch": sum(sum(label != -100 for label in labels[1:]) for _, labels, _ in batch)}
        loss = 0.0
        for part in similar_lengths(batch, args.micro_batches):
            part_loss = model(**pad(part, tokenizer.pad_token_id, model), **mean).loss
            part_loss.backward()
            loss += part_loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"warm start step {step:4d}/{args.steps} loss {loss:.4f} "
                  f"({time.time() - start:.0f}s)", flush=True)
    model.save_pretrained(args.out, safe_serialization=True)
    (processor or tokenizer).save_pretrained(args.out)
    print(f"warm-started model -> {args.out}")


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
