"""Inputs a newcomer gets wrong end with an exit code and one message naming the file, row or
field and the fix, never a traceback: an empty training file, a chat role no template knows,
a dry run before the data is prepared and with the hub out of reach; and tools/prepare_data.py,
which writes the data files the shipped configs read."""
import json
import os

import pytest
from conftest import PYTHON, run, tiny_overrides, write_jsonl


def _train(tiny, tmp_path, data):
    return run([PYTHON, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                *tiny_overrides(tiny, tmp_path / "out"), f"data.train_file={data}", "data.eval_file=null"],
               check=False, env={"MASTER_PORT": "0"})


@pytest.mark.parametrize("rows,message", [
    ([], "the file is empty (no rows)"),
    ([{"messages": [{"role": "user", "content": "hi"}]},
      {"messages": [{"role": "system", "content": "be kind"}, {"role": "customer", "content": "refund?"}]}],
     "train.jsonl:2: message 2 has role 'customer', which chat templates do not know; use one of system, user"),
])
def test_bad_training_file_ends_with_its_name_and_no_traceback(tiny, tmp_path, rows, message):
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    proc = _train(tiny, tmp_path, data)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert message in proc.stderr and data in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.multirank
def test_dry_run_before_the_data_exists_and_without_the_hub(tiny, tmp_path):
    """The 7B job's dry run on a 4 x 8 hostfile: its data files are not prepared, so they are
    warned about and the plan goes on; the hub model's config cannot be read offline, which
    is one line naming the model, the reason and the fixes. With a local model folder (the
    published architecture, config only) the plan is printed."""
    env = {"DRY_RUN": "1", "HOSTFILE": "hostfiles/4x8", "CONFIG": "configs/qwen2.5_7b_1x8.yaml",
           "HF_HUB_OFFLINE": "1"}
    proc = run(["bash", "launch/train.sh"], env=env, check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "warning: data.train_file: file 'data/math/train.jsonl' does not exist" in proc.stderr
    assert "tools/prepare_data.py" in proc.stderr
    error = [line for line in proc.stderr.splitlines() if "config error" in line]
    assert len(error) == 1 and "cannot read the config of 'Qwen/Qwen2.5-7B-Instruct'" in error[0], proc.stderr
    assert "local model folder" in error[0] and "HF_HUB_OFFLINE=1" in error[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    run([PYTHON, "tools/make_tiny_model.py", "--shape", "qwen2.5-0.5b", "--config-only", "--out",
         str(tmp_path / "arch")])
    proc = run(["bash", "launch/train.sh", f"model.name_or_path={tmp_path / 'arch'}"], env=env)
    assert "world 32 = dp 32 x tp 1" in proc.stdout and "command: deepspeed --hostfile hostfiles/4x8" in proc.stdout
    assert "warning: data.eval_file: file 'data/math/test.jsonl' does not exist" in proc.stderr


def test_prepare_data_writes_the_configs_files_from_local_gsm8k_files(tmp_path):
    train = write_jsonl(tmp_path / "gsm8k_train.jsonl", [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "A train costs $1,250 and a car $250. Total?", "answer": "1250 + 250 = 1500\n#### 1,500"},
        {"question": "Explain gravity.", "answer": "It pulls."},  # no numeric final answer: left out
        {"prompt": "What is 2 + 2?", "answer": "4"}])
    test = write_jsonl(tmp_path / "gsm8k_test.jsonl", [{"question": "5 - 7?", "answer": "#### -2"}])
    out = tmp_path / "data" / "math"
    proc = run([PYTHON, "tools/prepare_data.py", "--out", str(out), "--train-file", train, "--test-file", test])
    assert "3 rows (1 without a numeric final answer left out)" in proc.stdout
    rows = [json.loads(line) for line in open(out / "train.jsonl")]
    assert rows == [{"prompt": "Tom has 3 apples and buys 4. How many?", "answer": "7"},
                    {"prompt": "A train costs $1,250 and a car $250. Total?", "answer": "1500"},
                    {"prompt": "What is 2 + 2?", "answer": "4"}]
    assert [json.loads(line) for line in open(out / "test.jsonl")] == [{"prompt": "5 - 7?", "answer": "-2"}]
    # the written files are what the trainer reads: the shipped config validates against them
    from megagrpo.validation import load_config
    cfg = load_config("configs/qwen2.5_7b_1x8.yaml", [f"data.train_file={out / 'train.jsonl'}",
                                                       f"data.eval_file={out / 'test.jsonl'}"])
    assert cfg.data.train_file.endswith("train.jsonl")
    # --test-size carves the held-out rows from one file
    run([PYTHON, "tools/prepare_data.py", "--out", str(tmp_path / "split"), "--train-file", train, "--test-size", "1"])
    assert len(open(tmp_path / "split" / "train.jsonl").readlines()) == 2
    assert len(open(tmp_path / "split" / "test.jsonl").readlines()) == 1


def test_prepare_data_names_a_bad_row_and_an_unreachable_hub(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "1 + 1?", "answer": "#### 2"}, {"text": "oops"}])
    proc = run([PYTHON, "tools/prepare_data.py", "--out", str(tmp_path / "o"), "--train-file", bad], check=False)
    assert proc.returncode == 2 and "bad.jsonl:2: expected 'question' (or 'prompt') and 'answer'" in proc.stderr
    proc = run([PYTHON, "tools/prepare_data.py", "--out", str(tmp_path / "o")], check=False,
               env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 2 and "cannot load 'openai/gsm8k' (main) from the HF hub" in proc.stderr
    assert "--train-file" in proc.stderr and "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "o" / "train.jsonl")
