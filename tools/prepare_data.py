"""Write the data files the shipped real-model configs read (data/math/train.jsonl and
data/math/test.jsonl): one {"prompt", "answer"} JSON object per line, the answer a bare number.

    python tools/prepare_data.py --out data/math                      # GSM8K from the HF hub
    python tools/prepare_data.py --out data/math --train-file gsm8k_train.jsonl --test-file gsm8k_test.jsonl
    python tools/prepare_data.py --out data/math --train-file rows.parquet --test-size 200

From the hub (online) it reads `--dataset` (default openai/gsm8k, subset main) with its train
and test splits. Offline, it reads local files (JSONL, JSON, Parquet or CSV) in GSM8K's format
({"question", "answer": "... #### 72"}) or already as {"prompt", "answer"}; with only a train
file, --test-size N keeps its last N rows for the test file. Rows without a final numeric
answer are left out and counted; a malformed row stops it, naming the file and line.
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/math", help="output folder (default data/math, as the configs expect)")
    p.add_argument("--dataset", default="openai/gsm8k", help="hub dataset (default openai/gsm8k)")
    p.add_argument("--subset", default="main", help="its configuration (default main)")
    p.add_argument("--train-file", help="a local file instead of the hub")
    p.add_argument("--test-file", help="a local held-out file")
    p.add_argument("--test-size", type=int, default=0, help="with only --train-file: its last N rows are the test set")
    args = p.parse_args(argv)
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
