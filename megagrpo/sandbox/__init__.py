"""Run model-written code outside the trainer: one process tree per execution, under bubblewrap.

Each execution is a fresh process tree:

    [as root: sh joins the execution's cgroup] setpriv [--reuid/--regid an unused uid]
        --pdeathsig KILL -- prlimit <rlimits> -- bwrap <namespaces, mounts, seccomp> --
        python3 -I -B -c BOOT ...

- bubblewrap (Debian `bubblewrap`): new user, pid, net, ipc, uts (and cgroup) namespaces, and
  no further user namespaces inside (`--disable-userns`); a read-only root holding the
  system's /usr (read-only), a private /proc, a minimal read-only /dev (null, zero, urandom)
  and one writable, size-capped tmpfs at /tmp (also the working directory and $HOME); no
  /home, /root, /etc, /work or anything else of the host; the environment cleared (PATH,
  HOME, LANG only); a new session (no terminal); killed with its parent.
- a seccomp filter (`seccomp.py`): ptrace, io_uring, mount, keyctl, bpf, unshare/setns and
  the like fail with EPERM.
- rlimits (prlimit): CPU seconds, address space per process, file size, open files,
  processes, no core files. As root each execution runs under a uid of its own that no
  account uses (a block of 1000 uids per Sandbox, claimed with a lock file, so that ranks and
  jobs on one machine never share one), so the process limit counts only that execution's
  processes and root-only files stay closed.
- a cgroup per execution (`cgroups.py`) where the machine allows it: the memory of all the
  execution's processes and of its tmpfs together, and its process count. Without one, the
  process limit is lowered (FALLBACK_PROCESSES) so that processes x address space bounds it.
- the program text never touches the disk: it is handed over in memory files (memfd) that
  BOOT reads, so no directory of the host needs to be readable by the sandbox uid.
- a wall-clock timeout and an output cap, enforced from here: past either the sandbox's pid
  namespace is killed through its init (whose pid bubblewrap reports on `--json-status-fd`),
  and bubblewrap reaps it, so no zombie is left to an init that does not reap. If the
  trainer dies, so does the sandbox (parent-death signal).

The status of an execution never depends on what the program prints: BOOT writes one byte to a
pipe before the program's first line; without that byte the sandbox failed to start
(`sandbox_error`, with bubblewrap's message), with it any failure is the program's.

Where bubblewrap is missing or cannot create namespaces, `mode="auto"` falls back to rlimits
only (a scrubbed environment and a fresh working directory, no isolation of the file system or
network) with a loud warning; `mode="strict"` refuses to start. Failures of the sandboxed
program are results, never exceptions: a status from a fixed set and a reason.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import platform
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from megagrpo.sandbox import seccomp
from megagrpo.sandbox.cgroups import Cgroup, ExecutionCgroups

# Every execution ends in exactly one of these (fixed, so ranks can reduce counts of them).
STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "crash", "sandbox_error")
MODES = ("auto", "strict", "rlimits")
SANDBOX_UID_BASE = 2_000_000  # uid blocks: SANDBOX_UID_BASE + slot x UIDS_PER_SANDBOX
UIDS_PER_SANDBOX = 1000
UID_SLOTS = 1000
LONG_LIVED_UIDS = 100  # the last uids of a block are for long-lived processes (trusted test interpreters)
UID_LOCK_DIR = "/tmp/megagrpo-sandbox-uids"
FALLBACK_PROCESSES = 4  # the process limit without a cgroup: memory <= processes x memory_mb
MINIMAL_DEV = ("null", "zero", "urandom")
# on the command line and in the cgroup's name of each sandboxed process (leak checks find them)
EXECUTION_LABEL, LONG_LIVED_LABEL = "megagrpo-sandbox", "megagrpo-sandbox-long-lived"

# Runs first in the sandbox (python3 -c BOOT LABEL STARTED_FD MAIN_FD [name=fd ...] -- args): says
# "started" on its pipe, loads the modules and the main program from their memory files, then
# runs the program as __main__ with sys.argv = ["/sandbox/main.py", *args].
BOOT = r"""
import os, sys, types
def _boot():
    _, started, main_fd, *rest = sys.argv[1:]
    split = rest.index("--")
    os.write(int(started), b"1")
    os.close(int(started))
    def read(fd):
        with os.fdopen(int(fd), "rb") as f:
            return f.read().decode()
    for pair in rest[:split]:
        name, fd = pair.split("=")
        module = types.ModuleType(name)
        module.__file__ = "/sandbox/" + name + ".py"
        exec(compile(read(fd), module.__file__, "exec"), module.__dict__)
        sys.modules[name] = module
    source = read(main_fd)
    sys.argv = ["/sandbox/main.py", *rest[split + 1:]]
    return compile(source, "/sandbox/main.py", "exec")
_main = {"__name__": "__main__", "__file__": "/sandbox/main.py", "__builtins__": __builtins__}
exec(_boot(), _main)
"""


class SandboxUnavailable(RuntimeError):
    """mode="strict" and bubblewrap cannot run here, or no program can run in the sandbox at all."""


@dataclass
class SandboxLimits:
    timeout_s: float = 5.0
    """Wall-clock limit of one execution (sleeping or blocked programs included)."""
    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU) of each process."""
    memory_mb: int = 1024
    """Memory of the whole execution (its cgroup: all processes and its tmpfs), and the address
    space (RLIMIT_AS) of each of its processes."""
    file_size_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE); also the size of its tmpfs."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    processes: int = 16
    """Processes of the execution (its cgroup's pids.max and RLIMIT_NPROC of its uid; without a
    cgroup at most FALLBACK_PROCESSES)."""
    output_bytes: int = 64 * 1024
    """stdout and stderr are each cut at this many bytes; more kills the program."""


@dataclass
class ExecResult:
    status: str  # one of STATUSES
    reason: str  # "" when ok; else what happened, for logs and metrics
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


def sandbox_python() -> str:
    """The interpreter run inside the sandbox: the system's python3 (readable by any uid,
    under /usr), else this process's base interpreter."""
    for candidate in ("/usr/bin/python3", os.path.realpath(sys.executable)):
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise SandboxUnavailable("no python3 interpreter found for the sandbox")


def _memory_file(name: str, text: str) -> int:
    fd = os.memfd_create(name)
    os.write(fd, text.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


PR_SET_CHILD_SUBREAPER = 36


def _adopt_orphans() -> None:
    """Make this process the reaper of its descendants' orphans. bubblewrap exits without
    reaping its pid namespace's init when the program ends by itself; the init then comes to us
    (not to a machine init that may never reap it), and SandboxProcess.stop() reaps it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _reap(pid: int, wait_s: float = 2.0) -> None:
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


def _reap_orphans(uid: int, wait_s: float = 2.0) -> None:
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
                    _reap(int(name), 0.0)
                else:
                    running = True
        if not running or time.monotonic() > deadline:
            return
        time.sleep(0.005)


def _claim_uid_block():
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
            _reap_orphans(self.uid)

    def stop(self) -> tuple[int, bool]:
        """Kill (if running), reap, release: (return code, whether its cgroup hit the memory limit)."""
        if self.popen.poll() is None or self._status_fd is None:  # rlimits only: forks may outlive it
            self.kill()
        returncode = self.popen.wait()
        self.poll_start()
        if self.child_pid is not None:
            _reap(self.child_pid)
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


class Sandbox:
    """Starts programs isolated as described in the module docstring; `run()` runs one to its end."""

    def __init__(self, limits: SandboxLimits | None = None, mode: str = "auto",
                 python: str | None = None):
        if mode not in MODES:
            raise ValueError(f"sandbox mode '{mode}' is not one of {', '.join(MODES)}")
        self.limits = limits or SandboxLimits()
        self.python = python or sandbox_python()
        self.bwrap = shutil.which("bwrap")
        self.prlimit = shutil.which("prlimit")
        self.setpriv = shutil.which("setpriv")
        self.kill = shutil.which("kill")
        self.as_root = os.geteuid() == 0
        if self.as_root and not self.setpriv:
            raise SandboxUnavailable("running as root, the sandbox needs `setpriv` (util-linux) to drop each "
                                     "execution to a uid of its own")
        self.uid_base, self._uid_lock = _claim_uid_block() if self.as_root else (None, None)
        self._count, self._long_lived, self._count_lock = 0, 0, threading.Lock()
        self.cgroups = ExecutionCgroups()
        if not self.cgroups.available():
            self.limits = replace(self.limits, processes=min(self.limits.processes, FALLBACK_PROCESSES))
        self.has_seccomp = seccomp.filter_program() is not None
        _adopt_orphans()
        self.isolated = False
        problem = None
        if mode != "rlimits":
            problem = self._probe(isolated=True)
            if problem is None:
                self.isolated = True
            elif mode == "strict":
                raise SandboxUnavailable(
                    f"sandbox: strict, but bubblewrap cannot run here ({problem}); install "
                    "Debian's `bubblewrap` (launch/install_system.sh) and allow unprivileged user "
                    "namespaces, or set sandbox: auto")
        if not self.isolated:
            warnings.warn(
                "\n" + "!" * 78 + "\nmegagrpo sandbox: bubblewrap is not in use "
                f"({'mode rlimits' if mode == 'rlimits' else problem}). Model-written code runs "
                "with rlimits only:\nit can read the file system and use the network. Install "
                "`bubblewrap`, or set sandbox: strict to refuse.\n" + "!" * 78,
                RuntimeWarning, stacklevel=2)
            problem = self._probe(isolated=False)
            if problem is not None:
                raise SandboxUnavailable(f"sandbox: not even an rlimits-only program runs here ({problem}); "
                                         "the code reward would score every program 0")
        missing = [f"no seccomp filter for {platform.machine()}"] if self.isolated and not self.has_seccomp else []
        if self.cgroups.problem:
            missing.append(f"no cgroup per execution ({self.cgroups.problem}), so the process limit is "
                           f"{self.limits.processes} and memory is bounded by processes x memory_mb")
        if missing:
            warnings.warn("megagrpo sandbox: " + "; ".join(missing), RuntimeWarning, stacklevel=2)

    # ---- the command line ---------------------------------------------------------------------

    def _rlimit_args(self, long_lived: bool) -> list[str]:
        lim = self.limits
        if not self.prlimit:
            return []
        # a long-lived process sets the CPU limit of each job itself (its own CPU time adds up)
        cpu = "unlimited" if long_lived else str(lim.cpu_s)
        return [self.prlimit, f"--cpu={cpu}", f"--as={lim.memory_mb * 2**20}",
                f"--fsize={lim.file_size_mb * 2**20}", f"--nofile={lim.open_files}",
                f"--nproc={lim.processes}", "--core=0", "--"]

    def _bwrap_args(self, status_fd: int, seccomp_fd: int | None) -> list[str]:
        args = [self.bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
                "--unshare-uts", "--unshare-cgroup-try", "--disable-userns", "--die-with-parent",
                "--new-session", "--clearenv", "--json-status-fd", str(status_fd),
                "--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            if os.path.islink(f"/{link}"):
                args += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
            elif os.path.isdir(f"/{link}"):
                args += ["--ro-bind", f"/{link}", f"/{link}"]
        prefix = os.path.dirname(os.path.dirname(self.python))
        if not self.python.startswith("/usr/"):  # an interpreter outside /usr: its prefix, read-only
            args += ["--ro-bind", prefix, prefix]
        args += ["--proc", "/proc", "--dir", "/dev"]
        for device in MINIMAL_DEV:
            args += ["--dev-bind", f"/dev/{device}", f"/dev/{device}"]
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                             ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
            args += ["--symlink", target, f"/dev/{name}"]
        args += ["--size", str(self.limits.file_size_mb * 2**20), "--tmpfs", "/tmp",
                 "--remount-ro", "/", "--chdir", "/tmp",
                 "--setenv", "HOME", "/tmp", "--setenv", "PATH", "/usr/bin:/bin",
                 "--setenv", "LANG", "C.UTF-8"]
        if seccomp_fd is not None:
            args += ["--seccomp", str(seccomp_fd)]
        return args + ["--"]

    def _next_uid(self, long_lived: bool = False) -> int | None:
        """A uid of its own for the next execution (as root), else None (run as ourselves)."""
        if not self.as_root:
            return None
        with self._count_lock:
            if long_lived:
                self._long_lived += 1
                return self.uid_base + UIDS_PER_SANDBOX - 1 - (self._long_lived - 1) % LONG_LIVED_UIDS
            self._count += 1
            return self.uid_base + self._count % (UIDS_PER_SANDBOX - LONG_LIVED_UIDS)

    def _kill_uid(self, uid: int) -> None:
        """rlimits only: what the program forked may have left its process group; every
        process of the execution's own uid is killed (`kill -KILL -1` run as that uid)."""
        if self.kill:
            subprocess.run([self.kill, "-KILL", "-1"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, user=uid, group=uid, extra_groups=[])

    # ---- starting a program -------------------------------------------------------------------

    def start(self, main: str, modules: dict[str, str] | None = None, args: tuple = (),
              pass_fds: tuple = (), long_lived: bool = False, capture: bool = True) -> SandboxProcess:
        """Start the Python program `main` (its source), with `modules` ({name: source})
        importable, `args` as its sys.argv[1:] and `pass_fds` open in it. With `capture`,
        stdin/stdout/stderr are pipes, else /dev/null. Raises OSError when it cannot start."""
        uid = self._next_uid(long_lived)
        started_r, started_w = os.pipe()
        status_r, status_w = os.pipe() if self.isolated else (None, None)
        memory_fds = [_memory_file("main", main)] + [_memory_file(n, s) for n, s in (modules or {}).items()]
        seccomp_fd = seccomp.filter_fd() if self.isolated else None
        label = LONG_LIVED_LABEL if long_lived else EXECUTION_LABEL
        inner = [self.python, "-I", "-B", "-c", BOOT, label, str(started_w), str(memory_fds[0]),
                 *[f"{name}={fd}" for name, fd in zip(modules or {}, memory_fds[1:])], "--", *map(str, args)]
        drop = ["--reuid", str(uid), "--regid", str(uid), "--clear-groups"] if uid is not None else []
        command = [self.setpriv, *drop, "--pdeathsig", "KILL", "--"] if self.setpriv else []
        command += self._rlimit_args(long_lived)
        workdir = None
        if self.isolated:
            command += self._bwrap_args(status_w, seccomp_fd)
            cwd = "/"
        else:  # rlimits only: a fresh directory the program may write
            workdir = tempfile.mkdtemp(prefix="megagrpo-sandbox-")
            os.chmod(workdir, 0o755)
            cwd = os.path.join(workdir, "tmp")
            os.mkdir(cwd)
            if uid is not None:
                os.chown(cwd, uid, uid)
        cgroup = self.cgroups.create(label, self.limits.memory_mb * 2**20, self.limits.processes)
        if cgroup is not None:
            command = cgroup.join_prefix() + command
        pipe = subprocess.PIPE if capture else subprocess.DEVNULL
        keep = tuple(fd for fd in (started_w, status_w, seccomp_fd, *memory_fds, *pass_fds) if fd is not None)
        try:
            popen = subprocess.Popen(command + inner, stdin=pipe, stdout=pipe, stderr=pipe, cwd=cwd,
                                     env={"PATH": "/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8"},
                                     start_new_session=True, pass_fds=keep)
        except OSError:
            for fd in (started_r, status_r):
                if fd is not None:
                    os.close(fd)
            if cgroup is not None:
                cgroup.remove()
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
            raise
        finally:
            for fd in (started_w, status_w, seccomp_fd, *memory_fds):
                if fd is not None:
                    os.close(fd)
        kill_uid = (lambda: self._kill_uid(uid)) if uid is not None else None
        return SandboxProcess(popen, started_r, status_r, cgroup, kill_uid, workdir, uid)

    # ---- one execution ------------------------------------------------------------------------

    def run(self, code: str, stdin: str = "") -> ExecResult:
        """Run `code` as a Python program with `stdin`; never raises for what the program does."""
        start = time.perf_counter()
        try:
            process = self.start(code)
        except OSError as e:
            return ExecResult("sandbox_error", f"could not start the sandbox: {e}", None, "", "",
                              time.perf_counter() - start)
        stopped, out, err = communicate(process, stdin.encode(), start + self.limits.timeout_s,
                                        self.limits.output_bytes)
        if stopped is None:  # the program closed its output; it may still run (until the deadline)
            try:
                process.popen.wait(timeout=max(0.0, start + self.limits.timeout_s - time.perf_counter()) + 0.5)
            except subprocess.TimeoutExpired:
                stopped = "timeout"
        returncode, oom = process.stop()
        stderr = err.decode(errors="replace")
        status, reason = self.classify(stopped, returncode, stderr, process.started, oom)
        return ExecResult(status, reason, returncode, out.decode(errors="replace"), stderr,
                          time.perf_counter() - start)

    def classify(self, stopped: str | None, returncode: int, stderr: str, started: bool,
                 oom: bool) -> tuple[str, str]:
        """(status, reason) of an execution from how it ended; what the program printed only
        fills the reason."""
        lim = self.limits
        if stopped == "timeout":
            return "timeout", f"wall-clock timeout after {lim.timeout_s:g} s"
        if stopped == "output_limit":
            return "output_limit", f"output over {lim.output_bytes} bytes"
        if not started:
            return "sandbox_error", f"the sandbox did not start (exit {returncode}): {_last_line(stderr)}"
        if returncode == 0:
            return "ok", ""
        last = _last_line(stderr)
        if oom:
            return "memory", f"memory limit of {lim.memory_mb} MB for the execution (cgroup)"
        # a signal: negative from Popen (rlimits only), 128 + n through bwrap's init
        sig = -returncode if returncode < 0 else (returncode - 128 if 128 < returncode < 160 else None)
        if sig is not None:
            if sig == signal.SIGXCPU:
                return "timeout", f"CPU limit of {lim.cpu_s} s (SIGXCPU)"
            if sig == signal.SIGKILL and "MemoryError" in last:
                return "memory", last
            return "crash", f"killed by {_signal_name(sig)}"
        if "MemoryError" in last or "Cannot allocate memory" in last:
            return "memory", last or f"out of memory (limit {lim.memory_mb} MB)"
        return "error", f"exit {returncode}: {last}" if last else f"exit {returncode}"

    def _probe(self, isolated: bool) -> str | None:
        """None when a trivial program runs here as it will run for real (under bubblewrap, or
        with rlimits only), else why not."""
        if isolated and not self.bwrap:
            return "bwrap is not installed"
        self.isolated = isolated
        try:
            result = self.run("print('ok')")
        finally:
            self.isolated = False
        if result.status != "ok" or result.stdout.strip() != "ok":
            return f"{result.status}: {result.reason or result.stdout.strip()[:200]}"
        return None

    def close(self) -> None:
        """Give back the uid block."""
        if self._uid_lock is not None:
            self._uid_lock.close()
            self._uid_lock = None


class SandboxPool:
    """Runs many programs in parallel, up to `workers` sandboxes at once."""

    def __init__(self, sandbox: Sandbox, workers: int = 2):
        self.sandbox = sandbox
        self.workers = max(1, workers)
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="megagrpo-sandbox")

    def map(self, fn, jobs: list, budget_s: float | None = None, skipped=None, failed=None) -> list:
        """[fn(*job)] in order, `workers` at a time. With `budget_s`, a job that has not started
        when the batch has run that long gives `skipped()` instead (so a batch of hostile
        programs costs about budget_s + timeout_s, not len(jobs) / workers x timeout_s); a job
        that raises gives `failed(exception)`: a broken sandbox must not stop training."""
        deadline = time.perf_counter() + budget_s if budget_s else None

        def run(job):
            if deadline is not None and time.perf_counter() > deadline:
                return skipped()
            return fn(*job)

        futures = [self._executor.submit(run, job) for job in jobs]
        results = []
        for future in futures:
            try:
                results.append(future.result())
            except Exception as e:  # noqa: BLE001
                results.append(failed(e))
        return results

    def run_many(self, jobs: list[tuple[str, str]], budget_s: float | None = None) -> list[ExecResult]:
        """[(code, stdin)] -> [ExecResult] in the same order (see map)."""
        return self.map(
            self.sandbox.run, jobs, budget_s,
            skipped=lambda: ExecResult("timeout", f"not run: the batch's time budget of {budget_s:g} s "
                                       "was spent before its turn", None, "", "", 0.0),
            failed=lambda e: ExecResult("sandbox_error", f"{type(e).__name__}: {e}", None, "", "", 0.0))

    def close(self) -> None:
        self._executor.shutdown(wait=True)
