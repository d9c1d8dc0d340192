"""The trainer's side of tests/test_rollout_weight_transfer.py: weights sent to a `vllm serve`
through vLLM's weight-transfer API with megagrpo's "gloo" backend (megagrpo/rollout/weight_transfer.py).

    python tests/helpers/transfer_probe.py --url URL --model DIR

Loads the model and checks that the server scores the prompts as it does; then twice: perturbs
the weights (seeded), sends them as version 1, 2 through the factory's trainer engine and the
server's RL endpoints, and measures the largest difference between the server's prompt
log-probs and the perturbed model's, and how far the perturbation moved them. The backend is
found through vLLM's plugin entry point, as the server found its worker side. Prints one JSON line.
"""
import argparse
import json
import time

import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm.plugins import load_general_plugins

from megagrpo.cluster.distributed import free_port
from megagrpo.rollout.weight_transfer import GlooTrainerInitInfo

PROMPTS = ["What is 12 + 7?", "What is 3 + 45?", "Add 20 and 22.", "What is 9 + 9?"]


def model_logprobs(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def server_logprobs(url: str, model_name: str, ids: list[int]) -> list[float]:
    reply = requests.post(f"{url}/v1/completions", timeout=60, json={
        "model": model_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0})
    reply.raise_for_status()
    entries = reply.json()["choices"][0]["prompt_logprobs"][1:]  # the first token has none
    return [entry[str(token)]["logprob"] for entry, token in zip(entries, ids[1:])]


def largest_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    args = p.parse_args()
    load_general_plugins()  # megagrpo's entry point registers "gloo" in the trainer factory
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    served = [server_logprobs(args.url, args.model, ids) for ids in prompts]
    result = {"before": largest_gap(served, [model_logprobs(model, ids) for ids in prompts]), "updates": []}

    workers = requests.get(f"{args.url}/get_world_size", timeout=10).json()["world_size"]
    sender = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo("127.0.0.1", free_port(), world_size=1 + workers, rank=0),
        client=HTTPVLLMWeightSyncClient(args.url), source=ModuleSource(model))
    nbytes = result["bytes"] = sum(t.numel() * t.element_size() for t in model.parameters())
    for version in ("1", "2"):
        before = [model_logprobs(model, ids) for ids in prompts]
        generator = torch.Generator().manual_seed(int(version))
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.05 * param.abs().mean() * torch.randn(param.shape, generator=generator))
        start = time.perf_counter()
        sender.send_weights(weight_version=version)
        seconds = time.perf_counter() - start
        expected = [model_logprobs(model, ids) for ids in prompts]
        served = [server_logprobs(args.url, args.model, ids) for ids in prompts]
        result["updates"].append({
            "version": requests.get(f"{args.url}/weight_info", timeout=10).json()["weight_version"],
            "gap": largest_gap(served, expected), "moved": largest_gap(before, expected),
            "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
