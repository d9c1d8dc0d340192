"""Evaluation on a held-out set: during training (`logging.eval_steps`, before and after) and
as `megagrpo eval --model PATH --data FILE`.

Per held-out prompt the generator (the same vLLM or transformers engine as training)
writes `logging.eval_num_generations` completions (greedy when 1, sampled otherwise); then:

- reward: mean of the weighted reward, and `rewards/<fn>` per function, over all completions
- pass@k/<fn>: for k = 1, 2, 4, ... <= n, the unbiased estimator 1 - C(n-c, k) / C(n, k)
  averaged over prompts, a completion counting as correct when the function gives it at least
  its `pass_threshold`; a function without one gets pass@k only when all its rewards are 0 or
  1 (a continuous reward's pass@1 of 0.000 would read as a failure)
- bleu (sacrebleu corpus BLEU / 100, on ROUGE's 0-1 scale), rouge1/rouge2/rougeL (rouge-score
  F1, stemmed), on the first completion of each row that has a target text (`data.target_field`)
- perplexity: exp(mean negative log-likelihood per token) of the target texts given their
  prompts, under the model being evaluated (the generator scores them)
- distinct_1/2/3: distinct n-grams / all n-grams over all completions (whitespace tokens)

Results go to TensorBoard (`eval/*`) and JSON, and every completion with its scores and
reasons to a samples file (JSONL). With tools (rollout.max_turns > 1) each completion is a
multi-turn trajectory run by the same loop as training: the rewards score its last turn, and
the samples file holds every whole conversation (`trajectories`: messages with tool calls and
tool results).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from typing import Optional

import torch

from megagrpo.multimodal.images import thumbnail_data_uri
from megagrpo.process_exit import exit_without_teardown
from megagrpo.rollout.agent import Trajectory
from megagrpo.rollout.generators import EVAL_STEP, sampling_seed

# ---- metrics (pure functions of texts and counts) ----------------------------------------------

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    # the product form of C(n-c, k) / C(n, k), stable for large n
    ratio = 1.0
    for i in range(n - c + 1, n + 1):
        ratio *= 1.0 - k / i
    return 1.0 - ratio


def pass_k_values(n: int) -> list[int]:
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks if not ks or ks[-1] == n else ks + [n]


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct n-grams over all n-grams of all texts (whitespace tokens); 0 when none."""
    grams = [tuple(words[i:i + n]) for words in (t.split() for t in texts)
             for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def bleu(hypotheses: list[str], references: list[str]) -> float:
    """sacrebleu's corpus BLEU on a 0-1 scale (sacrebleu's 0-100 score / 100, the scale of
    ROUGE), one reference per hypothesis."""
    import sacrebleu
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score) / 100


def rouge(hypotheses: list[str], references: list[str]) -> dict:
    """Mean ROUGE-1/2/L F1 (rouge-score, Porter stemming), each in [0, 1]."""
    from rouge_score import rouge_scorer
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    sums = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for hyp, ref in zip(hypotheses, references):
        for key, score in scorer.score(ref, hyp).items():
            sums[key] += score.fmeasure
    return {k: v / len(hypotheses) for k, v in sums.items()}


def perplexity(logprob_sums: list[float], token_counts: list[int]) -> float:
    """exp(-sum log p / tokens) over all reference tokens."""
    tokens = sum(token_counts)
    return math.exp(-sum(logprob_sums) / tokens) if tokens else float("nan")


# ---- generation and scoring ---------------------------------------------------------------------

def score_prompts(stack, prompts, indices: list[int], field_names: list[str]) -> list[dict]:
    """Records of this rank's held-out prompts (stack: stack.RolloutStack, started):
    completions, rewards, reasons and the target text's log-likelihood (the generator's, on a
    rank that generates; none elsewhere). The generator and the rewards are called even with no
    prompts: a generator group pools its ranks' calls, and a reward model's passes are collective."""
    cfg = stack.cfg
    n, max_new_tokens = cfg.logging.eval_num_generations, cfg.rollout.max_new_tokens
    groups = stack.generate(prompts, n, [sampling_seed(cfg.grpo.seed, EVAL_STEP, i) for i in indices],
                            greedy=n == 1)
    completions = [c for group in groups for c in group]
    flat_prompts = [p for p in prompts for _ in range(n)]
    flat_texts, rewards = stack.score(flat_prompts, completions, field_names)
    multi_turn = bool(completions) and isinstance(completions[0], Trajectory)
    conversations = [c.messages for c in completions] if multi_turn else None
    records, targets = [], []
    for j, prompt in enumerate(prompts):
        rows = slice(j * n, (j + 1) * n)
        target = prompt.fields.get(cfg.data.target_field)
        record = {"index": indices[j], "prompt": prompt.prompt, "reference": target,
                  "completions": flat_texts[rows], "reward": rewards.total[rows].tolist(),
                  "rewards": {rf.name: rewards.per_function[rows, f].tolist()
                              for f, rf in enumerate(stack.reward_functions)},
                  "reasons": {name: r[rows] for name, r in rewards.reasons.items()},
                  "ref_logprob": None, "ref_tokens": 0}
        if conversations is not None:
            record["trajectories"] = conversations[rows]
        if prompt.vision is not None:  # what the model saw, small, for the report
            record["images"] = [thumbnail_data_uri(image) for image in prompt.vision.images]
        if target is not None and stack.topology.generates:
            target_ids = stack.tokenizer(str(target), add_special_tokens=False)["input_ids"][:max_new_tokens]
            if target_ids:
                targets.append((record, list(prompt.token_ids) + target_ids, len(prompt.token_ids), prompt.vision))
        records.append(record)
    scored = stack.logprobs([(ids, start, vision) if vision else (ids, start) for _, ids, start, vision in targets])
    if scored is not None:
        for (record, ids, start, _), logprobs in zip(targets, scored):
            record["ref_logprob"], record["ref_tokens"] = float(sum(logprobs)), len(ids) - start
    return records


def evaluate(stack, prompts, rank: int, size: int, group=None) -> tuple[list[dict], dict]:
    """Every held-out prompt scored, rank `rank` of `size` taking every size-th one; returns
    every rank's records (ordered) and the metrics of the module docstring."""
    indices = list(range(rank, len(prompts), size))
    field_names = sorted(prompts[0].fields) if prompts else []
    records = score_prompts(stack, [prompts[i] for i in indices], indices, field_names)
    records = gather_records(records, group)
    functions = stack.reward_functions
    metrics = summarize(records, [f.name for f in functions], stack.cfg.logging.eval_num_generations,
                        {f.name: f.pass_threshold for f in functions})
    return records, metrics


def gather_records(records: list[dict], group=None) -> list[dict]:
    """Every dp rank's records on every rank, ordered by held-out index."""
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, records, group=group)
        records = [r for part in parts for r in part]
    return sorted(records, key=lambda r: r["index"])


def summarize(records: list[dict], function_names: list[str], num_generations: int,
              pass_thresholds: Optional[dict] = None) -> dict:
    """The metrics of the module docstring from all records; pass_thresholds: {function name:
    its pass_threshold or None}."""
    totals = [v for r in records for v in r["reward"]]
    out = {"reward": sum(totals) / len(totals) if totals else float("nan")} if function_names else {}
    for name in function_names:
        values = [v for r in records for v in r["rewards"][name]]
        out[f"rewards/{name}"] = sum(values) / len(values) if values else float("nan")
    for name in function_names:
        threshold = (pass_thresholds or {}).get(name)
        if threshold is None:
            if not all(v in (0.0, 1.0) for r in records for v in r["rewards"][name]):
                continue  # a continuous reward without a pass threshold: no pass@k
            threshold = 1.0
        for k in pass_k_values(num_generations):
            per_prompt = [pass_at_k(num_generations, sum(v >= threshold - 1e-6 for v in r["rewards"][name]), k)
                          for r in records]
            out[f"pass@{k}/{name}"] = sum(per_prompt) / len(per_prompt) if per_prompt else float("nan")
    referenced = [r for r in records if r["reference"] is not None]
    if referenced:
        hyps = [r["completions"][0] for r in referenced]
        refs = [str(r["reference"]) for r in referenced]
        out["bleu"] = bleu(hyps, refs)
        out.update(rouge(hyps, refs))
        scored = [r for r in referenced if r["ref_logprob"] is not None]
        if scored:
            out["perplexity"] = perplexity([r["ref_logprob"] for r in scored],
                                           [r["ref_tokens"] for r in scored])
    everything = [t for r in records for t in r["completions"]]
    for n in (1, 2, 3):
        out[f"distinct_{n}"] = distinct_n(everything, n)
    return out


def write_samples(path: str, records: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, default=str) + "\n")


def record_evaluation(output_dir: str, step: int, records: list[dict], metrics: dict) -> None:
    """A training run's evaluation at `step`: every completion to eval_samples/step_N.jsonl,
    the metrics appended to eval_history.jsonl."""
    write_samples(os.path.join(output_dir, "eval_samples", f"step_{step:08d}.jsonl"), records)
    with open(os.path.join(output_dir, "eval_history.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")


def write_results(output_dir: str, results: dict) -> None:
    """Merge {"before": ..., "after": ...} into output_dir/eval_results.json (a resumed run
    keeps the first run's "before")."""
    path = os.path.join(output_dir, "eval_results.json")
    previous = {}
    if os.path.isfile(path):
        with open(path) as f:
            previous = json.load(f)
    with open(path, "w") as f:
        json.dump({**previous, **results}, f, indent=1)


def format_metrics(results: dict) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in results.items())


# ---- `megagrpo eval` ----------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="megagrpo eval",
        description="Generate with the generator (vLLM or transformers) on a held-out file and report rewards, "
                    "pass@k, BLEU, ROUGE, perplexity and distinct-n (JSON, TensorBoard, samples).")
    p.add_argument("--model", required=True, help="HF model folder (e.g. a run's output_dir/hf), or a PEFT "
                   "LoRA adapter folder (a run's output_dir/adapter), merged into its base first")
    p.add_argument("--base-model", help="for an adapter folder: its base model's HF folder "
                   "(default: adapter_config.json's base_model_name_or_path)")
    p.add_argument("--data", required=True, help="held-out JSONL/JSON/Parquet/CSV file or hub name")
    p.add_argument("--config", help="experiment YAML for rewards, rollout and data settings")
    p.add_argument("--output", default=None,
                   help="folder for eval_results.json, eval_samples.jsonl and tensorboard/ "
                        "(default: <model>/eval)")
    p.add_argument("overrides", nargs="*", help="key.sub=value settings (e.g. rollout.engine=hf)")
    args = p.parse_args(argv)
    if os.path.isfile(os.path.join(args.model, "adapter_config.json")):
        merged = tempfile.mkdtemp(prefix="megagrpo-merged-")
        try:
            return _evaluate(args, merged)
        finally:
            shutil.rmtree(merged, ignore_errors=True)
    return _evaluate(args, None)


def _evaluate(args, merged) -> int:
    """`megagrpo eval`; `merged`: an empty folder to merge an adapter folder (args.model) into."""
    from megagrpo.checkpoints.convert import ConvertError, adapter_to_hf
    from megagrpo.cluster.distributed import init_distributed
    from megagrpo.cluster.generator_layout import generator_layout
    from megagrpo.config.schema import ConfigError
    from megagrpo.console import quiet_library_output
    from megagrpo.data import DataError
    from megagrpo.metrics import MetricsLogger
    from megagrpo.rewards import RewardError
    from megagrpo.stack import build_rollout_stack
    from megagrpo.validation import load_config

    model = args.model
    if merged:
        try:
            adapter_to_hf(args.model, merged, args.base_model, log=lambda msg: None)
        except (ConvertError, ConfigError) as e:
            print(f"megagrpo: error: {e}", file=sys.stderr)
            return 2
        model = merged
    # an engine in each rank of this launch (a training config's generating ranks are not here)
    overrides = list(args.overrides) + [f"model.name_or_path={model}", "rollout.placement=colocated",
                                        f"data.eval_file={args.data}", f"data.train_file={args.data}"]
    try:
        cfg = load_config(args.config, overrides, training=False)
    except (ConfigError, DataError) as e:
        print(f"megagrpo: config error: {e}", file=sys.stderr)
        return 2
    output = args.output or os.path.join(args.model, "eval")
    quiet_library_output()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    generator_tp = generator_layout(cfg).ranks_per_group
    if world % generator_tp:
        print(f"megagrpo: config error: rollout.tensor_parallel_size={generator_tp} (by default "
              f"parallel.tensor_parallel_size) does not divide this eval's {world} rank(s): launch a multiple of it "
              "or pass rollout.tensor_parallel_size=1", file=sys.stderr)
        return 2
    topology = init_distributed(generator_tp=generator_tp)
    try:  # every rank evaluates its own prompts; a generator group shares one engine
        stack = build_rollout_stack(cfg, training=False)
        if not stack.reward_functions and topology.is_main:
            print("megagrpo eval: no reward functions are configured, so no reward is reported (text metrics "
                  "only). Pass them with --config X.yaml (its rewards.functions) or an override, e.g. "
                  "'rewards.functions=[{name: answer_match}]'", file=sys.stderr, flush=True)
        stack.start(topology, seed=cfg.grpo.seed + topology.generator_ranks()[0])
        records, results = evaluate(stack, stack.eval_prompts, topology.rank, topology.world_size)
        stack.close()
    except (DataError, RewardError, ConfigError) as e:
        print(f"megagrpo: error: {e}", file=sys.stderr)
        return 1
    if topology.is_main:
        os.makedirs(output, exist_ok=True)
        results_with_meta = {**results, "num_prompts": len(records), "dropped_prompts": stack.dropped["eval"],
                             "num_generations": cfg.logging.eval_num_generations}
        with open(os.path.join(output, "eval_results.json"), "w") as f:
            json.dump(results_with_meta, f, indent=1)
        write_samples(os.path.join(output, "eval_samples.jsonl"), records)
        logger = MetricsLogger(output, cfg.logging, True, {"model": args.model, "data": args.data})
        logger.scalars(0, {f"eval/{k}": v for k, v in results.items()})
        logger.close()
        for key, value in results.items():
            print(f"{key:>24s}  {value:.4f}")
        print(f"results: {os.path.join(output, 'eval_results.json')}")
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
