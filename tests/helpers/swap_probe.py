"""Probe for test_rollout_weight_sync.py and test_multimodal.py: one training step, then the rollout engine's
logprobs of a fixed completion next to the trainer's, before and after (for a vision-language model, of
the first prompt with its image; and how far the vision tower's weights moved). Writes
swap_rank<r>.json to output_dir.

    deepspeed --num_gpus 2 tests/helpers/swap_probe.py --config X.yaml key=value ...
"""
import json
import os

import torch

from megagrpo.cluster.distributed import init_distributed
from megagrpo.cluster.generator_layout import generator_layout
from megagrpo.policy.batch import Completion, make_batch
from megagrpo.policy.logprobs import completion_logprobs
from megagrpo.process_exit import exit_without_teardown
from megagrpo.train import Trainer, parse_args
from megagrpo.validation import load_config

# The fixed completion: its tokens under the run's tokenizer, then EOS. The probe writes the text
# and the token ids, so that the test derives how many log-probs each side must give.
COMPLETION_TEXT = "3 + 4 = 7. Answer: 7"


def main():
    args = parse_args()  # the trainer's argparse parser: --config, overrides, --local_rank/--local-rank
    cfg = load_config(args.config, args.overrides)
    topology = init_distributed(tp_size=cfg.parallel.tensor_parallel_size,
                                generator_tp=generator_layout(cfg).ranks_per_group)
    trainer = Trainer(cfg, topology)
    prompt, vision = trainer.prompts[0].token_ids, trainer.prompts[0].vision
    completion = trainer.tokenizer(COMPLETION_TEXT, add_special_tokens=False)["input_ids"]
    completion.append(trainer.tokenizer.eos_token_id)
    batch = make_batch([prompt], [Completion(completion, [0.0] * len(completion), False)],
                       torch.zeros(1), trainer.tokenizer.pad_token_id, [vision])
    request = [(prompt + completion, len(prompt), vision) if vision else (prompt + completion, len(prompt))]

    def trainer_logprobs():
        trainer.policy.engine.eval()
        with torch.no_grad():
            return completion_logprobs(trainer.policy.engine, batch, 1.0)[0][0].tolist()

    def tower():  # collective: every rank walks the whole stream
        return {name: tensor.clone() for name, tensor in trainer.policy.full_tensors() if "vision_model." in name}

    trainer.sync_generator_weights(trainer.step)
    tower_before = tower()
    result = {"completion_text": COMPLETION_TEXT, "completion": completion,
              "images": len(vision.images) if vision else 0,
              "engine_before": trainer.stack.generator.logprobs(request)[0],
              "trainer_before": trainer_logprobs()}
    metrics = trainer.train_step()
    tower_after = tower()
    result.update(engine_after=trainer.stack.generator.logprobs(request)[0],
                  trainer_after=trainer_logprobs(), grad_norm=metrics["grad_norm"],
                  tower_moved=max(((tower_after[n] - t).abs().max().item() for n, t in tower_before.items()),
                                  default=0.0))
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, f"swap_rank{topology.rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.barrier()  # leave together


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # the interpreter's teardown costs seconds a rank
