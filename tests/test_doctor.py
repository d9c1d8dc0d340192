"""The run doctor (megagrpo/doctor.py) on runs made to fail, one way each: one-rank runs of the
warm tiny model (vLLM co-located) whose settings break them as users break theirs. Each run's
checks fire, on its console and in every sink, and `megagrpo doctor` finds the same afterwards;
the report shows them in Chromium. The quiet side, a healthy run raising nothing, is the tiny
quickstart's (tests/test_train_quickstart.py)."""
import json
import math
import os
import re
import shutil

import pytest
from conftest import PYTHON, ROOT, run, tiny_overrides

from megagrpo.config.schema import Config, ConfigError
from megagrpo.doctor import CHECKS, Doctor, check_doctor, examine

HELPERS = {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "helpers")])}  # noisy_reward
SHORT = ["checkpoint.save_steps=0", "checkpoint.save_hf_at_end=false", "data.eval_file=null",
         "grpo.per_device_train_batch_size=32", "logging.report_to=[tensorboard,jsonl]"]

# name -> (what breaks it, the checks it must raise, the checks it must not)
FAILING_RUNS = {
    # a learning rate 100x the quickstart's, with a strong KL penalty pulling back: KL and grad norm explode
    "unstable": (["grpo.learning_rate=0.02", "grpo.kl_coef=1.0", "grpo.max_steps=3"],
                 {"kl", "grad_spike"}, {"reward_swing", "memory"}),
    # a learning rate 50,000x: the policy collapses onto one looping answer
    "collapse": (["grpo.learning_rate=10", "grpo.max_steps=6", "doctor.max_plan_memory=0.2"],
                 {"entropy", "repetition", "zero_advantage", "kl", "memory"}, {"reward_swing", "sampler_gap"}),
    # bfloat16 and a learning rate 2,500x: vLLM's and the trainer's kernels part ways on the broken weights.
    # Where the policy collapses at once (entropy 0 from step 3, seen in CI), the gap left is bf16's own
    # before the collapse (1.6e-3 and 3.7e-3 nats per token at steps 1 and 2; fp32's is 3e-7 to 4e-7), so
    # the threshold sits under it
    "sampler": (["model.dtype=bfloat16", "grpo.learning_rate=0.5", "grpo.max_steps=5",
                 "doctor.max_sampler_gap=0.0005"],
                {"sampler_gap"}, {"reward_swing"}),
    # a reward that is a coin flip, 4 completions a step; and a node-memory threshold it is sure to pass
    "noisy": (["rewards.functions=[noisy_reward:coin_flip]", "grpo.per_device_train_batch_size=4",
               "grpo.num_generations=4", "grpo.max_steps=7", "doctor.max_node_memory=0.01"],
              {"reward_swing", "memory"}, {"kl", "entropy", "grad_spike", "sampler_gap", "repetition"}),
}


@pytest.fixture(scope="module")
def failing_runs(tiny, tmp_path_factory):
    runs = {}
    for name, (settings, _, _) in FAILING_RUNS.items():
        out = tmp_path_factory.mktemp("doctor") / name
        proc = run([PYTHON, "-m", "megagrpo.train", "--config", "configs/tiny_arith.yaml",
                    *tiny_overrides(tiny, out), *SHORT, *settings], env=HELPERS)
        runs[name] = (out, proc)
    return runs


def _console_findings(stdout: str) -> list[str]:
    return [line.removeprefix("[megagrpo] ") for line in stdout.splitlines() if line.startswith("[megagrpo] doctor:")]


@pytest.mark.parametrize("name", list(FAILING_RUNS))
def test_each_check_fires_on_its_failing_run(failing_runs, name):
    out, proc = failing_runs[name]
    _, expected, quiet = FAILING_RUNS[name]
    lines = _console_findings(proc.stdout)
    checks = [json.loads(row) for row in open(out / "metrics.jsonl")]
    logged = {key.removeprefix("doctor/") for row in checks for key in row if key.startswith("doctor/")}
    assert expected <= logged and not logged & quiet, (name, logged, "\n".join(lines))
    assert len(lines) == len(set(lines)) == sum(1 for row in checks for key in row if key.startswith("doctor/"))
    for line in lines:  # one line: what, when, the likely cause, the fix with a config key
        assert re.match(r"doctor: step \d+: .+\. Likely cause: .+\. Fix: .*\b(grpo|rollout|model|data|rewards)\.\w+",
                        line), line
    # the same findings afterwards, from metrics.jsonl and config.yaml
    doctor = run([PYTHON, "-m", "megagrpo.cli", "doctor", str(out)], check=False)
    assert doctor.returncode == 1, doctor.stderr
    assert _console_findings("\n".join("[megagrpo] " + line for line in doctor.stdout.splitlines())) == lines
    assert f"{len(lines)} finding" in doctor.stdout.splitlines()[-1]


def test_every_check_has_a_failing_run_but_non_finite():
    covered = set().union(*(expected for _, expected, _ in FAILING_RUNS.values()))
    assert set(CHECKS) - covered == {"non_finite"}  # no run goes NaN on purpose: its test is below


def test_a_loss_gone_nan_is_named(failing_runs, tmp_path):
    """A run that went NaN at step 3 (its log, with step 3's loss and grad norm made NaN): found
    once, at step 3; its fixes name the keys."""
    out, _ = failing_runs["unstable"]
    shutil.copy(out / "config.yaml", tmp_path / "config.yaml")
    rows = [json.loads(row) for row in open(out / "metrics.jsonl")]
    for row in rows:
        if row["step"] >= 3 and "train/loss" in row:
            row["train/loss"] = row["train/grad_norm"] = math.nan
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    findings, steps = examine(str(tmp_path))
    nan = [f for f in findings if f.check == "non_finite"]
    assert steps == 3 and len(nan) == 1 and nan[0].step == 3 and "loss and grad_norm went non-finite" in nan[0].seen
    assert "grpo.learning_rate (now 0.02)" in nan[0].fix


def test_a_finding_opens_once_per_episode():
    """The KL over 0.8 at steps 3-4 and 12: two episodes (the window of clear steps between
    them ends the first), one line each."""
    doctor = Doctor(Config())
    kls = {3: 1.2, 4: 1.5, 12: 0.9}
    opened = [f.step for s in range(1, 16) for f in doctor.observe(s, {"train/kl": kls.get(s, 0.1)})]
    assert opened == [3, 12]
    doctor = Doctor(Config())
    assert [f.step for s in range(1, 16) for f in doctor.observe(s, {"train/kl": 1.0 if s in (3, 6) else 0.1})] == [3]


def test_doctor_settings_are_checked_and_overridden(failing_runs):
    config = Config()
    config.doctor.window = 1
    with pytest.raises(ConfigError, match="doctor.window: 1 must be >= 2"):
        check_doctor(config.doctor)
    config.doctor.window, config.doctor.max_zero_advantage = 5, 1.5
    with pytest.raises(ConfigError, match=r"doctor.max_zero_advantage: 1.5 must be in \[0, 1\]"):
        check_doctor(config.doctor)
    out, _ = failing_runs["unstable"]
    found = {f.check for f in examine(str(out))[0]}
    assert "kl" in found and {f.check for f in examine(str(out), ["doctor.kl_max=100"])[0]} == found - {"kl"}
    bad = run([PYTHON, "-m", "megagrpo.cli", "doctor", str(out), "grpo.kl_coef=1"], check=False)
    assert bad.returncode == 2 and "only doctor.* thresholds" in bad.stderr
    missing = run([PYTHON, "-m", "megagrpo.cli", "doctor", str(out / "nowhere")], check=False)
    assert missing.returncode == 2 and "no metrics.jsonl" in missing.stderr and "Traceback" not in missing.stderr


def test_the_report_opens_with_the_findings_and_chromium_shows_them(failing_runs, tmp_path):
    from browser import screenshot
    from PIL import Image, ImageStat

    out, _ = failing_runs["unstable"]
    proc = run([PYTHON, "-m", "megagrpo.cli", "report", str(out)])
    findings, _ = examine(str(out))
    assert f"health: {len(findings)} findings of the run doctor" in proc.stdout
    text = (out / "report" / "report.html").read_text()
    health = text.split('id="panel-health"')[1].split("</section>")[0]
    assert text.index('id="panel-health"') < text.index('id="panel-reward"')  # at the top
    for i, finding in enumerate(findings):
        block = health.split(f'id="finding-{i}"')[1].split("</div>")[0]
        assert f"step {finding.step}" in block and "data:image/png;base64," in block, finding
    shot_proc, shot, console = screenshot(out / "report" / "report.html", tmp_path, "health", height=1400)
    assert shot_proc.returncode == 0 and console == [], console
    image = Image.open(shot).convert("L")
    assert ImageStat.Stat(image).stddev[0] > 10 and len(image.getcolors(2**20)) > 50


def test_a_quiet_run_reports_no_findings(failing_runs, tmp_path):
    """The noisy run's first 4 steps (before its window fills, with the default thresholds):
    no finding, exit 0, and the report says the checks passed."""
    out, _ = failing_runs["noisy"]
    rows = [json.loads(row) for row in open(out / "metrics.jsonl")]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 4))
    proc = run([PYTHON, "-m", "megagrpo.cli", "doctor", str(tmp_path)])
    assert proc.stdout.strip() == (f"megagrpo doctor: 0 findings in 4 training steps of {tmp_path} "
                                   f"({len(CHECKS)} checks)")
    run([PYTHON, "-m", "megagrpo.cli", "report", str(tmp_path)])
    assert f"the run doctor's {len(CHECKS)} checks passed on 4 training steps" in (
        tmp_path / "report" / "report.html").read_text()


def test_repetition_measures_match_their_definition():
    """metrics.repetition (hashed n-grams in torch) against the definition in plain Python."""
    import torch

    from megagrpo.metrics import repetition

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 6, (12, 20), generator=generator)  # a small vocabulary: repeats happen
    ids[0] = torch.tensor([5, 6, 7, 8] * 5)  # a loop
    ids[4:8] = ids[4]  # a group of four identical completions
    lens = torch.randint(0, 21, (12,), generator=generator)
    lens[0], lens[4:8] = 20, 20

    def grams(row, n):
        return [tuple(row[i:i + n]) for i in range(len(row) - n + 1)]

    rows = [r[:n].tolist() for r, n in zip(ids, lens.tolist())]
    want_repeated = [1 - len(set(grams(r, 4))) / len(grams(r, 4)) if len(r) >= 4 else 0.0 for r in rows]
    want_distinct = []
    for start in range(0, 12, 4):
        bigrams = [g for r in rows[start:start + 4] for g in grams(r, 2)]
        want_distinct += [len(set(bigrams)) / len(bigrams) if bigrams else 1.0] * 4
    repeated, distinct = repetition(ids, lens, 4)
    assert repeated.tolist() == pytest.approx(want_repeated) and distinct.tolist() == pytest.approx(want_distinct)
    assert repeated[0] == pytest.approx(1 - 4 / 17) and distinct[4] == pytest.approx(len(set(grams(rows[4], 2))) / 76)
