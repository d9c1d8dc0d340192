"""Write the quickstart's verifiable task: short additions with an exact answer.

    python tools/make_demo_data.py --out runs/tiny/data

Writes train.jsonl and eval.jsonl (GRPO prompts, disjoint) with rows
{"prompt": "What is 3 + 4?", "answer": "7"}, and sft.jsonl for the optional warm start
(tools/warm_start.py). The warm-start data teaches two ways to answer: a worked one
("3 + 4 = 7. Answer: 7", always right) and a bare guess ("Answer: 8", off by one or two,
never right), the guess more than twice as often. A model warm-started on it answers greedily
with a guess and is mostly wrong; GRPO with the answer_match reward has to discover that the worked answer pays.
"""
import argparse
import json
import os
import random

TEMPLATES = ["What is {a} + {b}?", "Compute {a} + {b}.", "{a} + {b} = ?"]


def problems(max_operand: int) -> list[dict]:
    rows = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            for t in TEMPLATES:
                rows.append({"prompt": t.format(a=a, b=b), "answer": str(a + b), "a": a, "b": b})
    return rows


def sft_completion(row: dict, rng: random.Random, worked_share: float) -> str:
    a, b = row["a"], row["b"]
    if rng.random() < worked_share:
        return f"{a} + {b} = {a + b}. Answer: {a + b}"
    return f"Answer: {max(0, a + b + rng.choice([-2, -1, 1, 2]))}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--max-operand", type=int, default=9, help="operands are 0..N (default 9)")
    p.add_argument("--eval-share", type=float, default=0.2, help="share of prompts held out")
    p.add_argument("--sft-copies", type=int, default=8, help="warm-start samples per prompt")
    p.add_argument("--worked-share", type=float, default=0.3,
                   help="share of warm-start answers that are worked (always right)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    rng = random.Random(args.seed)
    rows = problems(args.max_operand)
    rng.shuffle(rows)
    n_eval = int(len(rows) * args.eval_share)
    splits = {"eval": rows[:n_eval], "train": rows[n_eval:]}
    os.makedirs(args.out, exist_ok=True)
    for name, split in splits.items():
        with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
            for row in split:
                f.write(json.dumps({"prompt": row["prompt"], "answer": row["answer"]}) + "\n")
    with open(os.path.join(args.out, "sft.jsonl"), "w") as f:
        for row in rows:
            for _ in range(args.sft_copies):
                f.write(json.dumps({"prompt": row["prompt"],
                                    "completion": sft_completion(row, rng, args.worked_share)}) + "\n")
    print(f"wrote {len(splits['train'])} train, {n_eval} eval prompts and "
          f"{len(rows) * args.sft_copies} warm-start rows to {args.out}")


if __name__ == "__main__":
    main()
