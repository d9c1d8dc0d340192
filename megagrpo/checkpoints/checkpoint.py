"""Checkpoints: DeepSpeed's engine state plus the trainer state, saved atomically.

Layout under <output_dir>/checkpoints:
    step_00000004/            DeepSpeed files, trainer_state.json, rng_rank<r>.json, COMPLETE,
                              rollouts_ahead_rank<r>.json (checkpoints/rollouts_ahead.py)
    latest                    the tag of the newest complete checkpoint, replaced by rename

A save goes into `<tag>.tmp`, is fsynced, renamed to `<tag>`, and only then is `latest`
replaced; a crash at any moment leaves the previous checkpoint loadable. A checkpoint without
its COMPLETE marker is reported and skipped, never loaded half. The HF export at the end of a
run: checkpoints/export.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from megagrpo.checkpoints import rollouts_ahead as ahead_file
from megagrpo.checkpoints.autoep import autoep_of, experts_to_autoep, experts_to_hf
from megagrpo.cluster.distributed import all_reduce
from megagrpo.cluster.topology import Topology
from megagrpo.config.schema import ConfigError

MARKER = "COMPLETE"
ADAPTER_CONFIG = "adapter_config.json"  # in a LoRA policy's checkpoint (no base weights)
CRASH_POINTS = ("engine_saved", "marked", "renamed", "latest_written")


@dataclass
class TrainerState:
    """What a checkpoint holds besides DeepSpeed's engine state (trainer_state.json)."""
    step: int
    sampler: dict                  # PromptOrder.state_dict() (the prompts' order)
    world_size: int
    dp_size: int
    num_prompts: int
    total_steps: int
    prompts_per_step: int
    model: str                     # the model folder (absolute) or hub name
    layout: dict = field(default_factory=dict)   # tp, pp, zero_stage, dtype

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _crash_point(name: str, step: int) -> None:
    """Fault injection for the crash-during-save tests: MEGAGRPO_CRASH_AT=<point>:<step>
    SIGKILLs this process at that point of that step's save. Unset in real runs."""
    if os.environ.get("MEGAGRPO_CRASH_AT") == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {"python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "torch": torch.get_rng_state().tolist()}


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def complete_checkpoints(root: str) -> list[str]:
    """Tags of complete checkpoints, oldest first."""
    if not os.path.isdir(root):
        return []
    tags = [d for d in os.listdir(root) if d.startswith("step_") and "." not in d
            and os.path.isfile(os.path.join(root, d, MARKER))]
    return sorted(tags)


def resume_candidates(root: str, log=print) -> list[str]:
    """Complete checkpoints to try, best first: the one `latest` names, then the others from
    the newest (a later one may be complete while `latest` was not yet updated)."""
    latest_file = os.path.join(root, "latest")
    complete = complete_checkpoints(root)
    first = None
    if os.path.isfile(latest_file):
        with open(latest_file) as f:
            tag = f.read().strip()
        if tag in complete:
            first = tag
        else:
            log(f"checkpoint '{os.path.join(root, tag)}' named by latest is incomplete or missing; "
                f"falling back to the newest complete one")
    for tag in sorted(set(os.listdir(root)) - set(complete)) if os.path.isdir(root) else []:
        if tag.startswith("step_"):
            log(f"ignoring incomplete checkpoint '{os.path.join(root, tag)}' (no {MARKER} marker)")
    ordered = ([first] if first else []) + [t for t in reversed(complete) if t != first]
    return [os.path.join(root, t) for t in ordered]



def save(policy, root: str, state: TrainerState, keep_last: int, topo: Topology,
         reference: Optional[dict] = None, rollouts_ahead: Optional[list] = None) -> str:
    """Collective: every rank calls it. Returns the checkpoint folder. `reference`: this rank's
    parts of a moving reference model (grpo.sync_ref_model), saved beside the engine's files;
    `rollouts_ahead`: this rank's batches sampled for later steps (rollout.max_staleness).
    A LoRA policy (policy.adapter_config) saves its adapters and their optimizer state only,
    with PEFT's adapter_config.json; the frozen base weights are left out."""
    engine, adapter_config, is_main, rank = policy.engine, policy.adapter_config, topo.is_main, topo.rank
    step = state.step
    tag = f"step_{step:08d}"
    tmp = f"{tag}.tmp"
    if is_main:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(os.path.join(root, tmp), ignore_errors=True)
    _barrier()
    if adapter_config is None:
        engine.save_checkpoint(root, tag=tmp, save_latest=False)
    else:
        _save_trained_only(engine, root, tmp)
    if adapter_config is not None and is_main:
        with open(os.path.join(root, tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(adapter_config, f, indent=1)
    with open(os.path.join(root, tmp, f"rng_rank{rank}.json"), "w") as f:
        json.dump(rng_state(), f)
    if reference is not None:
        torch.save(reference, os.path.join(root, tmp, f"reference_rank{rank}.pt"))
    if rollouts_ahead is not None:
        ahead_file.save(os.path.join(root, tmp), rank, rollouts_ahead)  # JSON, never pickled
    _barrier()
    if is_main:
        _crash_point("engine_saved", step)
        with open(os.path.join(root, tmp, "trainer_state.json"), "w") as f:
            json.dump(state.to_dict(), f, indent=1)
        with open(os.path.join(root, tmp, MARKER), "w") as f:
            f.write(tag)
        _fsync_tree(os.path.join(root, tmp))
        _crash_point("marked", step)
        final, replaced = os.path.join(root, tag), os.path.join(root, f"{tag}.old")
        if os.path.isdir(final):  # saving the same step again (a finished run resumed)
            shutil.rmtree(replaced, ignore_errors=True)
            os.rename(final, replaced)
        os.rename(os.path.join(root, tmp), final)
        _fsync_dir(root)
        _crash_point("renamed", step)
        _write_atomic(os.path.join(root, "latest"), tag)
        _crash_point("latest_written", step)
        shutil.rmtree(replaced, ignore_errors=True)
        _prune(root, keep_last, current=tag)
    _barrier()
    return os.path.join(root, tag)


def _save_trained_only(engine, root: str, tag: str) -> None:
    """A LoRA policy's engine state without the frozen base. DeepSpeed's exclude_frozen_parameters
    drops the frozen parameters that named_parameters() names, which names a tied weight once:
    the tied head (lm_head.weight, the embedding's alias) stayed in ZeRO 0-2 checkpoints, a whole
    vocabulary x hidden matrix (272 MB for Qwen2.5-0.5B in bf16; docs/upstream-issues.md)."""
    frozen = {n for n, p in engine.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    whole = engine.module_state_dict
    engine.module_state_dict = lambda **kw: {n: t for n, t in whole(**kw).items() if n not in frozen}
    try:
        engine.save_checkpoint(root, tag=tag, save_latest=False, exclude_frozen_parameters=True)
    finally:
        del engine.module_state_dict  # the class's method again


def _prune(root: str, keep_last: int, current: str) -> None:
    """Keep the newest keep_last checkpoints up to `current` (the one `latest` names); a pruned
    checkpoint's universal forms (made when a run re-sharded it: `<tag>.universal`, and
    `<tag>.universal-hf` / `-autoep` with its experts renamed) go with it."""
    tags = [t for t in complete_checkpoints(root) if t <= current]
    for tag in tags[:-keep_last]:
        shutil.rmtree(os.path.join(root, tag), ignore_errors=True)
        for suffix in UNIVERSAL_SUFFIXES:
            shutil.rmtree(os.path.join(root, f"{tag}{suffix}"), ignore_errors=True)


def read_trainer_state(path: str) -> dict:
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)


UNIVERSAL_SUFFIXES = (".universal", ".universal-hf", ".universal-autoep")


def to_universal(path: str, is_main: bool, autoep_preset: Optional[str] = None) -> str:
    """Collective: DeepSpeed's universal form of a ZeRO 1-3 checkpoint (ds_to_universal), made
    once next to it as `<tag>.universal`; returns its folder. A universal checkpoint loads
    under another number of data-parallel ranks, and an AutoTP one also at tp=1. An AutoEP
    checkpoint's experts are whole there ([E, ...], DeepSpeed slices each ep rank's out of them
    at load, for any ep size); `autoep_preset`: the AutoEP preset of the model that will load it
    (None: a model without AutoEP). When the checkpoint was saved with AutoEP and the model has
    none, or the other way round, the experts' parameter names differ: the form made is
    `<tag>.universal-hf` (or `-autoep`), its expert folders renamed and joined or split
    (autoep.experts_to_hf, experts_to_autoep)."""
    import subprocess
    import sys

    saved = autoep_of(path)
    rename = None if (saved is None) == (autoep_preset is None) else ("hf" if saved else "autoep")
    out = f"{path}.universal" + (f"-{rename}" if rename else "")
    error = None
    if is_main and not os.path.isdir(out):
        try:
            tmp = f"{out}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                                   "--input_folder", path, "--output_folder", tmp],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"ds_to_universal failed on '{path}':\n{proc.stderr[-3000:]}")
            if rename == "hf":
                experts_to_hf(os.path.join(tmp, "zero"), *saved)
            elif rename == "autoep":
                experts_to_autoep(os.path.join(tmp, "zero"), autoep_preset)
            os.rename(tmp, out)
        except Exception as e:  # noqa: BLE001 - raised below, after the other ranks passed the barrier
            error = e
    _barrier()  # the other ranks wait here for the main rank's conversion, failed or not
    if error is not None:
        raise error
    if not os.path.isdir(out):
        raise RuntimeError(f"'{out}' was not made: its conversion failed on the main rank")
    return out


def needs_reshard(state: dict, dp: int, tp: int, pp: int, prompts_per_step: int, zero: int, sp: int = 1,
                  ep: int = 1) -> bool:
    """Whether a checkpoint with trainer state `state` must be re-sharded to continue on this
    layout; ValueError says why it cannot. Re-sharding goes through DeepSpeed's universal
    checkpoint: dp may change (same global batch), and a tensor-parallel (AutoTP) checkpoint
    may go to tp=1; both sides ZeRO 1-3, no pipeline. sp may change too (ZeRO partitions over
    dp x sp ranks), and the expert-parallel size ep (AutoEP: the universal form holds each
    layer's experts whole; to_universal renames them when one side has no AutoEP)."""
    saved = state.get("layout", {})
    was_dp, was_tp, was_pp = state.get("dp_size", dp), saved.get("tp", tp), saved.get("pp", pp)
    was_sp, was_ep = saved.get("sp", 1), saved.get("ep", 1)
    if was_pp != pp:
        raise ValueError(f"was saved with pp={was_pp}, this run has pp={pp}; re-sharding across pipeline "
                         "layouts is not supported: resume with the same pipeline_parallel_size")
    if (was_dp, was_tp, was_sp, was_ep) == (dp, tp, sp, ep):
        return False
    experts = (lambda n: f" x ep={n}") if (was_ep, ep) != (1, 1) else (lambda n: "")
    change = f"dp={was_dp} x sp={was_sp} x tp={was_tp}{experts(was_ep)} to dp={dp} x sp={sp} x tp={tp}{experts(ep)}"
    if pp > 1:
        raise ValueError(f"is a pipeline checkpoint; re-sharding it ({change}) is not supported "
                         "(DeepSpeed's universal checkpoint does not load pipeline layer files)")
    if was_tp != tp and tp != 1:
        raise ValueError(f"was saved with tp={was_tp}, this run has tp={tp}; a checkpoint re-shards to "
                         f"tp=1 only (DeepSpeed 0.19.8's universal checkpoint fails to split it for tp={tp}): "
                         f"resume with tensor_parallel_size={was_tp} or 1")
    if state.get("prompts_per_step") != prompts_per_step:
        raise ValueError(f"was saved with dp={was_dp} and {state.get('prompts_per_step', 'an unrecorded number of')} "
                         f"prompts per step; this run has dp={dp} and {prompts_per_step}. To change dp keep "
                         "the global batch: per_device_train_batch_size x dp the same")
    if saved.get("zero_stage", 0) == 0 or zero == 0:
        raise ValueError(f"is a ZeRO-0 checkpoint (or this run uses ZeRO-0); re-sharding it ({change}) goes "
                         "through DeepSpeed's universal checkpoint, which needs ZeRO 1-3 on both sides")
    return True


def load(engine, path: str, rank: int, reshard: bool = False, is_main: bool = False) -> dict:
    """Collective: restore the engine, this rank's RNG; returns the trainer state. With
    reshard, the checkpoint was saved with another dp (or tp, sp, ep, see needs_reshard): it is loaded
    through its universal form, and the ranks' RNG states (which belong to the old ranks) are
    not restored."""
    if not os.path.isfile(os.path.join(path, MARKER)):
        raise FileNotFoundError(f"checkpoint '{path}' is incomplete (no {MARKER} marker)")
    strict = not os.path.isfile(os.path.join(path, ADAPTER_CONFIG))  # LoRA: the base comes from the model folder
    if reshard:
        experts = getattr(engine._config, "expert_parallel_config", None)  # this run's AutoEP, if any
        universal = to_universal(path, is_main, experts.preset_model if experts is not None and experts.enabled
                                 else None)
        engine._config.load_universal_checkpoint = True  # read by engine.load_checkpoint only
        try:
            load_path, _ = engine.load_checkpoint(os.path.dirname(universal), tag=os.path.basename(universal),
                                                  load_module_strict=strict)
        finally:
            engine._config.load_universal_checkpoint = False
        _unshare_adam_steps(engine)
        _fit_schedule_to_groups(engine)
    else:
        load_path, _ = engine.load_checkpoint(os.path.dirname(path), tag=os.path.basename(path),
                                              load_module_strict=strict)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint '{path}'")
    rng_file = os.path.join(path, f"rng_rank{rank}.json")
    if os.path.isfile(rng_file) and not reshard:
        with open(rng_file) as f:
            set_rng_state(json.load(f))
    return read_trainer_state(path)


def _fit_schedule_to_groups(engine) -> None:
    """The learning-rate schedule's per-group lists (base_lrs, _last_lr) fitted to this
    optimizer's parameter groups: DeepSpeed builds the optimizer itself under AutoEP, with
    groups of its own for the experts (3 where a run without AutoEP has 1), so a checkpoint
    re-sharded across expert_parallel_size brings lists of another length. Every group follows
    the one schedule (policy/models.py), so the first entry stands for all."""
    schedule, optimizer = engine.lr_scheduler, getattr(engine, "optimizer", None)
    groups = getattr(optimizer, "param_groups", None)
    if schedule is None or not groups:
        return
    for key in ("base_lrs", "_last_lr"):
        values = getattr(schedule, key, None)
        if isinstance(values, list) and values and len(values) != len(groups):
            setattr(schedule, key, [values[0]] * len(groups))
    for group, lr in zip(groups, schedule._last_lr if hasattr(schedule, "_last_lr") else []):
        group["lr"] = lr


def _unshare_adam_steps(engine) -> None:
    """DeepSpeed 0.19.8's ZeRO-3 universal load (stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3)
    gives every parameter sub-group the same `step` tensor, which torch's Adam then increments in
    place once per sub-group: with several sub-groups (AutoEP's experts and routers are groups of
    their own; a large model's sub_group_size splits too) the step count, so Adam's bias
    correction, runs ahead after the first step (2 sub-groups too many -> step 5 for 3). Each
    sub-group gets its own copy."""
    zero = engine.optimizer
    optimizer, flats = getattr(zero, "optimizer", None), getattr(zero, "fp32_partitioned_groups_flat", None)
    if optimizer is None or not flats:
        return
    for flat in flats:
        state = optimizer.state.get(flat)
        if state and torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def resume(policy, root: str, setting: str, this_run: TrainerState, topo: Topology,
           log: Callable[[str], None]) -> Optional[dict]:
    """Collective: load the checkpoint that `setting` (checkpoint.resume: auto, none or a path)
    names into the policy; returns its trainer state, or None to start fresh. `this_run`: the
    state this run would save now, which the checkpoint's must be able to continue (data,
    layout, adapters). Under auto, a checkpoint that fails to load is reported and the previous
    complete one tried."""
    if setting == "none":
        if complete_checkpoints(root):
            raise ConfigError(f"checkpoint.resume=none but {root} holds checkpoints of an earlier run; "
                              "resume it (checkpoint.resume=auto), use another output_dir, or delete that folder")
        return None
    candidates = resume_candidates(root, log) if setting == "auto" else [setting]
    for path in candidates:
        reshard = _check_resumable(path, this_run, topo)
        try:
            state, error = load(policy.engine, path, topo.rank, reshard, topo.is_main), None
        except Exception as e:  # noqa: BLE001 - whatever DeepSpeed or torch.load raise
            state, error = None, e
        if not all_reduce(torch.tensor([0 if error is None else 1]), "max")[0]:
            note = ""
            if reshard:
                was, sp = state["layout"], (lambda n: f" x sp {n}" if n > 1 else "")
                eps = (was.get("ep", 1), this_run.layout.get("ep", 1))
                ep = (lambda n: f" x ep {n}") if eps != (1, 1) else (lambda n: "")
                note = (f" (re-sharded from dp {state['dp_size']}{sp(was.get('sp', 1))} x tp {was.get('tp', 1)}"
                        f"{ep(eps[0])} to dp {topo.dp_size}{sp(topo.sp_size)} x tp {topo.tp_size}{ep(eps[1])})")
            log(f"resumed from {path} at step {state['step']}{note}")
            return {**state, "path": path, "resharded": reshard}
        if setting != "auto":
            raise ConfigError(f"checkpoint.resume: '{path}' could not be loaded: {error}")
        log(f"checkpoint '{path}' could not be loaded ({error or 'on another rank'}); "
            "trying the previous complete one")
    if candidates:
        raise ConfigError(f"no checkpoint under {root} could be loaded; move the folder away to start over")
    return None


def load_reference(state: dict, rank: int) -> dict:
    """This rank's parts of the moving reference saved with the checkpoint `state` came from
    (resume's return); the reference resumes only on the layout it was saved with."""
    path = os.path.join(state["path"], f"reference_rank{rank}.pt")
    if state.get("resharded"):
        raise ConfigError(f"{state['path']}: grpo.sync_ref_model's reference is saved per rank and resumes on "
                          f"the layout it was saved with (dp {state['dp_size']}, tp {state['layout'].get('tp', 1)}, "
                          f"pp {state['layout'].get('pp', 1)}); resume with that layout")
    if not os.path.isfile(path):
        raise ConfigError(f"{state['path']} has no {os.path.basename(path)}: it was saved without "
                          "grpo.sync_ref_model; resume it with grpo.sync_ref_model=false")
    return torch.load(path, map_location="cpu", weights_only=True)


def _check_resumable(path: str, this_run: TrainerState, topo: Topology) -> bool:
    """Refuse a checkpoint this run cannot continue (before loading anything); returns
    whether it needs re-sharding (saved with another number of data-, tensor-, sequence- or
    expert-parallel ranks)."""
    num_prompts, prompts_per_step = this_run.num_prompts, this_run.prompts_per_step
    zero, adapters = this_run.layout["zero_stage"], this_run.layout["lora"]
    try:
        state = read_trainer_state(path)
    except (OSError, ValueError):
        return False  # unreadable: the load reports it and the previous one is tried
    if state.get("num_prompts", num_prompts) != num_prompts:
        raise ConfigError(f"checkpoint '{path}' was saved with {state['num_prompts']} training prompts, this "
                          f"run has {num_prompts}; the prompt order would not continue. Resume with the same data")
    saved_lora = state.get("layout", {}).get("lora")
    if saved_lora != adapters:
        raise ConfigError(f"checkpoint '{path}' was saved with model.lora={saved_lora or 'off'}, this run has "
                          f"model.lora={adapters or 'off'}; resume with the same adapter settings")
    try:
        reshard = needs_reshard(state, topo.dp_size, topo.tp_size, topo.pp_size, prompts_per_step, zero, topo.sp_size,
                                this_run.layout.get("ep", 1))
    except ValueError as e:
        raise ConfigError(f"checkpoint '{path}' {e}") from None
    if reshard and adapters:
        raise ConfigError(f"checkpoint '{path}' is a LoRA checkpoint saved with dp={state['dp_size']}; re-sharding "
                          f"one to dp={topo.dp_size} is not supported: resume with the same number of ranks")
    return reshard
