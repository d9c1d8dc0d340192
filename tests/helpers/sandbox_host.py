"""What a sandboxed execution may leave on the host, checked from outside: processes (zombies
included), files in /tmp, listening sockets, cgroups.

As root every execution runs under a uid of a sandbox block (SANDBOX_UID_BASE + slot x
UIDS_PER_SANDBOX + offset); offsets from UIDS_PER_SANDBOX - LONG_LIVED_UIDS up are the
long-lived trusted interpreters, which stay between executions. Not as root, executions keep
this user's uid and are found by the label on their command line.
"""
import os
import time

from megagrpo.sandbox.cgroups import own_cgroup_paths
from megagrpo.sandbox.process import (
    EXECUTION_LABEL,
    LONG_LIVED_LABEL,
    LONG_LIVED_UIDS,
    SANDBOX_UID_BASE,
    UID_SLOTS,
    UIDS_PER_SANDBOX,
)


def _stat(pid: str) -> list[str]:
    """/proc/<pid>/stat after the command name: [0] is the state, [1] the parent pid."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _is_sandbox_uid(uid: int, long_lived: bool) -> bool:
    if not SANDBOX_UID_BASE <= uid < SANDBOX_UID_BASE + UID_SLOTS * UIDS_PER_SANDBOX:
        return False
    offset = (uid - SANDBOX_UID_BASE) % UIDS_PER_SANDBOX
    return long_lived or offset < UIDS_PER_SANDBOX - LONG_LIVED_UIDS


def sandbox_processes(zombies_of_long_lived: bool = True) -> list[tuple[int, str]]:
    """[(pid, state)] of execution processes (live or zombie) and of zombies of long-lived ones."""
    me, my_uid = os.getpid(), os.getuid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            uid, state = os.stat(f"/proc/{name}").st_uid, _stat(name)[0]
            if os.geteuid() == 0:
                if _is_sandbox_uid(uid, long_lived=state == "Z" and zombies_of_long_lived):
                    found.append((int(name), state))
            elif uid == my_uid:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                if EXECUTION_LABEL.encode() in argv or (state == "Z" and LONG_LIVED_LABEL.encode() in argv):
                    found.append((int(name), state))
        except OSError:  # the process ended meanwhile
            pass
    return found


def sandbox_processes_after_cleanup(timeout_s: float = 30) -> list[tuple[int, str]]:
    """sandbox_processes() once it is empty, else what is still there after timeout_s (killed
    processes take a moment to go on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    left = sandbox_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = sandbox_processes()
    return left


def _listening() -> set[str]:
    inodes = set()
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/net/{table}") as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        inodes |= {f"{table}:{r[1]}:{r[9]}" for r in rows if r[3] in ("0A", "07")}  # LISTEN, or bound UDP
    with open("/proc/net/unix") as f:
        inodes |= {f"unix:{r[-1]}" for r in (line.split() for line in f.readlines()[1:]) if r[3] == "00010000"}
    return inodes


def _execution_cgroups() -> list[str]:
    own = own_cgroup_paths()
    found = []
    for controller in ("memory", "pids"):
        parent = os.path.join("/sys/fs/cgroup", controller, own.get(controller, "/").lstrip("/"))
        if os.path.isdir(parent):
            found += [d for d in os.listdir(parent) if d.startswith(EXECUTION_LABEL + "-")
                      and not d.startswith(LONG_LIVED_LABEL)]
    return found


class HostSnapshot:
    """Files in /tmp, listening sockets and cgroups before a case, compared after it."""

    def __init__(self):
        self.tmp, self.listening = set(os.listdir("/tmp")), _listening()

    def changes(self) -> list[str]:
        """What the case left behind (empty when nothing)."""
        left = [f"process {pid} ({state})" for pid, state in sandbox_processes_after_cleanup()]
        left += [f"/tmp/{name}" for name in set(os.listdir("/tmp")) - self.tmp]
        left += [f"listening {sock}" for sock in _listening() - self.listening]
        left += [f"cgroup {name}" for name in _execution_cgroups()]
        return left
