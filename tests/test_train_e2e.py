"""End to end through the real launcher: 2 ranks, ZeRO-3, vLLM co-located, TensorBoard, resume."""
import json
import os
import shutil
import sys
import threading
import time

import pytest
from conftest import BIN, ROOT, free_port, run, tiny_overrides, write_jsonl
from runs import metrics, samples

EXPECTED_METRICS = [
    "reward", "reward_std", "reward_min", "reward_max", "rewards/answer_match/mean",
    "rewards/answer_match/std", "frac_reward_zero_std", "advantages/mean", "advantages/std",
    "kl", "entropy", "loss", "clip_ratio/low_mean", "clip_ratio/high_mean",
    "clip_ratio/region_mean", "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max",
    "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
    "learning_rate", "grad_norm", "completions/mean_length", "completions/min_length",
    "completions/max_length", "completions/clipped_ratio", "tokens_per_second",
    "time/rollout", "time/reward", "time/reference", "time/train", "time/weight_sync", "time/step",
]


def launch(tiny, out, *extra):
    return run([f"{BIN}/deepspeed", "--num_gpus", "2", "--master_port", str(free_port()),
                "--module", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                *tiny_overrides(tiny, out), "grpo.per_device_train_batch_size=16",
                "checkpoint.save_steps=2", "logging.sample_steps=2", *extra])


@pytest.mark.multirank
def test_two_rank_zero3_vllm_run_logs_and_resumes(tiny, tmp_path):
    out = tmp_path / "run"
    first = launch(tiny, out, "grpo.max_steps=4")
    assert "world 2 = dp 2" in first.stdout
    values = metrics(out)
    for name in EXPECTED_METRICS:
        steps = [s for s, _ in values.get(f"train/{name}", [])]
        assert steps == [1, 2, 3, 4], f"train/{name}: {steps}"
    assert {"eval/reward", "eval/rewards/answer_match"} <= set(values)
    _assert_rewards_recomputed(tiny, out, [2, 4])
    # the engine samples with the trainer's weights at every step (the sync works under ZeRO-3)
    assert max(v for _, v in values["train/sampling/sampling_logp_difference/max"]) < 1e-3
    assert all(v > 0 for _, v in values["train/grad_norm"])
    # the reference model is the starting policy: at step 1 their log-probs agree to the bit
    # (measured: 0.0), and the policy moves away after (grpo.kl_coef > 0)
    assert values["train/kl"][0] == (1, 0.0) and min(v for _, v in values["train/kl"][1:]) > 0, values["train/kl"]
    assert all(0 <= v <= 1 for _, v in values["train/reward"])
    ckpts = sorted(d for d in os.listdir(out / "checkpoints") if d.startswith(("step_", "latest")))
    assert ckpts == ["latest", "step_00000002", "step_00000004"]
    assert open(out / "checkpoints" / "latest").read() == "step_00000004"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / "hf" / name).is_file()

    second = launch(tiny, out, "grpo.max_steps=6")
    assert "resumed from" in second.stdout and "at step 4" in second.stdout
    values = metrics(out)
    assert [s for s, _ in values["train/reward"]] == [1, 2, 3, 4, 5, 6]
    _assert_rewards_recomputed(tiny, out, [2, 4, 6])
    state = json.load(open(out / "checkpoints" / "step_00000006" / "trainer_state.json"))
    assert state["step"] == 6 and state["sampler"]["position"] == 6
    ckpts = sorted(d for d in os.listdir(out / "checkpoints") if d.startswith(("step_", "latest")))
    assert ckpts == ["latest", "step_00000004", "step_00000006"]


def _assert_rewards_recomputed(tiny, out, steps):
    """The sample tables logged at `steps` (the first prompt's group) hold the rewards
    answer_match gives their completions, recomputed here against each prompt's answer in the
    data: the rewards belong to their completions, and the group is whole."""
    from megagrpo.rewards import answer_match

    answers = {row["prompt"]: row["answer"] for row in map(json.loads, open(os.path.join(tiny["data"], "train.jsonl")))}
    shown = samples(out)
    assert sorted(shown) == steps, sorted(shown)
    for step, (prompt, table) in shown.items():
        texts = [text for _, text in table]
        assert len(texts) == 8, (step, table)  # grpo.num_generations
        assert [reward for reward, _ in table] == answer_match([prompt] * 8, texts, answer=[answers[prompt]] * 8), (
            step, prompt, answers[prompt], table)


def test_hf_export_loads_in_transformers_and_matches(tiny, tmp_path):
    """The final HF folder equals the live model: logits of the exported model are those of
    a model loaded from the last DeepSpeed checkpoint's consolidated weights, and of the
    folder `megagrpo convert to-hf` makes from that checkpoint; vLLM loads the converted
    folder unchanged and decodes greedily what transformers decodes. Trained with gradient
    checkpointing on."""
    import torch
    from transformers import AutoModelForCausalLM
    out = tmp_path / "run"
    run([sys.executable, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
         *tiny_overrides(tiny, out), "rollout.engine=hf", "grpo.max_steps=2",
         "grpo.per_device_train_batch_size=16", "grpo.learning_rate=1e-3",
         "model.gradient_checkpointing=true"])
    exported = AutoModelForCausalLM.from_pretrained(str(out / "hf"), dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(tiny["warm"], dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    assert not torch.allclose(exported(ids).logits, original(ids).logits)  # training moved it
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag="step_00000002")
    original.load_state_dict(state, strict=False)
    torch.testing.assert_close(exported(ids).logits, original(ids).logits, atol=1e-5, rtol=0)
    # the offline converter (own ZeRO-3 reader, weights_only loads) gives the same model
    converted = tmp_path / "converted"
    run([f"{BIN}/megagrpo", "convert", "to-hf", str(out / "checkpoints" / "step_00000002"), str(converted)])
    index = json.load(open(converted / "model.safetensors.index.json"))
    assert set(index["metadata"]["sha256"]) == set(index["weight_map"].values())
    from_checkpoint = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32)
    torch.testing.assert_close(from_checkpoint(ids).logits, exported(ids).logits, atol=1e-5, rtol=0)
    inspect = run([f"{BIN}/megagrpo", "convert", "inspect", str(out / "checkpoints" / "step_00000002")]).stdout
    assert "layout: zero-3" in inspect and "step: 2" in inspect and "model.norm.weight" in inspect
    vllm = json.loads(run([sys.executable, "tests/helpers/vllm_greedy.py", str(converted)]).stdout.splitlines()[-1])
    prompt = torch.tensor([vllm["prompt"]])
    expected = exported.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:]
    assert vllm["tokens"] == expected.tolist()[:len(vllm["tokens"])] and len(vllm["tokens"]) > 1


def test_reward_that_raises_stops_the_run(tiny, tmp_path):
    out = tmp_path / "run"
    proc = run([sys.executable, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                *tiny_overrides(tiny, out), "rollout.engine=hf", "grpo.max_steps=2",
                "rewards.functions=[{name: 'test_rewards:raising_reward'}]"],
               check=False, env={"PYTHONPATH": f"{os.path.dirname(__file__)}:{ROOT}"})
    assert proc.returncode == 1
    assert "reward function 'test_rewards:raising_reward' raised KeyError" in proc.stderr


def test_malformed_data_stops_before_training(tiny, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "What is 1 + 1?", "answer": "2"}, "{oops"])
    proc = run([sys.executable, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                *tiny_overrides(tiny, tmp_path / "run"), f"data.train_file={bad}"], check=False)
    assert proc.returncode == 1
    assert f"{bad}:2: malformed JSON" in proc.stderr


def test_stale_deepspeed_build_lock_is_removed_not_waited_on(tiny, tmp_path, monkeypatch, capsys):
    """A process killed while loading DeepSpeed's CPU op leaves torch's build lock behind; the
    next job removes an old one (naming it) instead of waiting forever, and waits on a young one.
    The locks go into a build folder of this test's own (TORCH_EXTENSIONS_DIR, restored by
    monkeypatch whatever happens): one left in the venv's folder would hang every later job."""
    from torch.utils.cpp_extension import _get_build_directory

    from megagrpo.cluster.op_builds import SHM_OP, clear_stale_build_lock, use_venv_extensions_dir

    # as the trainer does without TORCH_EXTENSIONS_DIR: the venv's own build folder. (Set, then
    # deleted: monkeypatch records nothing for deleting an unset variable, and would then leave
    # the value use_venv_extensions_dir sets behind.)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    use_venv_extensions_dir()
    venv_folder = os.path.join(sys.prefix, "torch_extensions")
    assert os.environ.get("TORCH_EXTENSIONS_DIR") == (venv_folder if os.access(sys.prefix, os.W_OK) else None)
    # a folder that is set is kept: here, this test's, with a copy of the venv's build of the op
    # (when there is one), which the trainer below loads without compiling it when it is current
    extensions = tmp_path / "torch_extensions"
    if os.path.isdir(os.path.join(venv_folder, SHM_OP)):
        shutil.copytree(os.path.join(venv_folder, SHM_OP), extensions / SHM_OP,
                        ignore=shutil.ignore_patterns("lock"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    use_venv_extensions_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(extensions)
    lock = os.path.join(_get_build_directory(SHM_OP, verbose=False), "lock")
    assert lock == str(extensions / SHM_OP / "lock")

    # young: waited on while its builder works. Released here by a thread after 1 s (which
    # notes it before unlinking): the call returns only after the release, and removes nothing.
    open(lock, "w").close()
    events = []
    release = threading.Timer(1.0, lambda: (events.append("released"), os.unlink(lock)))
    release.start()
    try:
        removed = clear_stale_build_lock(SHM_OP, say_after_s=0.5)
        events.append("returned")
    finally:
        release.cancel()
        release.join()
    assert not removed and events == ["released", "returned"]
    assert f"{lock} exists (" in capsys.readouterr().err  # it said what it waits for

    open(lock, "w").close()  # young, and nobody releases it: removed once it is max_age_s old
    assert clear_stale_build_lock(SHM_OP, max_age_s=2, say_after_s=0.5) and not os.path.exists(lock)
    err = capsys.readouterr().err
    assert "removed if still there at 2 s" in err and f"removed {lock}: a build lock left" in err
    assert err.index("removed if still there") < err.index(f"removed {lock}")  # waited, then removed

    open(lock, "w").close()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{oops"])
    proc = run([sys.executable, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                *tiny_overrides(tiny, tmp_path / "run"), f"data.train_file={bad}"], check=False, timeout=300)
    assert f"removed {lock}: a build lock left 60 minutes ago" in proc.stderr
    assert proc.returncode == 1 and f"{bad}:1: malformed JSON" in proc.stderr  # it went on to the data
    assert not os.path.exists(lock)
