"""One process, one pipeline stage holding the whole tiny model: the same forward and backward
with and without model.gradient_checkpointing. Prints JSON: how many times DeepSpeed's
activation checkpoint function ran, which layers it covers, and the largest output and
gradient differences.

    python tests/helpers/pipeline_checkpointing_probe.py MODEL DATA_FILE
"""
import argparse
import json
import os

import deepspeed
import torch

from megagrpo.cluster.topology import Topology
from megagrpo.policy.pipeline_module import build_pipeline_module
from megagrpo.process_exit import exit_without_teardown
from megagrpo.validation import load_config


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("data")
    args = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed("gloo")
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 400, (1, 12), generator=generator)
    inputs = (input_ids, torch.arange(12)[None], torch.arange(11), input_ids[0, 1:])
    results, calls = {}, []
    for checkpointing in (False, True):
        cfg = load_config("configs/tiny_arith.yaml", [
            f"model.name_or_path={args.model}", f"data.train_file={args.data}", "data.eval_file=null",
            "deepspeed=configs/ds_zero0.json", "model.dtype=float32",
            f"model.gradient_checkpointing={str(checkpointing).lower()}"])
        module = build_pipeline_module(cfg, "sdpa", Topology(world_size=1, rank=0, local_rank=0), None)
        module._precompute_checkpointable_values()  # what DeepSpeed's PipelinePolicy does
        if checkpointing:
            inner = module.activation_checkpoint_func
            module.activation_checkpoint_func = lambda fn, *a: (calls.append(1), inner(fn, *a))[1]
        out = module(inputs)
        out = out[0] if isinstance(out, tuple) else out
        out[:, 0].sum().backward()
        results[checkpointing] = (out.detach(), {n: p.grad.clone() for n, p in module.named_parameters()})
        layers = [type(f).__name__ for f in module.forward_funcs]
        checkpointed = [name for name, on in zip(layers, module.is_checkpointable_results) if on]
    (out0, grads0), (out1, grads1) = results[False], results[True]
    print(json.dumps({"calls": len(calls), "layers": layers, "checkpointed": checkpointed,
                      "output_difference": float((out0 - out1).abs().max()),
                      "gradient_difference": max(float((grads0[n] - grads1[n]).abs().max()) for n in grads0),
                      "gradient_norm": float(torch.stack([g.norm() for g in grads0.values()]).norm())}))


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # the interpreter's teardown costs seconds a rank
