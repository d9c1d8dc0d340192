"""DeepSpeed's CPU ops (JIT-compiled torch extensions): where they are built, building them ahead
of a job, and the build locks a killed process leaves behind.

- DeepSpeed JIT-compiles its CPU shared-memory all-reduce op when the process group starts, and
  every process that loads it, even when nothing needs rebuilding, takes a lock file in the
  build folder. A process killed while holding it (SIGKILL, preemption, a CI time limit) leaves
  the file behind, and every later job on that machine (or home folder) then waits for it
  forever, silently. Here a lock is waited on while it is young (someone is building) and
  removed, with a message naming it, once it is old.
- Torch's default build folder (~/.cache/torch_extensions) is shared by all of a user's venvs,
  so jobs of two venvs rebuild the op under each other; it is kept inside the venv instead.
These and the other upstream limits megagrpo works around: docs/upstream-issues.md.
"""
from __future__ import annotations

import os
import sys
import time

import torch

SHM_OP = "deepspeed_shm_comm"   # the op DeepSpeed builds in TorchBackend.__init__ on CPU
CPU_ADAM_OP = "cpu_adam"        # ZeRO optimizer offload's Adam (DeepSpeedCPUAdam)
STALE_LOCK_S = 600               # its build takes about a minute on 2 cores


def prepare_op_build(clear_lock: bool = True) -> None:
    """Before DeepSpeed loads its CPU op: the venv's build folder, and (on one process per
    node) no lock left by a dead process."""
    use_venv_extensions_dir()
    if clear_lock and not torch.cuda.is_available():
        clear_stale_build_lock(SHM_OP)


def build_cpu_ops(cpu_adam: bool = False) -> None:
    """Build DeepSpeed's CPU ops now (launch/install.sh), so that jobs only load them: the
    shared-memory all-reduce every job uses, and (cpu_adam) CPU Adam, which only ZeRO offload
    uses and whose first build takes minutes."""
    from deepspeed.accelerator import get_accelerator

    prepare_op_build()
    get_accelerator().create_op_builder("ShareMemCommBuilder").load()
    if cpu_adam:
        get_accelerator().create_op_builder("CPUAdamBuilder").load()


def say_if_cpu_adam_builds(ds_config: dict, log) -> None:
    """ZeRO's optimizer offload runs DeepSpeed's CPU Adam, built on its first use in a venv
    (minutes; every rank waits): say so before DeepSpeed starts it."""
    offload = (ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    if offload.get("device", "none") == "none" or "optimizer" not in ds_config:
        return
    if not os.path.exists(os.path.join(op_build_dir(CPU_ADAM_OP), f"{CPU_ADAM_OP}.so")):
        log("building DeepSpeed's CPU Adam for ZeRO offload: once per venv, a few minutes (or before the job: "
            "MEGAGRPO_OFFLOAD_OPS=1 bash launch/install.sh)")


def op_build_dir(extension: str) -> str:
    """Where torch builds (and looks for) a JIT extension: TORCH_EXTENSIONS_DIR's, as
    use_venv_extensions_dir sets it before a job's first op loads."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(extension, verbose=False)


def use_venv_extensions_dir() -> None:
    """Build torch extensions (DeepSpeed's JIT ops) inside this venv unless TORCH_EXTENSIONS_DIR
    says where: torch's default folder is shared by all of a user's venvs, and a job from one
    rebuilds the op the other's jobs are loading.

    And always with this venv's ninja (pip's, a dependency), put first on PATH: torch runs the
    first `ninja` on PATH, and two versions (Debian's 1.11 and pip's 1.13 here) hash commands
    differently in the build log, so each takes the other's build for stale and rebuilds it
    (about 40 s on 2 cores, every rank waiting). Without this, a job started from an activated
    venv and one started as .venv/bin/python rebuilt the op in turn."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ and os.access(sys.prefix, os.W_OK):
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(sys.prefix, "torch_extensions")
    venv_bin = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "").split(os.pathsep)
    if os.path.isfile(os.path.join(venv_bin, "ninja")) and path[0] != venv_bin:
        os.environ["PATH"] = os.pathsep.join([venv_bin] + path)


def clear_stale_build_lock(extension: str, max_age_s: float = STALE_LOCK_S, say_after_s: float = 5.0) -> bool:
    """Wait while a torch extension build lock is younger than `max_age_s` (someone is
    building), then remove it if it is still there. Returns whether a lock was removed. Says
    what it waits for once it has waited `say_after_s`: a peer that only loads the built op
    holds the lock for about a second.

    Only one process per node calls this (local rank 0), so two ranks cannot both remove a
    lock and then build at the same time.
    """
    lock = os.path.join(op_build_dir(extension), "lock")
    said, start = False, time.time()
    while True:
        try:
            age = time.time() - os.stat(lock).st_mtime
        except FileNotFoundError:
            return False
        if age >= max_age_s:
            break
        if not said and time.time() - start >= say_after_s:
            print(f"[megagrpo] {lock} exists ({age:.0f} s old): waiting for the process building "
                  f"{extension}; removed if still there at {max_age_s:.0f} s", file=sys.stderr, flush=True)
            said = True
        time.sleep(min(0.2 if not said else 1.0, max_age_s - age))
    try:
        os.unlink(lock)
    except FileNotFoundError:
        return False
    print(f"[megagrpo] removed {lock}: a build lock left {age / 60:.0f} minutes ago, by a process "
          f"that died while loading {extension} (jobs would have waited for it forever)",
          file=sys.stderr, flush=True)
    return True
