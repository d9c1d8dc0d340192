"""Exact resume: a 2-rank ZeRO-3 run killed with SIGKILL after its step-3 checkpoint and resumed
ends bit-identical to an uninterrupted run, having seen the same prompts in the same order.
Crashes inside a save, and a corrupt checkpoint, never make a resume load half a checkpoint."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import BIN, ROOT, run, signal_job, tiny_overrides, torchrun
from runs import assert_same_run, rows, series, tensorboard_scalars, values
from safetensors.torch import load_file
from warm_jobs import WarmJob


def _command(tiny, out, extra):
    return [*torchrun(2, "-m", "megagrpo.train"), "--config", "configs/tiny_arith.yaml",
            *tiny_overrides(tiny, out), "data.eval_file=null", "grpo.per_device_train_batch_size=16",
            "grpo.max_steps=6", "checkpoint.save_steps=3", "logging.sample_steps=0", *extra]


def _prompts_by_step(out):
    """step -> its prompts (with dynamic sampling: the list of its rounds' prompts)."""
    seen = {}
    with open(os.path.join(out, "prompts_seen.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "round" in row:
                seen[row["step"]] = [*seen[row["step"]], row["prompts"]]
            else:  # a resumed run repeats the steps after its checkpoint
                seen[row["step"]] = [row["prompts"]]
    return {step: rounds[0] if len(rounds) == 1 else rounds for step, rounds in seen.items()}


def _wait_for(condition, timeout, proc):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before it could be killed")
        time.sleep(0.2)
    raise AssertionError("timed out waiting for the run")


@pytest.mark.multirank
@pytest.mark.parametrize("variant", ["mu1", "mu2_multi_turn", "dynamic_sampling_moving_reference", "lora"])
def test_sigkill_and_resume_is_exact(tiny, tmp_path, variant):
    """mu1: num_iterations 1, logging to W&B too; mu2_multi_turn: num_iterations 2, multi-turn
    rollouts that call the python tool (sandboxed) and play an environment each turn, its reward
    beside the task's; dynamic_sampling_moving_reference: several sampling rounds a step (the
    sampler's position after them saved and restored) and a moving reference (moved at step 2,
    saved with the step-3 checkpoint as each rank's partitions, restored); lora: a LoRA policy,
    whose checkpoint holds the adapters and their optimizer state only."""
    extra = {"mu1": ["grpo.num_iterations=1"],
             "mu2_multi_turn": ["grpo.num_iterations=2", "rollout.max_turns=3", "rollout.max_new_tokens=16",
                                "rollout.tool_call_parser=agent_tools:python_and_game_parser",
                                "rollout.tools=[python]", "rollout.environment=agent_tools:NumberGame",
                                "rollout.max_tool_response_tokens=32", "data.max_prompt_length=160",
                                "rewards.functions=[{name: answer_match}, {name: environment, weight: 0.5}]"],
             "dynamic_sampling_moving_reference": [
                 "grpo.dynamic_sampling=true", "grpo.sync_ref_model=true", "grpo.ref_model_sync_steps=2",
                 "grpo.ref_model_mixup_alpha=0.5", "grpo.learning_rate=1e-3"],
             "lora": ["model.lora.r=8", "grpo.learning_rate=1e-3"]}[variant]
    wandb = {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
             "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "helpers")])}  # agent_tools
    if variant == "mu1":  # every sink: the resumed attempt continues the same W&B run
        extra = extra + ["logging.report_to=[tensorboard,jsonl,wandb]"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run(_command(tiny, straight, extra), env=wandb)

    env = {**os.environ, "PYTHONUNBUFFERED": "1", **wandb}
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(_command(tiny, killed, extra), cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        latest = killed / "checkpoints" / "latest"
        _wait_for(lambda: latest.is_file() and latest.read_text() == "step_00000003", 600, proc)
        _wait_for(lambda: 4 in _prompts_by_step(killed), 120, proc)  # killed mid-run, past the save
        signal_job(proc.pid, signal.SIGKILL)  # the launcher and every rank, as a lost node
        proc.wait()
    assert not (killed / "hf").exists()
    resumed = run(_command(tiny, killed, extra), env=wandb)
    assert "at step 3" in resumed.stdout
    # the sinks: what the killed attempt logged after step 3 was dropped, so no step appears twice
    logged = rows(killed)
    assert [row["step"] for row in logged if "train/loss" in row] == [1, 2, 3, 4, 5, 6]
    losses = [tensorboard_scalars(out)["train/loss"] for out in (killed, straight)]
    assert losses[0] == losses[1]  # TensorBoard: the later events purged from view
    if variant != "dynamic_sampling_moving_reference":
        assert [json.loads(line)["step"] for line in open(killed / "prompts_seen.jsonl")] == [1, 2, 3, 4, 5, 6]
    if variant == "mu2_multi_turn":  # the turns were taken: python calls, and the environment's reward
        steps = [row for row in logged if "train/loss" in row]
        assert min(row["train/turns/mean"] for row in steps) > 1, steps
        assert min(row["train/tools/calls_per_trajectory"] for row in steps) > 1, steps
        assert max(row["train/rewards/environment/mean"] for row in steps) > 0, steps
    if variant == "mu1":
        runs = sorted(p.name for p in (killed / "wandb").glob("offline-run-*"))
        run_id = (killed / "wandb_run_id").read_text().strip()
        assert len(runs) == 2 and all(name.split("-")[3] == run_id for name in runs), (runs, run_id)
    if variant == "dynamic_sampling_moving_reference":
        assert (killed / "checkpoints" / "step_00000003" / "reference_rank1.pt").is_file()

    assert _prompts_by_step(killed) == _prompts_by_step(straight)
    assert sorted(_prompts_by_step(straight)) == [1, 2, 3, 4, 5, 6]
    if variant == "dynamic_sampling_moving_reference":  # rounds sampled; no prompt twice in a step
        rounds = [r for r in _prompts_by_step(straight).values() if isinstance(r[0], list)]
        assert rounds and all(len({p for part in r for p in part}) == sum(map(len, r)) for r in rounds)
        zero_spread = values(straight, "train/frac_reward_zero_std")
        assert len(zero_spread) == 6 and max(zero_spread) == 0, zero_spread  # trained on informative groups only
    if variant == "lora":
        adapters = [load_file(str(out / "adapter" / "adapter_model.safetensors")) for out in (straight, killed)]
        assert adapters[0].keys() == adapters[1].keys() and len(adapters[0]) == 28
        assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
        saved = sum(f.stat().st_size for f in (killed / "checkpoints" / "step_00000003").iterdir())
        assert saved < os.path.getsize(os.path.join(tiny["warm"], "model.safetensors")), saved  # no base weights
        # on another number of dp ranks (the same global batch) it is refused, saying what to do
        step3 = killed / "checkpoints" / "step_00000003"
        one_rank = _command(tiny, tmp_path / "dp1", extra)
        refused = run([sys.executable, "-m", "megagrpo.train", *one_rank[one_rank.index("--config"):],
                       "grpo.per_device_train_batch_size=32", f"checkpoint.resume={step3}"], check=False)
        assert refused.returncode != 0 and (f"checkpoint '{step3}' is a LoRA checkpoint saved with dp=2; re-sharding "
                                            "one to dp=1 is not supported: resume with the same number of ranks"
                                            ) in refused.stderr, refused.stderr[-2000:]
    # bit for bit: every step's loss, gradient norm, prompts, rewards and lengths, every parameter
    b = assert_same_run(killed, straight)
    start = load_file(os.path.join(tiny["warm"], "model.safetensors"))
    assert any(not torch.equal(b[k], start[k]) for k in b)  # training moved the weights


def _saving_every_step(tiny, out, steps):
    """The arguments of a one-rank job (transformers' sampling: a quick start) that saves after
    every step."""
    return ["--config", "configs/tiny_arith.yaml",
            *tiny_overrides(tiny, out), "data.eval_file=null", "rollout.engine=hf",
            "grpo.per_device_train_batch_size=8", "checkpoint.save_steps=1",
            "checkpoint.keep_last=2", "logging.sample_steps=0", f"grpo.max_steps={steps}"]


def _latest(checkpoints) -> str:
    try:
        return (checkpoints / "latest").read_text()
    except FileNotFoundError:
        return ""


def _kill_inside_a_save(proc, checkpoints, rng) -> tuple[str, str]:
    """Let the job's first save go through (its duration d, from the moment `<tag>.tmp` appears to
    `latest` naming it), then SIGKILL the job at a moment drawn uniformly from the first d of its
    next save. Returns (the tag being saved, how far the save got by the files it left)."""
    launched, deadline, duration = time.time(), time.time() + 120, None

    def saves_begun():  # a killed job's `<tag>.tmp` is older than this job
        names = os.listdir(checkpoints) if checkpoints.is_dir() else []
        try:
            return [n[:-len(".tmp")] for n in names if n.startswith("step_") and n.endswith(".tmp")
                    and os.stat(checkpoints / n).st_ctime >= launched]
        except FileNotFoundError:  # renamed meanwhile
            return []

    while True:
        saving = []
        while not saving:  # polled every 0.5 ms: a save of the tiny model takes about 15 ms
            if proc.poll() is not None or time.time() > deadline:
                raise AssertionError(f"the run ended (rc {proc.returncode}) or stalled before a save to kill")
            saving = saves_begun()
            time.sleep(0.0005)
        started, tag = time.perf_counter(), saving[0]
        if duration is None:
            while _latest(checkpoints) != tag and proc.poll() is None:
                time.sleep(0.0005)
            duration = time.perf_counter() - started
            continue
        time.sleep(rng.uniform(0, duration))
        proc.kill()
        proc.wait()
        if (checkpoints / f"{tag}.tmp").is_dir():
            return tag, "marked" if (checkpoints / f"{tag}.tmp" / "COMPLETE").is_file() else "writing"
        if _latest(checkpoints) != tag:
            return tag, "renamed"
        steps = [n for n in os.listdir(checkpoints) if n.startswith("step_")]
        return tag, "pointed, not pruned" if len(steps) > 2 else "done"


def test_crash_at_every_point_of_a_save_resumes_from_a_complete_checkpoint(tiny, tmp_path):
    """SIGKILL inside the save of steps 2, 3, 4 and 5 (one point of checkpoint.save each, by the
    MEGAGRPO_CRASH_AT fault hook: files written but unmarked, marked but not renamed, renamed
    but `latest` not updated, `latest` updated but older ones not pruned); each restart resumes
    from a complete checkpoint and the run ends at step 6 with all its steps' prompts. Then a
    corrupt newest checkpoint (a truncated DeepSpeed file, COMPLETE marker present) is reported
    and the previous one loaded."""
    from megagrpo.checkpoints.checkpoint import CRASH_POINTS

    out = tmp_path / "run"
    argv = _saving_every_step(tiny, out, steps=6)
    for step, point in zip([2, 3, 4, 5], CRASH_POINTS):
        job = WarmJob(argv, tmp_path / "jobs.log", {"MEGAGRPO_CRASH_AT": f"{point}:{step}"})
        assert job.wait() == -signal.SIGKILL, (point, job.returncode, (tmp_path / "jobs.log").read_text()[-3000:])
        ckpts = out / "checkpoints"
        latest = (ckpts / "latest").read_text()
        assert (ckpts / latest / "COMPLETE").is_file(), (point, latest)
    assert WarmJob(argv, tmp_path / "jobs.log").wait() == 0
    logs = (tmp_path / "jobs.log").read_text()
    resumed_at = [int(m) for m in re.findall(r"resumed from .*step_(\d+) at step", logs)]
    # the checkpoint `latest` names: the previous one until the new one's rename and pointer
    # update are both done (a complete step_4 whose pointer was not written is not preferred)
    assert resumed_at == [1, 2, 3, 5], resumed_at
    assert sorted(_prompts_by_step(out)) == [1, 2, 3, 4, 5, 6]
    assert logs.count("done: 6 steps") == 1
    assert f"ignoring incomplete checkpoint '{out / 'checkpoints' / 'step_00000002.tmp'}'" in logs

    # a corrupt newest checkpoint: reported by name, the previous complete one is loaded
    newest = sorted(d for d in os.listdir(out / "checkpoints") if d.startswith("step_"))[-1]
    victim = next(p for p in (out / "checkpoints" / newest).rglob("*.pt"))
    victim.write_bytes(victim.read_bytes()[:100])
    assert WarmJob(argv + ["grpo.max_steps=7"], tmp_path / "again.log").wait() == 0
    again = (tmp_path / "again.log").read_text()
    assert f"checkpoint '{out / 'checkpoints' / newest}' could not be loaded" in again
    assert "resumed from" in again and "done: 7 steps" in again


@pytest.mark.multirank
def test_resume_on_another_number_of_dp_ranks_continues_the_same_run(tiny, tmp_path):
    """A dp=2 ZeRO-3 checkpoint (step 1) resumed on one rank with the same global batch goes
    through DeepSpeed's universal checkpoint: its step 2 has the loss of the original layout's
    step 2, the same prompts, and ends with the same parameters. A change of pp is refused.
    The dp=2 run samples with one vLLM engine sharded over both ranks (pooling their prompts),
    the one-rank run with a whole engine: the same losses and parameters hold the generator
    layouts equal too."""
    common = ["data.eval_file=null", "grpo.max_steps=2", "grpo.learning_rate=1e-4",
              "logging.sample_steps=0", "checkpoint.save_steps=1"]
    two, one = tmp_path / "dp2", tmp_path / "dp1"
    run([*torchrun(2, "-m", "megagrpo.train"), "--config", "configs/tiny_arith.yaml", *tiny_overrides(tiny, two),
         *common,
         "grpo.per_device_train_batch_size=16", "rollout.tensor_parallel_size=2"])
    step1 = two / "checkpoints" / "step_00000001"
    resumed = run([sys.executable, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                   *tiny_overrides(tiny, one), *common, "grpo.per_device_train_batch_size=32",
                   f"checkpoint.resume={step1}"])
    assert "(re-sharded from dp 2 x tp 1 to dp 1 x tp 1)" in resumed.stdout
    assert [s for s, _ in series(one, "train/loss")] == [2]
    assert_same_run(one, two, steps=[2], loss_atol=1e-5, grad_norm_rtol=1e-4, param_atol=1e-5)
    a = load_file(str(two / "hf" / "model.safetensors"))
    # the offline converter reassembles the two ranks' ZeRO-3 partitions into the same weights
    run([f"{BIN}/megagrpo", "convert", "to-hf", str(two / "checkpoints" / "step_00000002"), str(tmp_path / "hf2")])
    c = load_file(str(tmp_path / "hf2" / "model-00001.safetensors"))
    assert sorted(c) == sorted(a) and all(torch.equal(c[k], a[k]) for k in a)

    state = json.loads((step1 / "trainer_state.json").read_text())
    state["layout"]["pp"] = 2
    (step1 / "trainer_state.json").write_text(json.dumps(state))
    refused = run([sys.executable, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                   *tiny_overrides(tiny, tmp_path / "pp"), *common, "grpo.per_device_train_batch_size=32",
                   f"checkpoint.resume={step1}"], check=False)
    assert refused.returncode != 0
    assert f"checkpoint '{step1}' was saved with pp=2, this run has pp=1; re-sharding across pipeline" in refused.stderr


@pytest.mark.parametrize("saved,now,refusal", [
    ((2, 1, 1, 4, 3), (1, 1, 1, 4, 3), None),          # dp 2 -> 1, same global batch
    ((1, 2, 1, 4, 3), (1, 1, 1, 4, 3), None),          # AutoTP tp 2 -> 1
    ((2, 2, 1, 4, 1), (1, 1, 1, 4, 1), None),          # both
    ((2, 1, 1, 4, 3), (2, 1, 1, 4, 3), False),         # same layout: plain load
    ((1, 1, 1, 4, 3), (1, 2, 1, 4, 3), "re-shards to tp=1 only"),
    ((1, 4, 1, 4, 3), (1, 2, 1, 4, 3), "re-shards to tp=1 only"),
    ((1, 1, 2, 4, 1), (1, 1, 1, 4, 1), "re-sharding across pipeline layouts"),
    ((2, 1, 2, 4, 1), (1, 1, 2, 4, 1), "is a pipeline checkpoint"),
    ((2, 1, 1, 4, 3), (1, 1, 1, 8, 3), "keep the global batch"),
    ((2, 1, 1, 4, 0), (1, 1, 1, 4, 3), "ZeRO-0 checkpoint"),
    ((2, 1, 1, 4, 3), (1, 1, 1, 4, 0), "ZeRO-0 checkpoint"),
])
def test_which_layout_changes_re_shard(saved, now, refusal):
    """(dp, tp, pp, prompts per step, ZeRO stage) saved and now: what needs_reshard decides."""
    from megagrpo.checkpoints.checkpoint import needs_reshard

    dp, tp, pp, prompts, zero = saved
    state = {"dp_size": dp, "prompts_per_step": prompts, "layout": {"tp": tp, "pp": pp, "zero_stage": zero}}
    if isinstance(refusal, str):
        with pytest.raises(ValueError, match=refusal):
            needs_reshard(state, *now)
    else:
        assert needs_reshard(state, *now) is (refusal is None)


def test_pruning_takes_a_checkpoints_universal_form_with_it(tmp_path):
    """keep_last counts complete checkpoints up to the one `latest` names; a pruned one's
    `<tag>.universal` (made when a run re-sharded it) is removed too, the kept ones' stay."""
    from megagrpo.checkpoints.checkpoint import MARKER, _prune

    for step in (1, 2, 3):
        for folder in (f"step_{step:08d}", f"step_{step:08d}.universal"):
            (tmp_path / folder).mkdir()
        (tmp_path / f"step_{step:08d}" / MARKER).write_text("x")
    _prune(str(tmp_path), keep_last=2, current="step_00000003")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000002", "step_00000002.universal", "step_00000003", "step_00000003.universal"]


def test_sigkill_at_random_moments_of_saves_resumes_from_the_newest_complete_checkpoint(tiny, tmp_path):
    """SIGKILL from outside at 6 random moments inside checkpoint saves (each job lets one save
    through, to time it, and is killed within the next; its restart resumes), then a run to the
    end: every restart resumes from the checkpoint `latest` named at the kill, complete, and none
    loads a corrupt one; the run ends with each step's prompts once."""
    import random

    seed = int(os.environ.get("MEGAGRPO_TEST_SEED", time.time_ns() % 100_000))
    rng, out = random.Random(seed), tmp_path / "run"
    checkpoints, argv, log = out / "checkpoints", _saving_every_step(tiny, out, steps=30), tmp_path / "jobs.log"
    kills = []
    while len([k for k in kills if k[1] != "done"]) < 6:
        assert len(kills) < 9, f"seed {seed}: too many kills landed after their save: {kills}"
        tag, where = _kill_inside_a_save(WarmJob(argv, log), checkpoints, rng)
        latest = _latest(checkpoints)
        assert (checkpoints / latest / "COMPLETE").is_file(), (seed, tag, where, latest)
        kills.append((tag, where, latest))
    assert WarmJob(argv, log).wait() == 0
    logs = log.read_text()
    resumed = re.findall(r"resumed from .*(step_\d+) at step", logs)
    assert resumed == [latest for _, _, latest in kills], (seed, kills, resumed)
    assert "could not be loaded" not in logs, seed
    assert sorted(_prompts_by_step(out)) == list(range(1, 31))
    assert logs.count("done: 30 steps") == 1
    print(f"seed {seed}: killed", ", ".join(f"{tag} ({where})" for tag, where, _ in kills))


class _RunsACommand:
    def __reduce__(self):
        return (os.system, ("touch /tmp/megagrpo-unpickled",))


def test_batches_sampled_ahead_load_as_data_and_nothing_else(tmp_path):
    """rollouts_ahead_rank*.json is plain JSON: the batch types come back equal (log-probs to the
    bit); a file with anything else is refused by name, and an old pickled .pt is refused with
    what to do, never unpickled (a checkpoint may come from elsewhere)."""
    import json

    from megagrpo.checkpoints import rollouts_ahead
    from megagrpo.checkpoints.rollouts_ahead import load_rollouts_ahead
    from megagrpo.config.schema import ConfigError
    from megagrpo.policy.batch import Completion
    from megagrpo.rollout.agent import Trajectory
    from megagrpo.rollout.ahead import AheadBatch

    state = {"path": str(tmp_path), "dp_size": 1}
    tool_call = {"type": "function", "function": {"name": "python", "arguments": {"code": "1"}}}
    batches = [AheadBatch(3, [1, 2], [[Completion([1, 2], [-0.1, -1 / 3], False, versions=[2, 3])],
                                      [Trajectory([3, 4], [-1e-300, float("-inf")], True, model_mask=[1, 0],
                                                  messages=[{"role": "assistant", "content": "x",
                                                             "tool_calls": [tool_call]}],
                                                  tool_errors={"timeout": 1}, environment_reward=0.5)]],
                          2, 0.5),
               AheadBatch(4, [5], None, 2, 0.25)]
    rollouts_ahead.save(str(tmp_path), 0, batches)
    loaded = load_rollouts_ahead(state, 0, 1)
    assert loaded == batches and [type(c) for g in loaded[0].groups for c in g] == [Completion, Trajectory]
    path = tmp_path / "rollouts_ahead_rank0.json"
    data = json.loads(path.read_text())
    data["batches"][0]["groups"][0][0]["kind"] = "os.system"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="rollouts_ahead_rank0.json: not batches megagrpo saved .*'os.system'"):
        load_rollouts_ahead(state, 0, 1)
    path.write_bytes(b"\x80\x04not json")
    with pytest.raises(ConfigError, match="rollouts_ahead_rank0.json: not batches megagrpo saved"):
        load_rollouts_ahead(state, 0, 1)
    path.unlink()
    torch.save([_RunsACommand()], tmp_path / "rollouts_ahead_rank0.pt")  # the old format
    with pytest.raises(ConfigError, match="rollouts_ahead_rank0.pt: batches sampled ahead in the old pickled "
                                          "format.*Resume from a checkpoint saved by this version"):
        load_rollouts_ahead(state, 0, 1)
    assert not os.path.exists("/tmp/megagrpo-unpickled")
