"""The life of one sandboxed process tree, from the trainer's side: the uid block it runs
under, starting it (memory files), feeding and reading it (`communicate`), killing and reaping
it (`SandboxProcess`).

As root every execution runs under a uid of its own that no account uses: each Sandbox holds a
block of UIDS_PER_SANDBOX uids, claimed with a lock file, so that ranks and jobs on one machine
never share one; the last LONG_LIVED_UIDS of a block are for long-lived processes (the trusted
test interpreters). The trainer is a child subreaper, so a sandbox's pid-namespace init that
bubblewrap leaves behind comes to it and is reaped, never left a zombie.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import json
import os
import platform
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time

from megagrpo.config.schema import ConfigError
from megagrpo.sandbox.cgroups import Cgroup

SANDBOX_UID_BASE = 2_000_000  # uid blocks: SANDBOX_UID_BASE + slot x UIDS_PER_SANDBOX
UIDS_PER_SANDBOX = 1000
UID_SLOTS = 1000
LONG_LIVED_UIDS = 100  # the last uids of a block are for long-lived processes (trusted test interpreters)
UID_LOCK_DIR = "/tmp/megagrpo-sandbox-uids"
# on the command line and in the cgroup's name of each sandboxed process (leak checks find them)
EXECUTION_LABEL, LONG_LIVED_LABEL = "megagrpo-sandbox", "megagrpo-sandbox-long-lived"
PR_SET_CHILD_SUBREAPER = 36


class SandboxUnavailable(ConfigError):
    """The sandbox cannot run here as its mode asks (bubblewrap missing, say), or no program can
    run in it at all; the message names what is missing and the way out. A ConfigError, so the
    trainer prints it as one line."""


def memory_file(name: str, text: str) -> int:
    """A readable file descriptor holding `text`, in memory (nothing on the host's disk)."""
    fd = os.memfd_create(name)
    os.write(fd, text.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def adopt_orphans() -> None:
    """Make this process the reaper of its descendants' orphans. bubblewrap exits without
    reaping its pid namespace's init when the program ends by itself; the init then comes to us
    (not to a machine init that may never reap it), and SandboxProcess.stop() reaps it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def reap(pid: int, wait_s: float = 2.0) -> None:
    """waitpid the orphaned init `pid` once it has ended; nothing if it is not our child."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not ours, or reaped already
            return
        if done or time.monotonic() > deadline:
            return
        time.sleep(0.001)


def reap_orphans(uid: int, wait_s: float = 2.0) -> None:
    """Reap the processes of this execution's own uid that came to us as orphans (killed by a
    sweep), waiting up to wait_s for the killed ones to end."""
    me, deadline = os.getpid(), time.monotonic() + wait_s
    while True:
        running = False
        for name in os.listdir("/proc"):
            try:
                if not name.isdigit() or os.stat(f"/proc/{name}").st_uid != uid:
                    continue
                with open(f"/proc/{name}/stat") as f:
                    state, parent = f.read().rsplit(")", 1)[1].split()[:2]
            except OSError:
                continue
            if int(parent) == me:
                if state == "Z":
                    reap(int(name), 0.0)
                else:
                    running = True
        if not running or time.monotonic() > deadline:
            return
        time.sleep(0.005)


def claim_uid_block():
    """(first uid, lock file): a block of UIDS_PER_SANDBOX uids no other Sandbox on this machine
    holds, for as long as the lock file stays open (a dead process's lock goes with it)."""
    os.makedirs(UID_LOCK_DIR, mode=0o700, exist_ok=True)
    for slot in range(UID_SLOTS):
        lock = open(os.path.join(UID_LOCK_DIR, str(slot)), "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return SANDBOX_UID_BASE + slot * UIDS_PER_SANDBOX, lock
        except BlockingIOError:
            lock.close()
    raise SandboxUnavailable(f"all {UID_SLOTS} sandbox uid blocks of this machine are in use ({UID_LOCK_DIR})")


class SandboxProcess:
    """One started sandbox: its process, the pipes that say whether and as which pid it started,
    and its cgroup. `stop()` ends it and reaps everything; call it exactly once."""

    def __init__(self, popen: subprocess.Popen, started_fd: int, status_fd: int | None,
                 cgroup: Cgroup | None, kill_uid=None, workdir: str | None = None, uid: int | None = None):
        self.popen, self.cgroup, self.workdir, self.uid = popen, cgroup, workdir, uid
        self._started_fd, self._status_fd, self._kill_uid = started_fd, status_fd, kill_uid
        self._status = b""
        self.started = False
        self.child_pid: int | None = None

    def poll_start(self, wait_s: float = 0.0) -> None:
        """Read what the started and status pipes hold (waiting up to wait_s for the status)."""
        if not self.started and self._started_fd is not None:
            os.set_blocking(self._started_fd, False)
            try:
                self.started = bool(os.read(self._started_fd, 1))
            except BlockingIOError:
                pass
        if self._status_fd is None or self.child_pid is not None:
            return
        deadline = time.monotonic() + wait_s
        while self.child_pid is None:
            left = deadline - time.monotonic()
            ready = selectors.DefaultSelector()
            ready.register(self._status_fd, selectors.EVENT_READ)
            events = ready.select(timeout=max(0.0, left))
            ready.close()
            if not events:
                return
            chunk = os.read(self._status_fd, 4096)
            if not chunk:
                return
            self._status += chunk
            for line in self._status.decode(errors="replace").splitlines():
                try:
                    pid = json.loads(line).get("child-pid")
                except (ValueError, AttributeError):
                    continue
                if isinstance(pid, int):
                    self.child_pid = pid

    def kill(self) -> None:
        """SIGKILL the sandbox and reap it. Under bubblewrap: its pid namespace's init, so that
        bubblewrap reaps it and exits (killing bubblewrap first would leave the init to the
        machine's init, a zombie where that init does not reap); then, should bubblewrap still
        run, its process group. Whatever of the execution still lives after that (a process
        that left the group, or one orphaned by a bubblewrap killed from outside) dies with
        the execution's cgroup or uid."""
        if self.popen.poll() is None:
            if self._status_fd is not None:
                self.poll_start(wait_s=0.5)
                if self.child_pid is not None:  # alive while bubblewrap, its parent, is
                    try:
                        os.kill(self.child_pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    try:
                        self.popen.wait(timeout=2.0)
                    except subprocess.TimeoutExpired:
                        pass
            if self.popen.poll() is None:
                try:
                    os.killpg(self.popen.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    self.popen.kill()
                except ProcessLookupError:
                    pass
        self.popen.wait()
        if self.cgroup is not None:
            self.cgroup.kill_all()
        elif self._kill_uid is not None:
            self._kill_uid()
        if self.uid is not None:
            reap_orphans(self.uid)

    def stop(self) -> tuple[int, bool]:
        """Kill (if running), reap, release: (return code, whether its cgroup hit the memory limit)."""
        if self.popen.poll() is None or self._status_fd is None:  # rlimits only: forks may outlive it
            self.kill()
        returncode = self.popen.wait()
        self.poll_start()
        if self.child_pid is not None:
            reap(self.child_pid)
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()
        for fd in (self._started_fd, self._status_fd):
            if fd is not None:
                os.close(fd)
        self._started_fd = self._status_fd = None
        oom = False
        if self.cgroup is not None:
            oom = self.cgroup.oom_killed()
            self.cgroup.remove()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return returncode, oom


def communicate(process: SandboxProcess, stdin: bytes, deadline: float, output_bytes: int,
                watch=None) -> tuple[str | None, bytes, bytes]:
    """Feed stdin, collect stdout/stderr (each capped at output_bytes) until the program closes
    both, the deadline passes ("timeout") or the output is over the cap ("output_limit"). With
    `watch` (an object with fileno() and feed(bytes) -> True when done), also until watch says
    done ("watch_done"). Returns (why it stopped early or None, stdout, stderr)."""
    proc = process.popen
    out = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    pending = memoryview(stdin[: 16 * 2**20])
    stopped = None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        if watch is not None:
            sel.register(watch.fileno(), selectors.EVENT_READ, "watch")
        if pending:  # fed as the program reads it: a program that never reads cannot block us
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while any(key.data != "watch" for key in sel.get_map().values()):
            left = deadline - time.perf_counter()
            if left <= 0:
                stopped = "timeout"
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                if key.data == "watch":
                    try:
                        chunk = os.read(key.fd, 65536)
                    except OSError:
                        chunk = b""
                    if watch.feed(chunk) or not chunk:
                        stopped = "watch_done"
                        break
                    continue
                if key.fileobj is proc.stdin:
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]):]
                    except BlockingIOError:
                        continue
                    except OSError:  # the program closed stdin or exited
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = out[key.fd]
                buf += chunk
                if len(buf) > output_bytes:
                    stopped = "output_limit"
                    break
            if stopped:
                break
    if not proc.stdin.closed:
        proc.stdin.close()
    return stopped, bytes(out[proc.stdout.fileno()][:output_bytes]), bytes(out[proc.stderr.fileno()][:output_bytes])


def tasks_of_uid(uid: int) -> int:
    """Processes and threads whose real uid is `uid` (what RLIMIT_NPROC counts), from /proc."""
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if line.startswith(("Uid:", "Threads:")))
        except (OSError, ValueError):  # gone meanwhile
            continue
        if "Uid" in fields and int(fields["Uid"].split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


@functools.cache
def namespaced_nproc() -> bool:
    """Whether RLIMIT_NPROC set in a user namespace counts only that namespace's tasks (its own
    ucounts, Linux 5.14); before, it counted every task of the uid."""
    match = re.match(r"(\d+)\.(\d+)", platform.release())
    return match is not None and (int(match[1]), int(match[2])) >= (5, 14)


def sandbox_python() -> str:
    """The interpreter run inside the sandbox: the system's python3 (readable by any uid,
    under /usr), else this process's base interpreter."""
    for candidate in ("/usr/bin/python3", os.path.realpath(sys.executable)):
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise SandboxUnavailable("no python3 interpreter found for the sandbox")
