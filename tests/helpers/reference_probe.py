"""Probe for test_algorithm_objectives.py: GRPO steps with a moving reference (grpo.sync_ref_model),
the policy's and the reference's whole weights after each step (gathered out of ZeRO-3 here,
for the check; the mix itself gathers nothing). Writes reference_probe.pt to output_dir on rank 0.

    deepspeed --num_gpus 2 tests/helpers/reference_probe.py --config X.yaml key=value ...
"""
import os

import deepspeed
import torch

from megagrpo.cluster.distributed import init_distributed
from megagrpo.process_exit import exit_without_teardown
from megagrpo.train import Trainer, parse_args
from megagrpo.validation import load_config


def whole(module) -> dict:
    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().clone().cpu() for name, p in params.items()}


def main():
    args = parse_args()
    cfg = load_config(args.config, args.overrides)
    topology = init_distributed()
    trainer = Trainer(cfg, topology)
    trainer.sync_generator_weights(trainer.step)
    records = [{"policy": whole(trainer.policy.engine.module), "reference": whole(trainer.policy.reference.module)}]
    for _ in range(3):
        trainer.train_step()
        trainer.step += 1
        records.append({"policy": whole(trainer.policy.engine.module),
                        "reference": whole(trainer.policy.reference.module)})
    if topology.is_main:
        os.makedirs(cfg.output_dir, exist_ok=True)
        torch.save(records, os.path.join(cfg.output_dir, "reference_probe.pt"))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # the interpreter's teardown costs seconds a rank
