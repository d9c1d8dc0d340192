"""A real vocabulary: a 2-layer model with Qwen2.5-0.5B's exact configuration otherwise
(151,936 tokens, tied embeddings, hidden 896) runs GRPO on 2 ranks with ZeRO-3 and vLLM: the
fused log-prob pass, the weight sync (tied head included) and the export at real size; and the
memory planner held to the run's real peak."""
import json
import math
import os

import pytest
import torch
from conftest import PYTHON, ROOT, run, tiny_overrides, torchrun
from runs import rows, samples, values
from safetensors.torch import load_file
from spread_reward import distinct_characters
from transformers import AutoTokenizer

QWEN25_05B = {"hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2,
              "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True,
              "max_position_embeddings": 32768, "model_type": "qwen2"}


@pytest.mark.multirank
@pytest.mark.alone  # about 15 GB: two ranks of 7.3 GiB each
def test_real_vocabulary_grpo_on_two_ranks(tiny, tmp_path):
    model = tmp_path / "qwen2.5-0.5b-2layers"
    run([PYTHON, "tools/make_tiny_model.py", "--shape", "qwen2.5-0.5b", "--layers", "2", "--out", str(model),
         "--corpus", os.path.join(tiny["data"], "sft.jsonl")])
    config = json.load(open(model / "config.json"))
    assert {k: config[k] for k in QWEN25_05B} == QWEN25_05B and config["num_hidden_layers"] == 2
    assert config["rope_parameters"]["rope_theta"] == 1e6
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert len(tokenizer) == 151936
    text = "What is 12 + 30? Answer: 42"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.decode([151935]) != ""  # the padded merges are real tokens too

    out = tmp_path / "run"
    proc = run([*torchrun(2, "-m", "megagrpo.train"), "--config", "configs/tiny_arith.yaml",
                *tiny_overrides(tiny, out), f"model.name_or_path={model}", "data.eval_file=null",
                "grpo.max_steps=2", "grpo.per_device_train_batch_size=8", "checkpoint.save_steps=0",
                "logging.sample_steps=1",  # each step's first group with its rewards, recomputed below
                # random weights score zero on the task: a reward with spread gives a gradient
                "rewards.functions=[spread_reward:distinct_characters]"], timeout=800,
               env={"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "helpers")])})
    assert "world 2 = dp 2 x tp 1 x pp 1" in proc.stdout and "done: 2 steps" in proc.stdout
    losses, norms = values(out, "train/loss"), values(out, "train/grad_norm")
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert all(n > 0 for n in norms), norms
    kl = values(out, "train/kl")
    assert kl[0] < 1e-6 and kl[1] > 0, kl  # the reference is the starting policy; the policy moved away from it
    # step 2 samples with the weights synced after step 1: the sampler's log-probs are the trainer's
    assert values(out, "train/sampling/sampling_logp_difference/max")[1] < 1e-4
    # the rewards belong to their completions (real-vocabulary text decoded, 151,936 tokens): each
    # step's logged group scores what the reward gives its texts, recomputed here (a text of 300
    # characters may have been cut in the table, and is left out)
    shown = samples(out)
    assert sorted(shown) == [1, 2], sorted(shown)
    for step, (_, table) in shown.items():
        whole = [(reward, text) for reward, text in table if len(text) < 300]
        assert len(table) == 8 and whole, table  # grpo.num_generations
        assert [f"{r:.3f}" for r, _ in whole] == [f"{r:.3f}" for r in distinct_characters(None, [t for _, t in whole])]
    # the planner holds this run's real peak (megagrpo plan --check-memory must not approve a run
    # that dies): every phase's peak RSS of either rank within the plan, and the plan within 20%
    from megagrpo.planning import make_plan, peak_total
    from megagrpo.validation import load_config
    plan = make_plan(load_config("configs/tiny_arith.yaml", [
        *tiny_overrides(tiny, out), f"model.name_or_path={model}", "data.eval_file=null",
        "grpo.per_device_train_batch_size=8"]), 2)
    planned = peak_total(plan.peak) / 2**30
    measured = max(v for row in rows(out) for k, v in row.items() if k.startswith("train/memory/peak_rss_gib/"))
    # (measured: 7.32 GiB against a plan of 8.54, 1.17)
    assert measured <= planned <= 1.2 * measured, (measured, planned, plan.peak)
    exported = load_file(str(out / "hf" / "model.safetensors"))
    start = load_file(str(model / "model.safetensors"))
    assert exported["model.embed_tokens.weight"].shape == (151936, 896)
    assert not torch.equal(exported["model.embed_tokens.weight"], start["model.embed_tokens.weight"])
