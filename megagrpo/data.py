"""Prompt data: loading with `datasets`, chat-template rendering, the prompts' resumable distributed order.

Rows are {"prompt": str, "system_prompt"?: str, ...} or {"messages": [...], ...}; every other
field travels with the prompt to the reward functions (e.g. a reference "answer"). For a
vision-language model, rows may carry images (multimodal/images.py) and the model's processor
renders them (multimodal/processor.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from megagrpo.cluster.distributed import all_gather_1d
from megagrpo.console import launch_rank


class DataError(ValueError):
    """Bad input data; the message names the file and the line or row."""


@dataclass
class Prompt:
    prompt: object               # the user's prompt text, or the messages list
    token_ids: list[int]         # chat-template-rendered prompt, tokenized
    fields: dict = field(default_factory=dict)  # every other row field, for the rewards
    messages: list = field(default_factory=list)  # the prompt as chat messages (system, user, ...)
    vision: Optional[object] = None  # multimodal.processor.VisionPrompt: its images, for a VLM


_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def _check_jsonl(path: str) -> list[int]:
    """datasets' JSON errors name neither line nor cause: check each line first. Returns the
    line number of each row."""
    numbers = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: malformed JSON ({e.msg} at column {e.colno}); "
                                "each line must be one JSON object") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            numbers.append(number)
    return numbers


def load_rows(path: str, split: str = "train") -> tuple[list[dict], list[str]]:
    """Local JSONL/JSON/Parquet/CSV file, or a hub dataset name. Returns the rows and, for
    each, where it came from ("file:line" for JSONL, "file: row N" otherwise)."""
    import datasets

    ext = os.path.splitext(path)[1].lower()
    if os.path.isfile(path):
        if ext not in _LOADERS:
            raise DataError(f"{path}: unknown data format '{ext}'; use .jsonl, .json, .parquet or .csv")
        lines = _check_jsonl(path) if ext == ".jsonl" else None
        if os.path.getsize(path) == 0 or lines == []:
            raise DataError(f"{path}: the file is empty (no rows); point the data setting at a file with "
                            "one prompt per row, e.g. one JSON object per line with a 'prompt' field")
        ds = datasets.load_dataset(_LOADERS[ext], data_files=path, split="train")
    else:
        lines, ds = None, datasets.load_dataset(path, split=split)
    # datasets unifies the schema: a field missing from a row comes back as None
    rows = [{k: v for k, v in row.items() if v is not None} for row in ds]
    where = [f"{path}:{n}" for n in lines] if lines else [f"{path}: row {i + 1}" for i in range(len(rows))]
    return rows, where


CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles chat templates render (transformers' convention); any other is refused by name."""


def _row_messages(row: dict, where: str, prompt_field: str, system_prompt) -> tuple[object, list]:
    if "messages" in row and row["messages"] is not None:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise DataError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        for i, m in enumerate(messages):
            if m["role"] not in CHAT_ROLES:
                raise DataError(f"{where}: message {i + 1} has role {m['role']!r}, which chat templates do not "
                                f"know; use one of {', '.join(CHAT_ROLES)}")
        return messages, messages
    if prompt_field not in row or not isinstance(row[prompt_field], str):
        raise DataError(f"{where}: missing string field '{prompt_field}' (or 'messages'); "
                        f"row keys: {sorted(row)}; set data.prompt_field if it is named otherwise")
    system = row.get("system_prompt") or system_prompt
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": row[prompt_field]}]
    return row[prompt_field], messages


def load_prompts(path: str, tokenizer, max_prompt_length: int, prompt_field: str = "prompt",
                 system_prompt=None, split: str = "train", tools=None, processor=None,
                 images_cfg=None) -> tuple[list[Prompt], int]:
    """Render and tokenize every row (with the tools' JSON schemas, when given, for the chat
    template to show); processor: a vision-language model's, which renders rows with images
    (images_cfg: the `images` config section). Returns (prompts, number dropped: longer than
    max_prompt_length, or with a bad image under images.on_bad_image=drop)."""
    from megagrpo.multimodal.images import ImageError, row_has_images, row_images
    from megagrpo.multimodal.processor import encode_prompt

    rows, places = load_rows(path, split)
    if not rows:
        raise DataError(f"{path}: no rows")
    prompts, dropped, bad_images = [], 0, []
    for row, where in zip(rows, places):
        prompt, messages = _row_messages(row, where, prompt_field, system_prompt)
        extra = {"tools": tools} if tools else {}
        vision = None
        if images_cfg is not None and row_has_images(row, images_cfg.field):
            if processor is None:
                raise DataError(f"{where}: the row has images, but the model takes none (its config.json has "
                                "no vision_config); use a vision-language model or drop the images")
            try:
                messages, images = row_images(row, messages, where, os.path.dirname(os.path.abspath(path)),
                                              images_cfg)
            except ImageError as e:
                if images_cfg.on_bad_image == "refuse":
                    raise DataError(str(e)) from None
                bad_images.append(str(e))
                continue
            ids, vision = encode_prompt(processor, messages, images, tools)
        else:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_length:
            dropped += 1
            continue
        fields = {k: v for k, v in row.items()
                  if k not in (prompt_field, "messages", "system_prompt", getattr(images_cfg, "field", None))}
        prompts.append(Prompt(prompt=prompt, token_ids=ids, fields=fields, messages=messages, vision=vision))
    if bad_images and launch_rank() == 0:  # every rank loads the same rows
        print(f"[megagrpo] {path}: {len(bad_images)} rows dropped for a bad image (images.on_bad_image=drop); "
              f"the first: {bad_images[0]}", flush=True)
    if not prompts and bad_images:
        raise DataError(f"{path}: none of its {len(rows)} prompts is usable: {dropped} longer than "
                        f"data.max_prompt_length={max_prompt_length} tokens, {len(bad_images)} with a bad image")
    if not prompts:
        raise DataError(f"{path}: all {len(rows)} prompts are longer than data.max_prompt_length="
                        f"{max_prompt_length} tokens; raise it")
    return prompts, dropped + len(bad_images)


class PromptOrder:
    """Seeded, resumable, distributed: each step the dp ranks take disjoint slices of one global
    batch of prompts; each epoch is a fresh permutation. State is (epoch, position)."""

    def __init__(self, num_prompts: int, prompts_per_rank: int, dp_rank: int, dp_size: int,
                 seed: int, shuffle: bool = True):
        self.num_prompts, self.prompts_per_rank = num_prompts, prompts_per_rank
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.prompts_per_step = prompts_per_rank * dp_size
        self.steps_per_epoch = num_prompts // self.prompts_per_step
        if self.steps_per_epoch == 0:
            raise DataError(f"{num_prompts} prompts cannot fill one step of {self.prompts_per_step} "
                            f"prompts ({prompts_per_rank} per rank x {dp_size} ranks); add data or "
                            "lower the batch size")
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_prompts))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_prompts, generator=gen).tolist()

    def next_indices(self) -> list[int]:
        """This rank's prompt indices for the next step; advances the state."""
        if self.position >= self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.prompts_per_step + self.dp_rank * self.prompts_per_rank
        self.position += 1
        return self._order(self.epoch)[start:start + self.prompts_per_rank]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]


def record_prompts(output_dir: str, step: int, indices: list[int], sampling_round: int, topology) -> None:
    """Collective over dp: append a step's prompt indices (all dp ranks) to
    output_dir/prompts_seen.jsonl, so that a resumed run can be checked for skipped or repeated
    data (with the round of dynamic sampling after the first)."""
    everything = all_gather_1d(torch.tensor(indices, dtype=torch.long), topology.dp_group).tolist()
    if topology.is_main:
        row = {"step": step, **({"round": sampling_round} if sampling_round else {}), "prompts": everything}
        with open(os.path.join(output_dir, "prompts_seen.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
