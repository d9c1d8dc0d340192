"""Memory and process limits for a whole sandboxed execution (all its processes together),
through a cgroup of its own where this machine lets us create one.

rlimits bound each process (RLIMIT_AS) and the processes of a uid (RLIMIT_NPROC); a program
can still multiply its memory by forking up to the process limit, and files it writes to a
tmpfs are memory outside any rlimit. A cgroup bounds the sum: anonymous memory and tmpfs
pages of every process in it. Both cgroup versions work: v1 (a `memory` and a `pids`
hierarchy, the cgroup the trainer is in as the parent) and v2 (the unified hierarchy, where
the trainer's cgroup must delegate the memory and pids controllers). `available()` says
which, or why neither.

A process joins before it runs anything of the program: the sandbox command starts with
`/bin/sh -c 'echo $$ > <cgroup.procs> ...; exec "$@"'`, as root, before the uid is dropped.
"""
from __future__ import annotations

import os
import signal
import threading
import time

CGROUP_ROOT = "/sys/fs/cgroup"


def own_cgroup_paths() -> dict[str, str]:
    """{controller or "" (v2): path of this process's cgroup} from /proc/self/cgroup."""
    paths = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for c in controllers.split(",") if controllers else [""]:
                    paths[c] = path
    except OSError:
        pass
    return paths


class ExecutionCgroups:
    """Creates one cgroup per execution under the trainer's own cgroup (v1 memory + pids, or v2)."""

    def __init__(self, root: str = CGROUP_ROOT):
        self.parents: dict[str, str] = {}  # "memory"/"pids" (v1) or "unified" -> parent directory
        self.problem = self._find_parents(root)
        self._count, self._lock = 0, threading.Lock()

    def _find_parents(self, root: str) -> str | None:
        if os.geteuid() != 0:
            return "not root (a process joins its cgroup before dropping to the sandbox uid)"
        own = own_cgroup_paths()
        v1 = {c: os.path.join(root, c, own[c].lstrip("/")) for c in ("memory", "pids") if c in own}
        if "memory" in v1:
            parents = {c: p for c, p in v1.items() if os.access(p, os.W_OK)}
            if "memory" in parents:
                self.parents = parents
                return None
            return f"{v1['memory']} is not writable"
        unified = os.path.join(root, own.get("", "/").lstrip("/"))
        try:
            with open(os.path.join(unified, "cgroup.subtree_control")) as f:
                delegated = f.read().split()
        except OSError:
            return "no cgroup memory controller found (neither v1 memory nor v2)"
        if "memory" not in delegated:
            return f"the memory controller is not delegated to {unified} (cgroup.subtree_control)"
        self.parents = {"unified": unified}
        return None

    def available(self) -> bool:
        return self.problem is None

    def create(self, label: str, memory_bytes: int, processes: int) -> "Cgroup | None":
        """A fresh cgroup `<label>-<pid>-<n>` with these limits, or None when this machine has no
        usable cgroup."""
        if self.problem is not None:
            return None
        with self._lock:
            self._count += 1
            name = f"{label}-{os.getpid()}-{self._count}"
        made = []
        try:
            for controller, parent in self.parents.items():
                path = os.path.join(parent, name)
                os.mkdir(path)
                made.append(path)
                limits = {"memory": {"memory.limit_in_bytes": memory_bytes, "memory.swappiness": 0},
                          "pids": {"pids.max": processes},
                          "unified": {"memory.max": memory_bytes, "memory.swap.max": 0,
                                      "pids.max": processes}}[controller]
                for key, value in limits.items():
                    if os.path.exists(os.path.join(path, key)):
                        with open(os.path.join(path, key), "w") as f:
                            f.write(str(value))
        except OSError:
            Cgroup(made).remove()
            return None
        return Cgroup(made)


class Cgroup:
    """One execution's cgroup directories (one per v1 hierarchy, or one v2 directory)."""

    def __init__(self, paths: list[str]):
        self.paths = paths

    def join_prefix(self) -> list[str]:
        """A command prefix that moves the process into this cgroup, then execs the rest."""
        script = "".join(f'echo $$ > "{p}/cgroup.procs" && ' for p in self.paths) + 'unset PWD OLDPWD; exec "$@"'
        return ["/bin/sh", "-c", script, "sh"]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this cgroup for its memory limit."""
        for path in self.paths:
            for name, key in (("memory.oom_control", "oom_kill"), ("memory.events", "oom_kill")):
                try:
                    with open(os.path.join(path, name)) as f:
                        for line in f:
                            field, _, value = line.partition(" ")
                            if field == key and int(value) > 0:
                                return True
                except (OSError, ValueError):
                    continue
        return False

    def kill_all(self) -> None:
        """SIGKILL every process in this cgroup (until none is left, or 2 s)."""
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            pids = set()
            for path in self.paths:
                try:
                    with open(os.path.join(path, "cgroup.procs")) as f:
                        pids |= {int(line) for line in f if line.strip()}
                except (OSError, ValueError):
                    pass
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        """rmdir each directory once its processes are gone (they were killed; give them a moment)."""
        for path in self.paths:
            deadline = time.monotonic() + 5
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
