"""On-policy distillation (teacher section; megagrpo/policy/teacher.py, rollout/teacher_server.py,
algorithm/grpo.distillation_advantages): the per-token advantage against hand-computed
log-probs; the teacher's log-probs from the job's engine and from a real `vllm serve` of it, token
for token; runs that distil from each, equal where they must be; a student that reaches its
teacher; LoRA under ZeRO-3 on two ranks with batches sampled ahead; the rules.

The teacher is built here: the tiny model warm-started on worked answers only (the demo data
with --worked-share 1), which answers the held-out additions nearly always right, while the
student (the suite's warm model) mostly guesses wrong."""
import json
import os
import sys

import pytest
import torch
from conftest import PYTHON, ROOT, run, tiny_overrides, torchrun
from runs import values

from megagrpo.algorithm import grpo
from megagrpo.algorithm.loss import LossInputs, StepStats, declare_stats, micro_batch_loss
from megagrpo.config.loading import read_config
from megagrpo.config.schema import ConfigError, GRPOConfig, TeacherConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))
import daemons  # noqa: E402


@pytest.fixture(scope="module")
def teacher(tiny, tmp_path_factory):
    """The tiny model warm-started on worked (right) answers only."""
    base = tmp_path_factory.mktemp("teacher")
    run([PYTHON, "tools/make_demo_data.py", "--out", str(base / "data"), "--worked-share", "1"])
    run([PYTHON, "tools/warm_start.py", "--model", tiny["model"], "--data", str(base / "data" / "sft.jsonl"),
         "--out", str(base / "teacher"), "--steps", "300"])
    return str(base / "teacher")


@pytest.fixture(scope="module")
def teacher_server(teacher, tmp_path_factory):
    with daemons.vllm_server(teacher, tmp_path_factory.mktemp("teacher_server")) as url:
        yield url


def test_distillation_advantages_are_the_formula():
    advantages = torch.tensor([1.0, -0.5])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -0.3]])
    teacher = torch.tensor([[-0.5, -3.0, -0.5], [-0.1, -2.2, -5.3]])
    got = grpo.distillation_advantages(advantages, old, teacher, coef=0.5, task_weight=1.0)
    # 1 x A_i + 0.5 x (teacher - old), worked by hand
    assert torch.allclose(got, torch.tensor([[1.25, 0.5, 1.0], [-0.5, -1.5, -3.0]]))
    alone = grpo.distillation_advantages(advantages, old, teacher, coef=1.0, task_weight=0.0)
    assert torch.allclose(alone, torch.tensor([[0.5, -1.0, 0.0], [0.0, -2.0, -5.0]]))


def test_the_loss_takes_the_teachers_token_advantages_and_masks_tool_tokens():
    """grpo loss, one pass (old = the policy's own): L = sum_i mean_t(-A_it) / B, and the gradient
    on each sampled token is -A_it / (T_i B). The last token of row 1 is a tool token (mask 0):
    the teacher's verdict on it changes neither the loss nor the statistics."""
    g = GRPOConfig(loss_type="grpo", kl_coef=0.0)
    t = TeacherConfig(model="teacher", coef=1.0, task_weight=0.0, disagreement_nats=1.5)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -0.3]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -3.0, -0.5], [-0.1, -2.2, -9.0]])
    normalisers = {"num_sequences": 2, "num_tokens": 5.0, "max_sampled_tokens": 3}

    def loss_and_stats(teacher_logp):
        stats = StepStats()
        declare_stats(stats, g, t)
        inputs = LossInputs(mask, torch.tensor([1.0, -1.0]), logp.detach(), None, None, teacher_logp)
        return micro_batch_loss(g, logp, logp.detach() * 0, inputs, normalisers, 1.0, stats, t), stats

    loss, stats = loss_and_stats(teacher)
    # token advantages: [0.5, -1, 0] and [0, -2, (masked)]
    assert loss.item() == pytest.approx(-((0.5 - 1 + 0) / 3 + (0 - 2) / 2) / 2)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5 / 6, 1 / 6, 0.0], [0.0, 2 / 4, 0.0]]))
    out = stats.reduce(lambda tensor, op: tensor)
    assert out["teacher/reverse_kl"] == pytest.approx((-0.5 + 1 + 0 + 0 + 2) / 5)
    assert out["teacher/disagreement"] == pytest.approx(1 / 5)  # only the 2-nat token; the masked 8.7 is not counted
    other = teacher.clone()
    other[1, 2] = 0.0
    again, stats_again = loss_and_stats(other)
    assert again.item() == pytest.approx(loss.item())
    assert stats_again.reduce(lambda tensor, op: tensor) == out


def _config(tiny, tmp_path, *overrides):
    return read_config(os.path.join(ROOT, "configs", "tiny_arith.yaml"),
                       tiny_overrides(tiny, tmp_path) + list(overrides))


def test_engine_and_server_teachers_agree_token_for_token(tiny, tmp_path, teacher, teacher_server):
    """The teacher's log-probs of the same rows: the job's forward pass (policy/logprobs.py, as
    the engine path runs it) and the server's prompt log-probs, within the co-located tolerance."""
    from megagrpo.policy.batch import Completion, make_batch
    from megagrpo.policy.logprobs import completion_logprobs
    from megagrpo.policy.models import DeepSpeedSettings, load_model, load_tokenizer
    from megagrpo.policy.teacher import teacher_config
    from megagrpo.rollout.teacher_server import TeacherServer

    cfg = _config(tiny, tmp_path, f"teacher.url={teacher_server}")
    tokenizer = load_tokenizer(tiny["warm"])
    rows = [("What is 3 + 4?", "3 + 4 = 7. Answer: 7"), ("Compute 9 + 4.", "Answer: 12"),
            ("What is 1 + 8?", "1 + 8 = 9. Answer: 9 and more words")]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                              add_generation_prompt=True)) for q, _ in rows]
    completions = [Completion(tokenizer.encode(a) + [tokenizer.eos_token_id], [0.0] * (len(tokenizer.encode(a)) + 1),
                              False) for _, a in rows]
    batch = make_batch(prompts, completions, torch.zeros(3), tokenizer.pad_token_id)
    served = TeacherServer(cfg, tokenizer).logprobs(batch)
    cfg.teacher.model = teacher
    model = load_model(teacher_config(cfg), DeepSpeedSettings({})).eval()
    with torch.no_grad():
        local = completion_logprobs(model, batch, 1.0, packing=True, fused=True)[0]
    mask = batch.completion_mask.bool()
    assert (served[mask] < 0).all() and (served[~mask] == 0).all()
    assert (served - local)[mask].abs().max().item() < 1e-4
    # the wrong answer's last digit: the teacher says 12 is unlikely
    assert served[1, len(tokenizer.encode("Answer: 1"))].item() < -2


def _distil(tiny, out, *overrides, ranks=1):
    return run([*torchrun(ranks, "-m", "megagrpo.train"), "--config", "configs/tiny_arith.yaml",
                *tiny_overrides(tiny, out), "logging.sample_steps=0", "checkpoint.save_steps=0",
                "checkpoint.save_hf_at_end=false", *overrides], timeout=600)


@pytest.mark.multirank
def test_a_student_distils_to_its_teacher_in_the_job_and_from_a_server(tiny, tmp_path, teacher, teacher_server):
    """Distillation alone (task_weight 0): the student's held-out accuracy (greedy) goes from
    mostly wrong to within 15 points of always right in 12 steps (bench/distillation_learning.py
    measures the 5). The same run's first 2 steps with the teacher behind the server: the same
    samples, so the same teacher metrics and losses."""
    job = tmp_path / "job"
    _distil(tiny, job, "grpo.max_steps=12", "grpo.kl_coef=0", f"teacher.model={teacher}", "teacher.task_weight=0")
    results = json.load(open(job / "eval_results.json"))
    assert results["before"]["rewards/answer_match"] < 0.3
    assert results["after"]["rewards/answer_match"] >= 0.85, results["after"]
    reverse_kl = values(job, "train/teacher/reverse_kl")
    assert len(reverse_kl) == 12 and min(reverse_kl[-3:]) < reverse_kl[0] / 2, reverse_kl
    assert all(0 <= share <= 1 for share in values(job, "train/teacher/disagreement"))
    assert values(job, "train/time/teacher")

    served = tmp_path / "served"
    _distil(tiny, served, "grpo.max_steps=2", "grpo.kl_coef=0", f"teacher.url={teacher_server}",
            "teacher.task_weight=0", "data.eval_file=null")
    for name in ("train/teacher/reverse_kl", "train/teacher/disagreement", "train/loss"):
        assert values(served, name) == pytest.approx(values(job, name)[:2], abs=1e-4), name


@pytest.mark.multirank
def test_a_lora_student_distils_under_zero3_on_two_ranks_with_batches_sampled_ahead(tiny, tmp_path, teacher):
    """2 training ranks (ZeRO-3, a LoRA student, the teacher partitioned beside it) and a
    generating rank whose server samples each batch one step ahead: the teacher scores what was
    sampled, whatever weights sampled it."""
    out = tmp_path / "lora"
    proc = _distil(tiny, out, "grpo.max_steps=3", "grpo.per_device_train_batch_size=16", "data.eval_file=null",
                   f"teacher.model={teacher}", "teacher.coef=0.5", "model.lora.r=8", "grpo.learning_rate=2e-3",
                   "rollout.placement=disaggregated", "rollout.ranks=1", "rollout.max_staleness=1", ranks=3)
    reverse_kl = values(out, "train/teacher/reverse_kl")
    assert len(reverse_kl) == 3 and all(value > 0 for value in reverse_kl), proc.stdout[-2000:]
    assert values(out, "train/rewards/answer_match/mean")  # the task reward still counted beside the teacher


def test_teacher_rules_refuse_with_the_fix(tiny, tmp_path, teacher):
    from megagrpo.planning import make_plan
    from megagrpo.validation import validate

    def refused(*overrides) -> str:
        with pytest.raises(ConfigError) as e:
            validate(_config(tiny, tmp_path, *overrides))
        return str(e.value)

    assert "keep one" in refused(f"teacher.model={teacher}", "teacher.url=http://localhost:1")
    assert "teacher.coef" in refused(f"teacher.model={teacher}", "teacher.coef=0")
    assert "has no config.json" in refused(f"teacher.model={tmp_path}")
    assert "pipeline" in refused(f"teacher.model={teacher}", "parallel.pipeline_parallel_size=2")
    assert "http(s) URL" in refused("teacher.url=node7:8001")
    other = tmp_path / "other_vocabulary"
    run([PYTHON, "tools/make_tiny_model.py", "--out", str(other), "--corpus",
         os.path.join(tiny["data"], "sft.jsonl"), "--tool-tokens"])
    message = refused(f"teacher.model={other}")
    assert "another tokenizer" in message and "'<tool_call>'" in message, message

    plan = make_plan(_config(tiny, tmp_path, f"teacher.model={teacher}", "teacher.offload=true"), 2)
    assert plan.bytes_per_rank["teacher"] == plan.bytes_per_rank["reference"] > 0  # the same tiny shape, ZeRO-3
    assert plan.offloaded["teacher"] == "teacher.offload"
    assert make_plan(_config(tiny, tmp_path), 2).bytes_per_rank["teacher"] == 0
