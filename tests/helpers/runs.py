"""What a finished run wrote, read back for the tests: its metrics (metrics.jsonl, which every
run writes beside TensorBoard, with the values at full precision) and one check that two runs
are the same run. tensorboard() reads the TensorBoard sink itself, for the tests of that sink.

    values(out, "train/loss")          -> [1.23, 1.19]   (step order)
    series(out, "train/loss")          -> [(1, 1.23), (2, 1.19)]
    assert_same_run(got, expected, loss_atol=1e-5, grad_norm_rtol=1e-4, param_atol=1e-5)
"""
import ast
import json
import math
import os
import re
from typing import Optional

import torch
from safetensors.torch import load_file

# what the same completions give: the rewards and the completions' lengths, per step
COMPLETION_METRICS = ("train/reward", "train/reward_std", "train/completions/mean_length",
                      "train/completions/min_length", "train/completions/max_length",
                      "train/completions/clipped_ratio")


def rows(out) -> list[dict]:
    """The run's metrics.jsonl as logged: one {"step": N, name: value, ...} per logged step."""
    path = os.path.join(out, "metrics.jsonl")
    assert os.path.isfile(path), f"{path}: no metrics.jsonl (logging.report_to without jsonl?)"
    with open(path) as f:
        return [json.loads(line) for line in f]


def metrics(out) -> dict[str, list[tuple[int, float]]]:
    """Every metric of the run in `out`: name -> [(step, value)], from its metrics.jsonl."""
    found: dict[str, list] = {}
    for row in rows(out):
        for name, value in row.items():
            if name != "step":
                found.setdefault(name, []).append((row["step"], value))
    return found


def series(out, name: str) -> list[tuple[int, float]]:
    """(step, value) of one metric; [] when the run never logged it."""
    return metrics(out).get(name, [])


def values(out, name: str) -> list[float]:
    return [v for _, v in series(out, name)]


def tensorboard(out):
    """The run's TensorBoard events, loaded whole (EventAccumulator: .Scalars(tag), .Tags()), for
    the tests of that sink itself (it stores float32; metrics() has the values as computed)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def tensorboard_scalars(out) -> dict[str, list[tuple[int, float]]]:
    """metrics(), as the TensorBoard sink holds them: name -> [(step, value)]."""
    events = tensorboard(out)
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def samples(out) -> dict[int, tuple[object, list[tuple[float, str]]]]:
    """The sample tables the run logged (logging.sample_steps; TensorBoard text, as
    metrics.samples_markdown writes them): step -> (the prompt, [(reward, completion)]), each
    cut at 300 characters (a completion of 300 may be cut)."""
    events, found = tensorboard(out), {}
    for event in events.Tensors("samples/text_summary"):
        text = event.tensor_proto.string_val[0].decode()
        head, *lines = text.splitlines()
        assert head.startswith("**prompt:** "), text
        table = [re.fullmatch(r"\| (-?\d+\.\d{3}) \| (.*) \|", line) for line in lines[3:]]
        assert table and all(table), text
        found[event.step] = (ast.literal_eval(head[len("**prompt:** "):]),
                             [(float(m[1]), ast.literal_eval(m[2])) for m in table])
    return found


def exported(out, checkpoint: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The run's HF export's tensors (output_dir/hf/model.safetensors), or with `checkpoint`
    (a tag: step_00000002) that checkpoint's, whole (megagrpo convert's reader, in process)."""
    if checkpoint is None:
        return load_file(os.path.join(out, "hf", "model.safetensors"))
    from megagrpo.checkpoints.convert import hf_tensors

    tensors = dict(hf_tensors(os.path.join(out, "checkpoints", checkpoint)))
    head, embedding = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if head is not None and embedding is not None and torch.equal(head, embedding):
        del tensors["lm_head.weight"]  # a tied head: ZeRO 0-2 files hold it under both names, ZeRO-3 once
    return tensors


def _close(got: list, expected: list, atol: float = 0.0, rtol: float = 0.0) -> bool:
    return len(got) == len(expected) and all(
        math.isclose(a, b, rel_tol=rtol, abs_tol=atol) if atol or rtol else a == b for a, b in zip(got, expected))


def _at(rows: list, steps: Optional[list[int]]) -> list:
    return rows if steps is None else [(s, v) for s, v in rows if s in steps]


def assert_same_run(got, expected, *, loss_atol: float = 0.0, loss_rtol: float = 0.0, grad_norm_rtol: float = 0.0,
                    param_atol: float = 0.0, steps: Optional[list[int]] = None, checkpoint: Optional[str] = None,
                    completions: bool = True) -> dict:
    """The runs in `got` and `expected` are the same run, exactly unless a tolerance is given:
    at every step (or those in `steps`, for a run resumed from the other's checkpoint) the
    loss, the gradient norm (none zero: a norm reported as 0 hides a missing gradient), the
    prompts (prompts_seen.jsonl) and the completions' rewards and lengths; and every exported
    parameter (the same names, shapes and dtypes: whole, not shards), or with `checkpoint`
    every parameter of that checkpoint (runs without an export). Returns got's tensors."""
    mine, theirs = metrics(got), metrics(expected)
    tolerances = {"train/loss": {"atol": loss_atol, "rtol": loss_rtol}, "train/grad_norm": {"rtol": grad_norm_rtol}}
    for name, tolerance in tolerances.items():
        a, b = _at(mine.get(name, []), steps), _at(theirs.get(name, []), steps)
        assert b and [s for s, _ in a] == [s for s, _ in b], (name, a, b)
        assert _close([v for _, v in a], [v for _, v in b], **tolerance), f"{name}: {a} != {b} ({tolerance})"
    assert all(v > 0 for _, v in theirs["train/grad_norm"]), theirs["train/grad_norm"]
    if completions:
        for name in COMPLETION_METRICS:
            assert _at(mine.get(name, []), steps) == _at(theirs.get(name, []), steps), (name, mine.get(name),
                                                                                     theirs.get(name))
    seen = [[row for row in map(json.loads, open(os.path.join(out, "prompts_seen.jsonl")))
             if steps is None or row["step"] in steps] for out in (got, expected)]
    assert seen[0] == seen[1] and seen[1], seen
    a, b = exported(expected, checkpoint), exported(got, checkpoint)
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for name in a:
        assert a[name].shape == b[name].shape and a[name].dtype == b[name].dtype, name  # whole, not tp shards
        torch.testing.assert_close(b[name], a[name], atol=param_atol, rtol=0, msg=name)
    return b
