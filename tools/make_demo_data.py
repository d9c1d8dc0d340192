"""Write the quickstart's verifiable tasks: short additions, or (--task multiply) products of
two 3-digit numbers that the tiny model can only get right through the `python` tool.

    python tools/make_demo_data.py --out runs/tiny/data
    python tools/make_demo_data.py --task multiply --out runs/agent/data

Writes train.jsonl and eval.jsonl (GRPO prompts, disjoint) with rows
{"prompt": "What is 3 + 4?", "answer": "7"}, and sft.jsonl for the optional warm start
(tools/warm_start.py). The warm-start data teaches two ways to answer: a worked one
("3 + 4 = 7. Answer: 7", always right) and a bare guess ("Answer: 8", off by one or two,
never right), the guess more than twice as often. A model warm-started on it answers greedily
with a guess and is mostly wrong; GRPO with the answer_match reward has to discover that the worked answer pays.

--task multiply writes rows {"prompt": "123*456=?", "answer": "56088"}; its warm-start rows
are multi-turn ({"prompt", "turns": [...]}, see tools/warm_start.py) and teach two behaviours:
call the tool and copy its result (<tool_call>{"name": "python", "arguments": {"code":
"print(123*456)"}}</tool_call>, then the tool's "56088", then "Answer:56088"), or answer
directly with a guess near the product (never right), the guess more often. GRPO has to learn
that the tool pays. Numbers are written without spaces, so a number is the same tokens in the
prompt, the code, the tool's output and the answer.

--task shapes (vision-language models: the VLM quickstart) draws 96x96 images of two filled
shapes, a large and a small one, in two of four colours, and asks "What colour is the largest
shape?" (rows {"prompt", "images": ["images/00012.png"], "answer": "red"}). Its warm start
teaches the answer format and two readings of the picture: the largest shape's colour (right)
and a mistaken one (the next colour in a fixed cycle: red is called green, green blue, ...),
the mistake more often, so the warm-started model answers mostly wrong; GRPO has to discover
that the right reading pays.
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


def products(count: int, rng: random.Random) -> list[dict]:
    pairs = set()
    while len(pairs) < count:
        pairs.add((rng.randint(100, 999), rng.randint(100, 999)))
    return [{"prompt": f"{a}*{b}=?", "answer": str(a * b), "a": a, "b": b} for a, b in sorted(pairs)]


def tool_turns(row: dict, rng: random.Random, tool_share: float) -> list[dict]:
    """A warm-start conversation after the prompt: the tool path, or a direct wrong guess."""
    a, b = row["a"], row["b"]
    if rng.random() < tool_share:
        call = json.dumps({"name": "python", "arguments": {"code": f"print({a}*{b})"}})
        return [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                {"role": "tool", "name": "python", "content": f"{a * b}\n"},
                {"role": "assistant", "content": f"Answer:{a * b}"}]
    guess = a * b + rng.choice([-1, 1]) * rng.randint(1, 50) * 10
    return [{"role": "assistant", "content": f"Answer:{guess}"}]


COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
MISTAKEN = {"red": "green", "green": "blue", "blue": "yellow", "yellow": "red"}  # the warm start's wrong reading
SHAPE_PROMPTS = ["What colour is the largest shape?", "Name the colour of the biggest shape.",
                 "Which colour has the largest shape?"]


def draw_shapes(rng: random.Random, size: int = 96):
    """A white image with a large and a small shape (square or disc) of two colours, apart;
    returns (image, large colour, small colour)."""
    from PIL import Image, ImageDraw

    large, small = rng.sample(sorted(COLOURS), 2)
    while True:  # a small shape an eighth to a fifth of the side, beside a large one of half to 2/3
        big = _place(rng, size, rng.randint(size // 2, size * 2 // 3))
        side = rng.randint(size // 8, size // 5)
        little = next((box for box in (_place(rng, size, side) for _ in range(100)) if not _overlaps(box, big)), None)
        if little is not None:
            break
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    for colour, box in ((large, big), (small, little)):
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)(box, fill=COLOURS[colour])
    return image, large, small


def _place(rng: random.Random, size: int, side: int) -> tuple:
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    return (x, y, x + side - 1, y + side - 1)


def _overlaps(a, b) -> bool:
    return not (a[2] < b[0] or b[2] < a[0] or a[3] < b[1] or b[3] < a[1])


def shape_rows(out: str, count: int, rng: random.Random) -> list[dict]:
    """`count` images under out/images and their rows (image paths relative to out)."""
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    rows = []
    for i in range(count):
        image, large, _ = draw_shapes(rng)
        path = f"images/{i:05d}.png"
        image.save(os.path.join(out, path))
        rows.append({"prompt": rng.choice(SHAPE_PROMPTS), "images": [path], "answer": large})
    return rows


def write_splits(out: str, rows: list[dict], eval_share: float, rng: random.Random) -> dict:
    """Shuffle the rows, hold out eval_share of them; write train.jsonl and eval.jsonl."""
    rng.shuffle(rows)
    n_eval = int(len(rows) * eval_share)
    splits = {"eval": rows[:n_eval], "train": rows[n_eval:]}
    os.makedirs(out, exist_ok=True)
    for name, split in splits.items():
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
            for row in split:
                f.write(json.dumps({k: row[k] for k in ("prompt", "images", "answer") if k in row}) + "\n")
    return splits


def write_warm_start(out: str, rows: list[dict], copies: int, answer) -> int:
    """sft.jsonl: `copies` rows {"prompt", **answer(row)} per row; returns how many."""
    with open(os.path.join(out, "sft.jsonl"), "w") as f:
        for row in rows:
            for _ in range(copies):
                images = {"images": row["images"]} if "images" in row else {}
                f.write(json.dumps({"prompt": row["prompt"], **images, **answer(row)}) + "\n")
    return len(rows) * copies


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--task", choices=["add", "multiply", "shapes"], default="add",
                   help="add: short additions (default); multiply: 3-digit products, learned with the python tool; "
                        "shapes: the colour of the largest shape in an image (vision-language models)")
    p.add_argument("--max-operand", type=int, default=9, help="add: operands are 0..N (default 9)")
    p.add_argument("--problems", type=int, default=None,
                   help="multiply, shapes: number of distinct problems (default 2000 for multiply, 1000 for shapes)")
    p.add_argument("--eval-share", type=float, default=0.2, help="share of prompts held out")
    p.add_argument("--sft-copies", type=int, default=None,
                   help="warm-start samples per prompt (default 8 for add, 2 for multiply)")
    p.add_argument("--worked-share", type=float, default=0.3,
                   help="share of warm-start answers that are worked (add), use the tool (multiply) or "
                        "name the largest shape (shapes): always right")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    rng = random.Random(args.seed)
    if args.problems is None:
        args.problems = 1000 if args.task == "shapes" else 2000
    if args.sft_copies is None:
        args.sft_copies = {"multiply": 2, "shapes": 2}.get(args.task, 8)
    if args.task == "shapes":
        splits = write_splits(args.out, shape_rows(args.out, args.problems, rng), args.eval_share, rng)
        count = write_warm_start(args.out, splits["train"], args.sft_copies, lambda row: {
            "completion": f"Answer: {row['answer'] if rng.random() < args.worked_share else MISTAKEN[row['answer']]}"})
    elif args.task == "multiply":
        splits = write_splits(args.out, products(args.problems, rng), args.eval_share, rng)
        count = write_warm_start(args.out, splits["train"], args.sft_copies,
                                 lambda row: {"turns": tool_turns(row, rng, args.worked_share)})
    else:  # the warm start of the additions sees every prompt (it teaches formats, not sums)
        rows = problems(args.max_operand)
        splits = write_splits(args.out, rows, args.eval_share, rng)
        count = write_warm_start(args.out, rows, args.sft_copies,
                                 lambda row: {"completion": sft_completion(row, rng, args.worked_share)})
    print(f"wrote {len(splits['train'])} train and {len(splits['eval'])} eval prompts ({args.task}) and "
          f"{count} warm-start rows to {args.out}")

if __name__ == "__main__":
    main()
