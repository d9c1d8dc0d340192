"""Write the data files the shipped real-model configs read (data/math/train.jsonl and
data/math/test.jsonl): one {"prompt", "answer"} JSON object per line, the answer a bare number;
or a reasoning-gym task's train and held-out files (--reasoning-gym, offline); or the boards of a
TextArena game (--textarena, offline) or a verifiers taskset's tasks (--verifiers; both in
docs/environments.md).

    python tools/prepare_data.py --reasoning-gym chain_sum --out data/chain_sum --train-size 2000 --eval-size 100
    python tools/prepare_data.py --reasoning-gym basic_arithmetic --task-args '{"max_terms": 3}' --out data/ba
    python tools/prepare_data.py --textarena GuessTheNumber-v0 --out data/guess --train-size 256 --eval-size 32
    python tools/prepare_data.py --verifiers vf-arith --out data/vf --train-size 256 --eval-size 32
    python tools/prepare_data.py --out data/math                      # GSM8K from the HF hub
    python tools/prepare_data.py --out data/math --train-file gsm8k_train.jsonl --test-file gsm8k_test.jsonl
    python tools/prepare_data.py --out data/math --train-file rows.parquet --test-size 200

From the hub (online) it reads `--dataset` (default openai/gsm8k, subset main) with its train
and test splits. Offline, it reads local files (JSONL, JSON, Parquet or CSV) in GSM8K's format
({"question", "answer": "... #### 72"}) or already as {"prompt", "answer"}; with only a train
file, --test-size N keeps its last N rows for the test file. Rows without a final numeric
answer are left out and counted; a malformed row stops it, naming the file and line.

--reasoning-gym TASK generates the task with reasoning-gym (`create_dataset(TASK, size, seed,
**task_args)`) and writes train.jsonl and eval.jsonl: {"prompt", "answer", "reasoning_gym"}, the
last the task's whole entry as JSON, which the `reasoning_gym` reward hands to the task's own
scorer. Train and held-out rows are one seeded sequence (reasoning-gym seeds row i with seed + i,
so two seeds would share rows): the first --train-size rows train, the next ones are held out,
and a held-out row that repeats a training question is dropped, so no held-out question is
trained on. --instruction is appended to each prompt (default: how to state the final answer,
which the reward's extraction rule reads).

--textarena GAME writes train.jsonl and eval.jsonl of a TextArena game (the textarena extra):
{"prompt", "seed"}, the prompt the game's opening board for the seed and how to play (the `move`
tool of `rollout.environment: textarena:GAME`), the seed the one `reset` builds the same board
from. Training rows take seeds --seed, --seed + 1, ...; the held-out rows the seeds after them.
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megagrpo.data import DataError, load_rows  # noqa: E402

FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


def to_row(row: dict, where: str) -> dict | None:
    """{"prompt", "answer"} of one GSM8K-style or prompt/answer row; None without a numeric answer."""
    prompt = row.get("question", row.get("prompt"))
    answer = row.get("answer")
    if not isinstance(prompt, str) or answer is None:
        raise DataError(f"{where}: expected 'question' (or 'prompt') and 'answer' fields, got {sorted(row)}")
    answer = str(answer).strip()
    final = FINAL.search(answer)
    if final:
        answer = final.group(1)
    answer = answer.replace(",", "")
    if not re.fullmatch(r"-?\d*\.?\d+", answer):
        return None
    return {"prompt": prompt.strip(), "answer": answer}


def convert(rows: list[dict], places: list[str]) -> tuple[list[dict], int]:
    out = [to_row(row, where) for row, where in zip(rows, places)]
    kept = [r for r in out if r is not None]
    return kept, len(out) - len(kept)


def hub_splits(dataset: str, subset: str) -> dict:
    import datasets
    try:
        loaded = datasets.load_dataset(dataset, subset)
    except Exception as e:  # noqa: BLE001 - no network, an unknown name, a gated dataset
        raise DataError(f"cannot load '{dataset}' ({subset}) from the HF hub ({type(e).__name__}: "
                        f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); offline, download its files "
                        "elsewhere and pass --train-file (and --test-file)") from None
    return {name: ([dict(r) for r in split], [f"{dataset}/{name}: row {i + 1}" for i in range(len(split))])
            for name, split in loaded.items() if name in ("train", "test")}


def write(path: str, rows: list[dict]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


RG_INSTRUCTION = "Give only the final answer on the last line, as: Answer: <answer>"


def reasoning_gym_rows(task: str, size: int, seed: int, task_args: dict, instruction: str) -> list[dict]:
    """`size` rows of a reasoning-gym task: prompt (question + instruction), answer, entry as JSON."""
    import reasoning_gym

    from megagrpo.rewards.reasoning_gym import check_task
    check_task(task)
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_args)
    except (TypeError, ValueError, AssertionError) as e:
        raise DataError(f"reasoning-gym task '{task}' refused --task-args {json.dumps(task_args)}: "
                        f"{type(e).__name__}: {e}") from None
    rows = []
    for entry in dataset:
        question = entry["question"].strip()
        rows.append({"prompt": f"{question}\n\n{instruction}" if instruction else question,
                     "answer": str(entry["answer"]), "reasoning_gym": json.dumps(entry, default=str)})
    return rows


def write_reasoning_gym(args) -> int:
    from megagrpo.rewards.reasoning_gym import ReasoningGymError
    try:
        task_args = json.loads(args.task_args)
        if not isinstance(task_args, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        print(f"prepare_data: --task-args must be a JSON object of the task's options ({e})", file=sys.stderr)
        return 2
    try:
        rows = reasoning_gym_rows(args.reasoning_gym, args.train_size + 2 * args.eval_size, args.seed, task_args,
                                  RG_INSTRUCTION if args.instruction is None else args.instruction)
    except (DataError, ReasoningGymError) as e:
        print(f"prepare_data: {e}", file=sys.stderr)
        return 2
    train = rows[:args.train_size]
    seen = {row["prompt"] for row in train}
    held_out = [row for row in rows[args.train_size:] if row["prompt"] not in seen][:args.eval_size]
    os.makedirs(args.out, exist_ok=True)
    for name, rows in (("train", train), ("eval", held_out)):
        path = os.path.join(args.out, f"{name}.jsonl")
        write(path, rows)
        print(f"{path}: {len(rows)} rows of reasoning-gym's {args.reasoning_gym}")
    return 0


TA_INSTRUCTION = "Play the game with the move tool, one move per call, until it says the game is over."


def write_textarena(args) -> int:
    from megagrpo.config.schema import ConfigError
    from megagrpo.hubs.textarena import environment_class, opening
    try:
        environment_class(args.textarena)  # a one-line error for a game TextArena lacks or cannot start
    except ConfigError as e:
        print(f"prepare_data: {e}", file=sys.stderr)
        return 2
    instruction = TA_INSTRUCTION if args.instruction is None else args.instruction
    os.makedirs(args.out, exist_ok=True)
    first = args.seed
    for name, size in (("train", args.train_size), ("eval", args.eval_size)):
        rows = [{"prompt": opening(args.textarena, seed) + ("\n\n" + instruction if instruction else ""),
                 "seed": seed} for seed in range(first, first + size)]
        first += size
        path = os.path.join(args.out, f"{name}.jsonl")
        write(path, rows)
        print(f"{path}: {len(rows)} boards of TextArena's {args.textarena}")
    return 0


def write_verifiers(args) -> int:
    from megagrpo.config.schema import ConfigError
    from megagrpo.hubs.verifiers import write_rows
    try:
        overrides = json.loads(args.environment_config)
    except ValueError as e:
        print(f"prepare_data: --environment-config is not JSON: {e}", file=sys.stderr)
        return 2
    try:
        rows = write_rows(f"verifiers:{args.verifiers}", overrides, args.verifiers_python,
                          args.train_size + args.eval_size, 0)
    except ConfigError as e:
        print(f"prepare_data: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    for name, part in (("train", rows[:args.train_size]), ("eval", rows[args.train_size:])):
        path = os.path.join(args.out, f"{name}.jsonl")
        write(path, part)
        print(f"{path}: {len(part)} tasks of the verifiers taskset {args.verifiers}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/math", help="output folder (default data/math, as the configs expect)")
    p.add_argument("--dataset", default="openai/gsm8k", help="hub dataset (default openai/gsm8k)")
    p.add_argument("--subset", default="main", help="its configuration (default main)")
    p.add_argument("--train-file", help="a local file instead of the hub")
    p.add_argument("--test-file", help="a local held-out file")
    p.add_argument("--test-size", type=int, default=0, help="with only --train-file: its last N rows are the test set")
    rg = p.add_argument_group("reasoning-gym (offline, procedurally generated; docs/data-and-rewards.md)")
    rg.add_argument("--reasoning-gym", metavar="TASK", help="a reasoning-gym task name, e.g. chain_sum")
    rg.add_argument("--task-args", default="{}", help="the task's options as a JSON object (default {})")
    rg.add_argument("--train-size", type=int, default=2000, help="training rows (default 2000)")
    rg.add_argument("--eval-size", type=int, default=100, help="held-out rows (default 100)")
    rg.add_argument("--seed", type=int, default=0, help="the rows' seed (default 0)")
    rg.add_argument("--instruction", default=None,
                    help=f"appended to each question (default {RG_INSTRUCTION!r}; '' for none)")
    ta = p.add_argument_group("TextArena (the textarena extra; --train-size, --eval-size, --seed and "
                              "--instruction apply too)")
    ta.add_argument("--textarena", metavar="GAME", help=f"a TextArena game, e.g. GuessTheNumber-v0 (instruction "
                                                         f"default {TA_INSTRUCTION!r})")
    vf = p.add_argument_group("verifiers (a venv of its own: launch/install_hub.sh verifiers; --train-size and "
                              "--eval-size apply too)")
    vf.add_argument("--verifiers", metavar="TASKSET", help="a verifiers taskset's id, e.g. vf-arith")
    vf.add_argument("--environment-config", default="{}",
                    help="rollout.environment_config as a JSON object (default {})")
    vf.add_argument("--verifiers-python", help="the venv's python (default .venv-verifiers/bin/python)")
    args = p.parse_args(argv)
    if args.verifiers:
        return write_verifiers(args)
    if args.textarena:
        return write_textarena(args)
    if args.reasoning_gym:
        return write_reasoning_gym(args)
    try:
        if args.train_file:
            splits = {"train": load_rows(args.train_file)}
            if args.test_file:
                splits["test"] = load_rows(args.test_file)
        else:
            splits = hub_splits(args.dataset, args.subset)
        converted = {name: convert(*rows) for name, rows in splits.items()}
    except DataError as e:
        print(f"prepare_data: {e}", file=sys.stderr)
        return 2
    if args.test_size and "test" not in converted:
        train, skipped = converted["train"]
        if args.test_size >= len(train):
            print(f"prepare_data: --test-size {args.test_size} leaves no training rows ({len(train)} in all)",
                  file=sys.stderr)
            return 2
        converted = {"train": (train[:-args.test_size], skipped), "test": (train[-args.test_size:], 0)}
    os.makedirs(args.out, exist_ok=True)
    for name, (rows, skipped) in converted.items():
        path = os.path.join(args.out, f"{name}.jsonl")
        write(path, rows)
        note = f" ({skipped} without a numeric final answer left out)" if skipped else ""
        print(f"{path}: {len(rows)} rows{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
