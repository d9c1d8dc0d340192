"""A reward model as a reward: an HF AutoModelForSequenceClassification (one output) scoring
prompt + completion, run inside the training processes.

    rewards:
      functions:
        - {name: reward_model, weight: 0.5, args: {path: runs/rm, batch_size: 16}}
        - {name: answer_match, weight: 1.0}

Under a ZeRO-3 policy the reward model is a ZeRO-3 inference engine (parameters partitioned
across the ranks as they load, no optimizer state), like the frozen reference; otherwise a
plain eval module on this rank's device. Completions are scored in batches of `batch_size`;
under ZeRO-3 every rank runs the same number of forward passes (a rank with fewer batches
runs one-token dummies), since each forward gathers parameters collectively.

A completion is cut at CHARS_PER_TOKEN x max_length characters before it is tokenized (the
tokens past max_length are dropped anyway), and text UTF-8 cannot encode (lone surrogates)
is replaced, so that no completion can make tokenizing slow or fail.
"""
from __future__ import annotations

import math

import torch

# Characters of a completion kept per token of max_length: tokens average 3-5 characters.
CHARS_PER_TOKEN = 32


class RewardModel:
    def __init__(self, config=None, path: str = "", batch_size: int = 8, max_length: int = 2048,
                 use_chat_template: bool = True):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not path:
            raise ValueError("reward_model needs args.path: an HF sequence-classification model folder")
        self.batch_size, self.max_length = batch_size, max_length
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.use_chat_template = use_chat_template and bool(getattr(self.tokenizer, "chat_template", None))
        dtype = torch.float32
        ds_config, stage = None, 0
        if config is not None:
            from megagrpo.dtypes import DTYPES
            from megagrpo.policy.models import DeepSpeedSettings
            dtype = DTYPES[config.model.dtype]
            settings = DeepSpeedSettings.from_config(config)
            ds_config, stage = settings.config, settings.zero_stage
        self.collective = stage == 3 and torch.distributed.is_initialized()
        if self.collective:
            import deepspeed
            from transformers.integrations import HfDeepSpeedConfig

            rm_config = {k: ds_config[k] for k in ("train_micro_batch_size_per_gpu",
                                                   "gradient_accumulation_steps", "bf16", "steps_per_print")}
            rm_config["zero_optimization"] = {"stage": 3}
            if config.model.ref_offload:
                rm_config["zero_optimization"]["offload_param"] = {"device": "cpu"}
            dschf = HfDeepSpeedConfig(rm_config)  # noqa: F841 - partition while loading
            model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
            self._fix_pad(model)
            model = model.eval().requires_grad_(False)
            self.model, _, _, _ = deepspeed.initialize(model=model, config=rm_config)
            self.model.eval()
            self.device = self.model.device
        else:
            from deepspeed.accelerator import get_accelerator
            model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
            self._fix_pad(model)
            self.device = torch.device(get_accelerator().current_device_name())
            self.model = model.eval().requires_grad_(False).to(self.device)

    def _fix_pad(self, model) -> None:
        if model.config.num_labels != 1:
            raise ValueError(f"reward_model: the model has {model.config.num_labels} labels; a reward "
                             "model has one output (num_labels=1)")
        if model.config.pad_token_id is None:  # needed to find each row's last token
            model.config.pad_token_id = self.tokenizer.pad_token_id

    def render(self, prompt, completion: str) -> str:
        """Prompt + completion as the reward model reads them (its chat template when it has one),
        the completion cut at CHARS_PER_TOKEN x max_length characters, lone surrogates as '?'."""
        completion = completion[:CHARS_PER_TOKEN * self.max_length]
        if self.use_chat_template:
            messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
            text = self.tokenizer.apply_chat_template(
                messages + [{"role": "assistant", "content": completion}], tokenize=False)
        else:
            text = prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)
            text = text + completion
        return text.encode("utf-8", "replace").decode("utf-8")

    @torch.no_grad()
    def __call__(self, prompts, completions, **_) -> list[float]:
        texts = [self.render(p, c) for p, c in zip(prompts, completions)]
        batches = [texts[i:i + self.batch_size] for i in range(0, len(texts), self.batch_size)]
        count = len(batches)
        if self.collective:  # every rank must run as many (collective) forwards
            from megagrpo.cluster.distributed import all_reduce
            count = int(all_reduce(torch.tensor([len(batches)]), "max")[0])
        scores = []
        for b in range(count):
            batch = batches[b] if b < len(batches) else None
            if batch is None:
                ids = torch.tensor([[self.tokenizer.pad_token_id]], device=self.device)
                self.model(input_ids=ids, attention_mask=torch.ones_like(ids))
                continue
            enc = self.tokenizer(batch, return_tensors="pt", padding=True, truncation=True,
                                 max_length=self.max_length, add_special_tokens=False)
            logits = self.model(input_ids=enc["input_ids"].to(self.device),
                                attention_mask=enc["attention_mask"].to(self.device)).logits
            scores.extend(float(v) for v in logits[:, 0].float().cpu())
        finite = [s for s in scores if math.isfinite(s)]
        if scores and not finite:
            raise ValueError("reward_model produced no finite score in the batch: is the model broken?")
        # a completion that drives the model to inf/NaN scores as the batch's lowest
        lowest = min(finite, default=0.0)
        return [s if math.isfinite(s) else lowest for s in scores]
