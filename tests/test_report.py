"""Where a run's numbers go and how they look: one 2-rank run (torchrun, ZeRO-3,
vLLM) with logging.report_to=[tensorboard, jsonl, wandb] (W&B offline) writes the same metric
names, steps and values to all three sinks (read back: TensorBoard's event files, metrics.jsonl,
the offline W&B run's transaction log); its log has one compact progress line per logged step
(stdout is a pipe, not a terminal); `megagrpo report` renders every panel, and headless
Chromium shows the page with nothing on its console."""
import json
import os
import re
import sys

import pytest
from conftest import PYTHON, ROOT, run, tiny_overrides, torchrun

sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))

PANELS = ("reward", "kl", "entropy", "clipping", "lengths", "importance_sampling", "optimizer", "step_time",
          "held_out")


def _last_values(rows):
    """{(step, name): value}, a name logged twice at one step (eval_steps and the final eval) by
    its last value, as W&B keeps it."""
    out = {}
    for row in rows:
        step = row["step"]
        out.update({(step, k): v for k, v in row.items() if k != "step"})
    return out


@pytest.fixture(scope="module")
def logged_run(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "run"
    # cold ranks: test_every_sink_gets_the_same_metrics holds the start-up timeline's imports
    proc = run([*torchrun(2, "-m", "megagrpo.train", warm=False),
                "--config", "configs/tiny_arith.yaml", *tiny_overrides(tiny, out),
                "grpo.per_device_train_batch_size=16", "grpo.max_steps=4", "logging.eval_steps=2",
                "logging.report_to=[tensorboard,jsonl,wandb]", "logging.progress_bar=true",
                "logging.wandb_tags=[ci]", "checkpoint.save_hf_at_end=false"],
               env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    return out, proc


@pytest.mark.multirank
def test_every_sink_gets_the_same_metrics(logged_run):
    from runs import rows as logged_rows
    from runs import tensorboard_scalars
    from wandb_offline import read_run  # tests/helpers

    out, proc = logged_run
    rows = logged_rows(out)
    assert [r["step"] for r in rows if "train/reward" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "eval/reward" in r] == [2, 4, 4]  # eval_steps, then the final eval
    jsonl = _last_values(rows)
    tensorboard = tensorboard_scalars(out)
    tb = _last_values({"step": s, name: v} for name, events in tensorboard.items() for s, v in events)
    assert tb.keys() == jsonl.keys()
    assert all(tb[key] == pytest.approx(jsonl[key], rel=1e-6, abs=1e-30) for key in jsonl)  # TB stores float32
    wandb = read_run(str(out / "wandb"))
    history = _last_values({"step": r["_step"], **{k: v for k, v in r.items() if not k.startswith("_")}}
                           for r in wandb["history"])
    assert history.keys() == jsonl.keys()
    assert all(history[key] == pytest.approx(jsonl[key], rel=1e-12) for key in jsonl)
    assert (wandb["project"], wandb["name"], wandb["tags"]) == ("megagrpo", "run", ["ci"])
    # the start-up timeline: the slowest rank's phases at step 0, summing to its total, and on the console
    startup = rows[0]
    phases = ["imports", "config", "distributed", "data", "policy", "generator", "resume", "weight_sync"]
    assert list(startup) == ["step", *(f"startup/{p}_s" for p in phases), "startup/total_s"] and startup["step"] == 0
    assert sum(startup[f"startup/{p}_s"] for p in phases) == pytest.approx(startup["startup/total_s"], abs=1e-6)
    assert startup["startup/imports_s"] > 0.5 and startup["startup/generator_s"] > 0.5, startup
    ready = re.search(r"\[megagrpo\] ready in ([\d.]+) s from the process start: imports [\d.]+, config", proc.stdout)
    assert ready and float(ready.group(1)) == round(startup["startup/total_s"], 1), proc.stdout[-3000:]
    assert wandb["config"]["grpo"]["max_steps"] == 4 and wandb["config"]["logging"]["report_to"] == [
        "tensorboard", "jsonl", "wandb"]  # the resolved config
    # stdout is a pipe: one compact line per logged step, no progress bar
    progress = [line for line in proc.stdout.splitlines() if line.startswith("[megagrpo] step ")]
    assert [line.split()[2] for line in progress] == ["1/4", "2/4", "3/4", "4/4"], proc.stdout[-2000:]
    assert "\r" not in proc.stdout + proc.stderr


@pytest.mark.multirank
def test_report_renders_every_panel_and_the_browser_shows_it(logged_run, tmp_path):
    from browser import screenshot
    from PIL import Image, ImageStat

    out, _ = logged_run
    proc = run([PYTHON, "-m", "megagrpo.cli", "report", str(out)])
    page = out / "report" / "report.html"
    assert f"report: {page}" in proc.stdout
    text = page.read_text()
    for key in PANELS:
        assert f'id="panel-{key}"' in text and (out / "report" / f"{key}.png").is_file(), key
        section = text.split(f'id="panel-{key}"')[1].split("</section>")[0]
        assert "data:image/png;base64," in section, f"panel {key} has no plot"
    assert 'id="panel-samples"' in text and text.count("<tr>") == 6  # the header and 5 held-out samples
    assert "src=\"http" not in text and "src=\"file" not in text  # self-contained
    # the capture works: a page that throws shows up on the console
    broken = tmp_path / "broken.html"
    broken.write_text("<html><body><script>throw new Error('report-test')</script></body></html>")
    _, _, console = screenshot(broken, tmp_path, "broken")
    assert any("report-test" in line for line in console), console
    proc, shot, console = screenshot(page, tmp_path, "report")
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    assert console == [], console
    image = Image.open(shot).convert("L")
    assert image.size == (1200, 3000) and ImageStat.Stat(image).stddev[0] > 10  # not blank
    assert len(image.getcolors(2**20)) > 50


def test_report_without_metrics_names_the_fix(tmp_path):
    proc = run([PYTHON, "-m", "megagrpo.cli", "report", str(tmp_path)], check=False)
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.multirank
def test_report_skips_a_torn_last_line_and_names_a_bad_one(logged_run, tmp_path):
    """A run killed while writing metrics.jsonl leaves its last line torn: the report skips it
    and says so; a bad line before the last is an error naming its line."""
    from megagrpo.run_logs import RunLogError, read_jsonl, read_series

    out, _ = logged_run
    rows = open(out / "metrics.jsonl").read()
    (tmp_path / "metrics.jsonl").write_text(rows + '{"step": 5, "train/lo')
    warnings = []
    assert read_jsonl(str(tmp_path / "metrics.jsonl"), warn=warnings.append) == [
        json.loads(line) for line in rows.splitlines()]
    assert len(warnings) == 1 and f"skipped the last line of {tmp_path / 'metrics.jsonl'}" in warnings[0]
    assert read_series(str(tmp_path))["train/loss"] == read_series(str(out))["train/loss"]
    lines = rows.splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join([lines[0], '{"step": 1, "tra', *lines[1:]]) + "\n")
    with pytest.raises(RunLogError, match=r"metrics.jsonl, line 2: not JSON"):
        read_series(str(tmp_path))


def test_report_to_names_are_checked(tiny, tmp_path):
    from megagrpo.config.schema import ConfigError
    from megagrpo.validation import load_config
    base = tiny_overrides(tiny, tmp_path)
    assert load_config("configs/tiny_arith.yaml", base + ["report_to=none"]).logging.report_to == []
    assert load_config("configs/tiny_arith.yaml", base + ["report_to=wandb"]).logging.report_to == ["wandb"]
    assert load_config("configs/tiny_arith.yaml", base).logging.report_to == ["tensorboard", "jsonl"]
    with pytest.raises(ConfigError, match="unknown sink 'mlflow'"):
        load_config("configs/tiny_arith.yaml", base + ["report_to=[tensorboard,mlflow]"])


def test_a_resume_cuts_the_run_logs_back_to_its_checkpoint(tmp_path):
    """cut_logs_after: the rows after the resumed step go from each run log, and a torn last
    line with them; the rest is kept byte for byte."""
    from megagrpo.run_logs import cut_logs_after

    metrics = [{"step": 0, "startup/total_s": 9.5}, *({"step": s, "train/loss": s / 10} for s in range(1, 6))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics) + '{"step": 6, "tr')
    (tmp_path / "prompts_seen.jsonl").write_text("".join(json.dumps({"step": s, "prompts": [s]}) + "\n"
                                                         for s in range(1, 5)))
    cut_logs_after(str(tmp_path), 3)
    assert [json.loads(line) for line in open(tmp_path / "metrics.jsonl")] == metrics[:4]
    assert [json.loads(line)["step"] for line in open(tmp_path / "prompts_seen.jsonl")] == [1, 2, 3]
    assert not (tmp_path / "eval_history.jsonl").exists()
