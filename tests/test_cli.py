"""The console script, the torchrun path, and README/--help staying true to the code."""
import dataclasses
import json
import os
import re

import pytest
from conftest import BIN, ROOT, free_port, run, tiny_overrides, write_jsonl

from megagrpo.config import aliases
from megagrpo.config import schema as config_module
from megagrpo.rewards import answer_match


def test_console_script_validate_and_help(tiny, tmp_path):
    proc = run([f"{BIN}/megagrpo", "validate", "--config", "configs/tiny_arith.yaml",
                *tiny_overrides(tiny, tmp_path), "kl_coef=0.25"])
    assert "kl_coef: 0.25" in proc.stdout
    proc = run([f"{BIN}/megagrpo", "validate", "--config", "configs/tiny_arith.yaml",
                *tiny_overrides(tiny, tmp_path), "grpo.epsilonn=0.3"], check=False)
    assert proc.returncode == 2 and "did you mean 'epsilon'" in proc.stderr
    proc = run([f"{BIN}/megagrpo", "train", "--help"])
    assert "key.sub=value" in proc.stdout and "--timeout-minutes" in proc.stdout


@pytest.mark.multirank
def test_torchrun_two_ranks(tiny, tmp_path):
    """torchrun, and a held-out set smaller than the number of ranks (rank 1 has no share)."""
    out = tmp_path / "run"
    one = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "What is 2 + 2?", "answer": "4"}])
    proc = run([f"{BIN}/torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()),
                "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                *tiny_overrides(tiny, out), "grpo.max_steps=2", "grpo.per_device_train_batch_size=16",
                "checkpoint.save_hf_at_end=false", f"data.eval_file={one}"])
    assert "world 2 = dp 2" in proc.stdout and "done: 2 steps" in proc.stdout
    assert (out / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    # the one held-out prompt is evaluated once (rank 0's share, greedy) before and after
    # training; each reward reported is the answer_match of that one completion, computed here
    # again from the samples file, with nothing from rank 1's empty share in the mean
    results = json.load(open(out / "eval_results.json"))
    history = [json.loads(line) for line in open(out / "eval_history.jsonl")]
    assert [h["step"] for h in history] == [0, 2]
    for key, step, logged in zip(("before", "after"), (0, 2), history):
        records = [json.loads(line) for line in open(out / "eval_samples" / f"step_{step:08d}.jsonl")]
        assert len(records) == 1 and len(records[0]["completions"]) == 1, records
        expected = answer_match(["What is 2 + 2?"], records[0]["completions"], answer=["4"])[0]
        assert records[0]["reward"] == [expected], records
        assert results[key]["reward"] == logged["reward"] == expected, (key, results, records)


def test_docs_document_every_config_key():
    """Every key has a row on the configuration page (docs/configuration.md; README links it)."""
    page = open(os.path.join(ROOT, "docs", "configuration.md")).read()
    assert "docs/configuration.md" in open(os.path.join(ROOT, "README.md")).read()
    for section in (config_module.ModelConfig, config_module.DataConfig, config_module.GRPOConfig,
                    config_module.ParallelConfig,
                    config_module.RolloutConfig, config_module.CheckpointConfig,
                    config_module.LoggingConfig, config_module.RewardFunctionConfig,
                    config_module.RewardsConfig, config_module.DoctorConfig, config_module.TeacherConfig,
                    config_module.Config):
        for f in dataclasses.fields(section):
            assert re.search(rf"\| `(\w+\.)?{f.name}` \|", page) or f.name in (
                "model", "data", "grpo", "rollout", "parallel", "rewards", "checkpoint", "logging", "lora",
                "doctor", "teacher"), f.name
    for f in dataclasses.fields(config_module.LoraConfig):  # a section inside model: model.lora.<key>
        assert f"| `model.lora.{f.name}` |" in page, f.name
    for alias in aliases.ALIASES:
        assert f"`{alias}`" in page, alias
