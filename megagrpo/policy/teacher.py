"""The teacher of on-policy distillation (docs/distillation.md): its rules, and the config it is
built from in the job.

The policy samples; the teacher scores every sampled token; coef x (log p_teacher - log
p_policy) joins the token's advantage (algorithm/grpo.distillation_advantages). The teacher
runs in the job (teacher.model: built by the policy as the frozen reference is, policy/zero.py)
or behind a URL (teacher.url: rollout/teacher_server.py). Either way it reads the policy's
token ids, so both must share one vocabulary: a teacher with another tokenizer is refused here,
before anything is built, rather than mapped between vocabularies.

Its log-probs are at temperature 1 (the teacher's own distribution, which is also what a
server's prompt log-probs are), whatever rollout.temperature the policy samples at.
"""
from __future__ import annotations

import dataclasses
import os

from megagrpo.config.schema import Config, ConfigError, has_teacher, require


def teacher_config(cfg: Config) -> Config:
    """The run's config as the teacher is built from it: the teacher's folder in place of the
    policy's, no adapters, its log-probs at temperature 1."""
    model = dataclasses.replace(cfg.model, name_or_path=cfg.teacher.model,
                                lora=dataclasses.replace(cfg.model.lora, r=0))
    return dataclasses.replace(cfg, model=model, rollout=dataclasses.replace(cfg.rollout, temperature=1.0))


def check_teacher(cfg: Config) -> None:
    """The teacher section's rules; teacher.model's tokenizer is compared with the policy's."""
    t = cfg.teacher
    if not has_teacher(cfg):
        return
    require(not (t.model and t.url), f"teacher.model ({t.model}) and teacher.url ({t.url}) are both set: "
            "the teacher runs in the job or behind a server, keep one")
    require(t.coef > 0, f"teacher.coef: {t.coef} must be > 0 (to train without a teacher, unset teacher.model "
            "and teacher.url)")
    require(t.task_weight >= 0, f"teacher.task_weight: {t.task_weight} must be >= 0 (0: distillation alone)")
    require(t.disagreement_nats > 0, f"teacher.disagreement_nats: {t.disagreement_nats} must be > 0")
    require(t.timeout_s > 0 and t.retries >= 0,
            f"teacher.timeout_s ({t.timeout_s}) must be > 0 and teacher.retries ({t.retries}) >= 0")
    require(cfg.parallel.pipeline_parallel_size == 1,
            "teacher: distillation under pipeline parallelism is not built yet (the teacher's "
            "log-probs would travel to the last stage with each micro-batch); use "
            "parallel.pipeline_parallel_size=1 with ZeRO-3 and tensor parallelism")
    if t.url:
        require(t.url.startswith(("http://", "https://")),
                f"teacher.url: '{t.url}' is not an http(s) URL, e.g. http://node7:8001")
        return
    require(os.path.isfile(os.path.join(t.model, "config.json")),
            f"teacher.model: '{t.model}' has no config.json; point it at the teacher's HF folder")
    if os.path.isdir(cfg.model.name_or_path):
        check_same_vocabulary(cfg.model.name_or_path, t.model)


def check_same_vocabulary(student: str, teacher: str) -> None:
    """Refuse a teacher whose tokenizer maps any token to another id than the student's does."""
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(student).get_vocab()
    theirs = AutoTokenizer.from_pretrained(teacher).get_vocab()
    if ours == theirs:
        return
    differ = sorted(token for token in ours.keys() | theirs.keys() if ours.get(token) != theirs.get(token))
    examples = ", ".join(f"{token!r}: {ours.get(token)} vs {theirs.get(token)}" for token in differ[:3])
    raise ConfigError(
        f"teacher.model: '{teacher}' has another tokenizer than the policy '{student}': {len(differ)} tokens "
        f"have different ids ({examples}; policy vs teacher). The teacher scores the policy's token ids, so "
        "both must share one vocabulary: pick a teacher of the policy's family (megagrpo does not map "
        "between vocabularies)")
