"""A whole configuration checked before anything is built, and the loader that every entry
point uses. Each part of the system keeps its own rules beside its code; this calls them in
order, so that config/ itself imports nothing above it."""
from __future__ import annotations

from typing import Optional

from megagrpo.cluster.generator_layout import GeneratorLayout
from megagrpo.cluster.layout import check_layout
from megagrpo.config.loading import read_config
from megagrpo.config.schema import Config
from megagrpo.config.validation import check_config
from megagrpo.doctor import check_doctor
from megagrpo.metrics import check_report_to
from megagrpo.policy.lora import check_lora
from megagrpo.policy.moe import check_moe
from megagrpo.policy.teacher import check_teacher
from megagrpo.rewards import check_reward_names
from megagrpo.rollout.outside_agents import check_outside_agent
from megagrpo.rollout.tools import check_tools


def validate(cfg: Config, training: bool = True, planning: bool = False) -> GeneratorLayout:
    """Every rule, config's own first (training=False: `megagrpo eval`, which needs no reward
    function; planning: a dry run, where data files not prepared yet are a warning). Nothing
    is written into the config: what a rule resolves it returns (the generator's layout)."""
    check_config(cfg, training, planning)
    check_lora(cfg)
    check_moe(cfg)
    check_teacher(cfg)
    check_report_to(cfg.logging.report_to)
    check_doctor(cfg.doctor)
    check_reward_names(cfg.rewards.functions)
    check_tools(cfg)
    layout = check_layout(cfg)
    check_outside_agent(cfg, layout.ranks_per_group)
    return layout


def load_config(path: Optional[str], overrides: list[str] = (), training: bool = True,
                planning: bool = False) -> Config:
    """Read the YAML and the `key.sub=value` overrides (config/loading.py) and validate."""
    cfg = read_config(path, overrides)
    validate(cfg, training, planning)
    return cfg
