"""Probe for tests/test_gpu_checks.py: one co-located vLLM engine (megagrpo's VLLMGenerator, in
this process, as the trainer runs it) around a training step of the trainer's copy of the model.

  1. greedy completions of 8 prompts;
  2. generator.sleep() (level 1 on CUDA; a no-op on CPU, where vLLM has no sleep mode), an
     AdamW step of the trainer's model (so that its weights differ from the engine's), then
     generator.wake_up(): the same greedy completions again (the sleep kept the weights);
  3. the engine's and the trainer's log-probs of a fixed sequence before the sync, then
     sync_weights(named_full_tensors(model), generator) as the trainer calls it, and after;
  4. on CUDA: the free GPU memory around the sleep and each wake-up, and the sync's seconds
     against a device-to-device copy of the same tensors (numbers for the report, not asserted).

Writes one JSON to --out (the test asserts on it).

    python tests/helpers/vllm_engine_probe.py --model DIR --data train.jsonl --dtype float32 --out F
"""
import argparse
import json
import os
import time

import torch
from transformers import AutoModelForCausalLM

from megagrpo.cluster.distributed import init_distributed
from megagrpo.policy.models import load_tokenizer
from megagrpo.policy.weight_gather import named_full_tensors
from megagrpo.process_exit import exit_without_teardown
from megagrpo.rollout.generators import VLLMGenerator, sampling_seed
from megagrpo.rollout.weight_sync import sync_weights
from megagrpo.validation import load_config

GIB = 2**30


def free_gib() -> float | None:
    """Free GPU memory (GiB), None on CPU."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / GIB


def trainer_logprobs(model, sequence, start) -> list[float]:
    """log p(sequence[i] | sequence[:i]) for i >= start, from the trainer's model (float32 softmax)."""
    ids = torch.tensor([sequence], device=model.device)
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    return logp[torch.arange(len(sequence) - 1), ids[0, 1:]][start - 1:].tolist()


def train_step(model, sequences, lr) -> float:
    """One AdamW step of the language-model loss on `sequences` (padded with their last token)."""
    width = max(map(len, sequences))
    ids = torch.tensor([s + s[-1:] * (width - len(s)) for s in sequences], device=model.device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    model.eval()
    return float(loss.detach())


def seconds_of(fn, repeats: int = 3) -> float:
    """The best of `repeats` timed calls, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="a train.jsonl of the demo task (its prompts)")
    p.add_argument("--dtype", required=True, choices=["float32", "bfloat16"])
    p.add_argument("--lr", type=float, default=1e-3, help="the trainer's step (moves its weights off the engine's)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = load_config("configs/tiny_arith.yaml", [
        f"model.name_or_path={args.model}", f"model.dtype={args.dtype}", f"data.train_file={args.data}",
        "data.eval_file=null", "rollout.max_new_tokens=16", "rollout.sleep=true"])
    init_distributed()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    tokenizer = load_tokenizer(args.model)
    with open(args.data) as f:
        prompts = [tokenizer(json.loads(line)["prompt"], add_special_tokens=False)["input_ids"]
                   for _, line in zip(range(8), f)]
    seeds = [sampling_seed(0, 0, i) for i in range(len(prompts))]
    out = {"device": device, "dtype": args.dtype}

    clock = time.perf_counter()
    generator = VLLMGenerator(cfg, args.model, seed=0)
    out.update(startup_s=time.perf_counter() - clock, can_sleep=generator.can_sleep)

    def greedy():
        return [g[0].token_ids for g in generator.generate(prompts, n=1, seeds=seeds, greedy=True)]

    first = greedy()
    out["free_gib_awake"] = free_gib()
    generator.sleep()
    out.update(asleep=sorted(generator.asleep), free_gib_asleep=free_gib())
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out["train_loss"] = train_step(model, [q + c for q, c in zip(prompts, first)], args.lr)
    if device == "cuda":
        out["train_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        torch.cuda.empty_cache()
    generator.wake_up(tags=("weights",))  # as the weight sync wakes it, then the KV cache
    out["free_gib_weights_woken"] = free_gib()
    generator.wake_up()
    out.update(free_gib_woken=free_gib(), awake_after=not generator.asleep)
    second = greedy()
    out.update(greedy_first=first, greedy_after_wake=second)

    sequence, start = prompts[0] + first[0], len(prompts[0])
    out.update(engine_before=generator.logprobs([(sequence, start)])[0],
               trainer=trainer_logprobs(model, sequence, start))
    sync_weights(named_full_tensors(model), generator)
    out["engine_after"] = generator.logprobs([(sequence, start)])[0]
    # the engine's state after the sync: greedy completions of the trained weights
    out["greedy_after_sync"] = greedy()

    if device == "cuda":  # the sync's speed against a device-to-device copy of the same bytes
        targets = [torch.empty_like(t) for _, t in named_full_tensors(model)]

        def copy():
            for dst, (_, src) in zip(targets, named_full_tensors(model)):
                dst.copy_(src)
        out["sync_bytes"] = sum(t.numel() * t.element_size() for t in targets)
        out["sync_s"] = seconds_of(lambda: sync_weights(named_full_tensors(model), generator))
        out["copy_s"] = seconds_of(copy)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # vLLM's engine can hang in the interpreter's teardown
