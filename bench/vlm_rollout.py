"""Image prompts through the rollout, and where a VLM step's time goes.

    python bench/vlm_rollout.py --model runs/vlm/warm --prompts runs/vlm/data/train.jsonl \
        --run runs/vlm/grpo --text-run runs/tiny/grpo

1. Rollout: the same P image prompts, G completions each, through one co-located vLLM engine
   (VLLMGenerator, as training runs it), four ways, side by side in one process:
     n=G              one request per prompt, vLLM's parallel sampling (how megagrpo samples)
     G requests       G requests of n=1 per prompt, the same image (vLLM's encoder cache may
                      share its encoding between them)
     G copies         G requests of n=1 per prompt, each with its own copy of the image (one
                      pixel changed: a different hash, so nothing is shared): the baseline
     text only        the prompts without their image (what the images cost)
   Counted on the engine's vision tower (a forward hook): images encoded per prompt; and the
   image prompts per second, with the ratio to the baseline.
2. Step split: the mean seconds per step of each phase (train/time/*) of a finished VLM run
   (--run) and, for comparison, of a text run (--text-run), from their metrics.jsonl.
Prints tables, writes JSON.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megagrpo.cluster.distributed import init_distributed
from megagrpo.config.schema import Config, ImagesConfig, ModelConfig, RolloutConfig
from megagrpo.console import quiet_console
from megagrpo.data import load_prompts
from megagrpo.multimodal.processor import VisionPrompt, load_processor
from megagrpo.policy.models import load_tokenizer
from megagrpo.rollout.generators import VLLMGenerator

ENCODED = {"images": 0}


def _count_encodings(worker) -> None:
    """A forward hook on the engine's vision tower that counts the images it encodes."""
    def hook(module, args, kwargs):
        pixels = kwargs.get("pixel_values", args[0] if args else None)
        ENCODED["images"] += int(pixels.shape[0])
    worker.model_runner.get_model().model.vision_model.register_forward_pre_hook(hook, with_kwargs=True)


def _copy_with_one_pixel_changed(vision: VisionPrompt, k: int) -> VisionPrompt:
    images = []
    for image in vision.images:
        image = image.copy()
        r, g, b = image.getpixel((0, 0))
        image.putpixel((0, 0), ((r + k) % 256, g, b))
        images.append(image)
    return VisionPrompt(images=images, template_ids=vision.template_ids, tensors=vision.tensors)


def measure(engine, requests, n, repeats):
    """requests: (token_ids, vision) pairs; n completions each. Returns seconds, encodings."""
    ids, visions = [r[0] for r in requests], [r[1] for r in requests]
    has_images = any(v is not None for v in visions)
    engine.generate(ids[:1], 1, [0], vision=visions[:1] if has_images else None)  # warm-up
    engine.llm.llm_engine.reset_encoder_cache()
    ENCODED["images"] = 0
    start = time.perf_counter()
    for r in range(repeats):
        engine.generate(ids, n, [r * 10_000 + i for i in range(len(ids))], vision=visions if has_images else None)
        engine.llm.llm_engine.reset_encoder_cache()  # each repeat starts as a new step does (after a sync)
    return time.perf_counter() - start, ENCODED["images"]


def step_split(run_dir: str) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows = [r for r in rows if "train/time/step" in r][1:]  # the first step pays warm-ups
    keys = sorted({k for r in rows for k in r if k.startswith("train/time/")})
    return {k.removeprefix("train/time/"): sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--run", help="a finished VLM run's folder (its metrics.jsonl)")
    p.add_argument("--text-run", help="a finished text run's folder, to compare the step split with")
    p.add_argument("--out", default="bench/results/vlm_rollout.json")
    args = p.parse_args()

    quiet_console()
    init_distributed()
    cfg = Config(model=ModelConfig(name_or_path=args.model, dtype="float32"),
                 rollout=RolloutConfig(max_new_tokens=args.max_new_tokens))
    cfg.data.max_prompt_length = 64
    prompts, _ = load_prompts(args.prompts, load_tokenizer(args.model), 64, processor=load_processor(args.model),
                              images_cfg=ImagesConfig())
    prompts = prompts[:args.num_prompts]
    engine = VLLMGenerator(cfg, args.model, seed=0)
    engine.llm.collective_rpc(_count_encodings)
    G, P = args.num_generations, len(prompts)
    text = [(pr.vision.template_ids, None) for pr in prompts]  # the placeholder token, no image behind it
    cases = {"n=G": ([(pr.token_ids, pr.vision) for pr in prompts], G),
             "G requests": ([(pr.token_ids, pr.vision) for pr in prompts for _ in range(G)], 1),
             "G copies": ([(pr.token_ids, _copy_with_one_pixel_changed(pr.vision, k))
                           for pr in prompts for k in range(G)], 1),
             "text only": ([r for r in text for _ in range(G)], 1)}
    results = {}
    for name, (requests, n) in cases.items():
        seconds, encoded = measure(engine, requests, n, args.repeats)
        results[name] = {"seconds": seconds, "image_prompts_per_s": P * args.repeats / seconds,
                         "completions_per_s": P * G * args.repeats / seconds,
                         "images_encoded_per_prompt": encoded / (P * args.repeats)}
    base = results["G copies"]["image_prompts_per_s"]
    print(f"\n{P} image prompts x {G} completions, {args.repeats} repeats, one vLLM engine on this machine")
    print(f"{'rollout':<14}{'prompts/s':>11}{'x G copies':>12}{'completions/s':>15}{'encoded/prompt':>16}")
    for name, r in results.items():
        r["vs_g_copies"] = r["image_prompts_per_s"] / base
        print(f"{name:<14}{r['image_prompts_per_s']:>11.2f}{r['vs_g_copies']:>12.2f}{r['completions_per_s']:>15.1f}"
              f"{r['images_encoded_per_prompt']:>16.2f}")
    splits = {name: step_split(path) for name, path in (("vlm", args.run), ("text", args.text_run)) if path}
    if splits:
        phases = sorted({k for s in splits.values() for k in s})
        print(f"\n{'phase (s/step)':<16}" + "".join(f"{name:>10}" for name in splits))
        for phase in phases:
            print(f"{phase:<16}" + "".join(f"{s.get(phase, 0.0):>10.3f}" for s in splits.values()))
    output = {"rollout": results, "step_split": splits, "setup": vars(args)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(output, f, indent=1)


if __name__ == "__main__":
    main()
