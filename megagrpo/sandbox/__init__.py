"""Run model-written code outside the trainer: one process tree per execution, under bubblewrap
(docs/sandbox.md has the threat model and what each layer stops).

    [as root: sh joins the execution's cgroup] setpriv [--reuid/--regid an unused uid]
        --pdeathsig KILL -- prlimit <rlimits> -- bwrap <namespaces, mounts, seccomp> --
        python3 -I -B -c BOOT ...

The modules, by layer:
- process.py: one started process tree: its uid block, memory files, `communicate` (stdin fed,
  stdout/stderr capped, a wall-clock deadline), killing and reaping (`SandboxProcess`);
- command.py: `Sandbox`, the command line above (bubblewrap's namespaces and mounts, rlimits),
  the probe that picks the mode, `run` and the status of an execution (`classify`);
- modes.py: the modes, the refusal where bubblewrap cannot run, the one line that says which
  sandbox judged the rewards;
- pool.py: `SandboxPool`, many programs in parallel under a batch time budget;
- seccomp.py: the BPF filter given to `bwrap --seccomp`;
- cgroups.py: a memory + pids cgroup per execution.

`sandbox: auto` (and `strict`) runs under bubblewrap or refuses to start; `rlimits` runs with
rlimits only, chosen knowingly. What a program does is a result, never an exception: a status
from STATUSES and a reason.
"""
from megagrpo.sandbox.command import STATUSES, ExecResult, Sandbox, SandboxLimits, sandbox_python
from megagrpo.sandbox.modes import FEATURES, MODES, describe
from megagrpo.sandbox.pool import SandboxPool
from megagrpo.sandbox.process import SandboxProcess, SandboxUnavailable, communicate

__all__ = ["FEATURES", "MODES", "STATUSES", "ExecResult", "Sandbox", "SandboxLimits", "SandboxPool",
           "SandboxProcess", "SandboxUnavailable", "communicate", "describe", "sandbox_python"]
