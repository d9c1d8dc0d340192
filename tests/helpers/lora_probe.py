"""Probe for test_policy_lora.py: a LoRA policy before and over 3 training steps. Writes
lora_rank<r>.json to output_dir with, for one fixed completion:
  base / policy_init / reference_init: log-probs under the base model loaded by transformers
      alone, the policy at initialisation (B = 0), and its reference (adapters disabled);
  per step: the trainer's (adapters on) and vLLM's log-probs after the sync that moves the
      adapted layers only, and vLLM's after a full sync of every weight;
  base weights and adapters, whole, before and after (their max change);
then saves a checkpoint, exports output_dir/hf and output_dir/adapter, and writes the live
policy's logits of prompt + completion (live_logits.pt) for the exports to be held to.

    deepspeed --num_gpus 2 tests/helpers/lora_probe.py --config X.yaml model.lora.r=8 ...
"""
import json
import os

import torch
from transformers import AutoModelForCausalLM

from megagrpo.cluster.distributed import init_distributed
from megagrpo.cluster.generator_layout import generator_layout
from megagrpo.dtypes import DTYPES
from megagrpo.policy.batch import Completion, make_batch
from megagrpo.policy.logprobs import completion_logprobs, install_logprob_head
from megagrpo.process_exit import exit_without_teardown
from megagrpo.rollout.weight_sync import sync_weights
from megagrpo.train import Trainer, parse_args
from megagrpo.validation import load_config

COMPLETION_TEXT = "3 + 4 = 7. Answer: 7"


def whole_parameters(module, trained: bool) -> dict:
    """Whole copies of the trained (or the frozen) parameters (collective under ZeRO-3)."""
    import deepspeed
    out = {}
    for name, param in module.named_parameters():
        if param.requires_grad == trained:
            with deepspeed.zero.GatheredParameters([param]) if hasattr(param, "ds_id") else torch.no_grad():
                out[name] = param.data.detach().clone()
    return out


def optimizer_state_numel(optimizer) -> int:
    """Elements of Adam's first moments on this rank (the torch optimizer inside DeepSpeed's)."""
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return sum(state["exp_avg"].numel() for state in optimizer.state.values() if "exp_avg" in state)


def main():
    args = parse_args()
    cfg = load_config(args.config, args.overrides)
    topology = init_distributed(tp_size=cfg.parallel.tensor_parallel_size,
                                generator_tp=generator_layout(cfg).ranks_per_group)
    trainer = Trainer(cfg, topology)
    policy = trainer.policy.engine
    prompt = trainer.prompts[0].token_ids
    completion = trainer.tokenizer(COMPLETION_TEXT, add_special_tokens=False)["input_ids"]
    completion.append(trainer.tokenizer.eos_token_id)
    batch = make_batch([prompt], [Completion(completion, [0.0] * len(completion), False)],
                       torch.zeros(1), trainer.tokenizer.pad_token_id)

    def trainer_logprobs(reference=False):
        return trainer.policy.logprobs(batch, [[0]], reference=reference)[0].tolist()

    base = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, dtype=DTYPES[cfg.model.dtype]).eval()
    install_logprob_head(base, cfg.grpo.logprob_chunk_size)
    with torch.no_grad():
        base_logp = completion_logprobs(base, batch, cfg.rollout.temperature)[0][0].tolist()
    frozen_before = whole_parameters(policy.module, trained=False)
    adapters_before = whole_parameters(policy.module, trained=True)
    result = {"completion": completion, "base": base_logp, "policy_init": trainer_logprobs(),
              "reference_init": trainer_logprobs(reference=True), "steps": [],
              "trained_names": sorted(adapters_before), "frozen_count": len(frozen_before),
              "optimizer_state_numel": optimizer_state_numel(policy.optimizer),
              "trained_numel": sum(t.numel() for t in adapters_before.values()),
              "frozen_numel": sum(t.numel() for t in frozen_before.values())}
    trainer.sync_generator_weights(trainer.step)  # the first sync: every weight
    for _ in range(3):
        metrics = trainer.train_step()  # ends with the sync of the adapted layers only
        trainer.step += 1
        row = {"grad_norm": metrics["grad_norm"], "trainer": trainer_logprobs(),
               "engine": trainer.stack.generator.logprobs([(prompt + completion, len(prompt))])[0],
               "reference": trainer_logprobs(reference=True),
               "sent_changed_only": sorted(n for n, _ in trainer.policy.full_tensors(changed_only=True))}
        sync_weights(trainer.policy.full_tensors(), trainer.stack.generator)
        row["engine_full_sync"] = trainer.stack.generator.logprobs([(prompt + completion, len(prompt))])[0]
        result["steps"].append(row)
    result["sent_full"] = sorted(n for n, _ in trainer.policy.full_tensors())
    frozen_after = whole_parameters(policy.module, trained=False)
    adapters_after = whole_parameters(policy.module, trained=True)
    result["optimizer_state_numel"] = optimizer_state_numel(policy.optimizer)
    result["frozen_max_change"] = max(float((frozen_after[n] - t).abs().max()) for n, t in frozen_before.items())
    result["frozen_bit_identical"] = all(torch.equal(frozen_after[n], t) for n, t in frozen_before.items())
    result["adapter_max_change"] = {n: float((adapters_after[n] - t).abs().max()) for n, t in adapters_before.items()}
    result["lora_B_zero_at_init"] = all(float(t.abs().max()) == 0 for n, t in adapters_before.items() if "lora_B" in n)
    import peft
    result["is_lora"] = isinstance(policy.module, peft.PeftModel)
    trainer.save()
    trainer.export()
    policy.eval()
    with torch.no_grad():
        live = policy(input_ids=torch.tensor([prompt + completion])).logits
    if topology.is_main:
        torch.save(live, os.path.join(cfg.output_dir, "live_logits.pt"))
    result["sequence"] = prompt + completion
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, f"lora_rank{topology.rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # the interpreter's teardown costs seconds a rank
