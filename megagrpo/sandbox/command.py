"""The sandbox's command line, and one execution from start to status.

    [as root: sh joins the execution's cgroup] setpriv [--reuid/--regid an unused uid]
        --pdeathsig KILL -- prlimit <rlimits> -- bwrap <namespaces, mounts, seccomp> --
        python3 -I -B -c BOOT ...

`Sandbox` chooses its mode when it is built (probing a trivial program), builds that command
for each program, and turns how the program ended into a status from a fixed set and a reason;
the status never depends on what the program prints (BOOT writes one byte to a pipe before the
program's first line: without it the sandbox failed to start, with it any failure is the
program's). The modes (docs/sandbox.md): `auto` and `strict` run under bubblewrap or refuse
to start, naming what is missing; `rlimits` runs with rlimits only, a weaker sandbox, with a
warning.
"""
from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, replace

from megagrpo.config.schema import ConfigError
from megagrpo.sandbox import seccomp
from megagrpo.sandbox.cgroups import ExecutionCgroups
from megagrpo.sandbox.modes import MODES, describe, refusal, rlimits_warning
from megagrpo.sandbox.process import (
    EXECUTION_LABEL,
    LONG_LIVED_LABEL,
    LONG_LIVED_UIDS,
    UIDS_PER_SANDBOX,
    SandboxProcess,
    SandboxUnavailable,
    adopt_orphans,
    claim_uid_block,
    communicate,
    memory_file,
    namespaced_nproc,
    sandbox_python,
    tasks_of_uid,
)

# Every execution ends in exactly one of these (fixed, so ranks can reduce counts of them).
STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "crash", "sandbox_error")
FALLBACK_PROCESSES = 4  # the process limit without a cgroup: memory <= processes x memory_mb
SHARED_PROCESS_LIMIT = 8  # without root: executions one process limit is sized for (a code reward's
                          # workers, each a solution and its trusted side; docs/sandbox.md)
MINIMAL_DEV = ("null", "zero", "urandom")

# Runs first in the sandbox (python3 -c BOOT LABEL STARTED_FD MAIN_FD NPROC [name=fd ...] -- args):
# lowers RLIMIT_NPROC to NPROC (0: leaves it), says "started" on its pipe, loads the modules and
# the main program from their memory files, then runs the program as __main__ with
# sys.argv = ["/sandbox/main.py", *args].
BOOT = r"""
import os, sys, types
def _boot():
    _, started, main_fd, nproc, *rest = sys.argv[1:]
    if nproc != "0":
        import resource
        resource.setrlimit(resource.RLIMIT_NPROC, (int(nproc), int(nproc)))
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
    """Processes of the execution (its cgroup's pids.max, RLIMIT_NPROC in its namespace; without a
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


class Sandbox:
    """Starts programs isolated as described in the module docstring; `run()` runs one to its end."""

    def __init__(self, limits: SandboxLimits | None = None, mode: str = "auto",
                 python: str | None = None, setting: str = "sandbox"):
        """`setting` is how the user chooses `mode` (the code reward's `sandbox`, the python
        tool's `mode`): the errors and the log line name it."""
        if mode not in MODES:
            raise ConfigError(f"{setting}: '{mode}' is not one of {', '.join(MODES)}")
        self.limits, self.mode, self.setting = limits or SandboxLimits(), mode, setting
        self.python = python or sandbox_python()
        self.bwrap = shutil.which("bwrap")
        self.prlimit = shutil.which("prlimit")
        self.setpriv = shutil.which("setpriv")
        self.kill = shutil.which("kill")
        self.as_root = os.geteuid() == 0
        if self.as_root and not self.setpriv:
            raise SandboxUnavailable("running as root, the sandbox needs `setpriv` (util-linux) to drop each "
                                     "execution to a uid of its own")
        self.uid_base, self._uid_lock = claim_uid_block() if self.as_root else (None, None)
        self._count, self._long_lived, self._count_lock = 0, 0, threading.Lock()
        self.cgroups = ExecutionCgroups()
        if not self.cgroups.available():
            self.limits = replace(self.limits, processes=min(self.limits.processes, FALLBACK_PROCESSES))
        self.has_seccomp = seccomp.filter_program() is not None
        adopt_orphans()
        self.isolated = False
        try:
            self.isolated = self._choose_isolation()
        except SandboxUnavailable:
            self.close()
            raise
        missing = [f"no seccomp filter for {platform.machine()}"] if self.isolated and not self.has_seccomp else []
        if self.cgroups.problem:
            missing.append(f"no cgroup per execution ({self.cgroups.problem}), so the process limit is "
                           f"{self.limits.processes} and memory is bounded by processes x memory_mb")
        if missing:
            warnings.warn("megagrpo sandbox: " + "; ".join(missing), RuntimeWarning, stacklevel=2)

    def _choose_isolation(self) -> bool:
        """Whether programs run under bubblewrap: `auto` and `strict` only do, `rlimits` never
        (with a warning). Raises SandboxUnavailable, naming what is missing and the ways out,
        where the mode cannot run, or where not even a trivial program runs."""
        problem = None
        if self.mode != "rlimits":
            problem = self._probe(isolated=True)
            if problem is None:
                return True
        else:
            warnings.warn(rlimits_warning(self.setting), RuntimeWarning, stacklevel=3)
        unrestricted = self._probe(isolated=False)
        if unrestricted is not None:  # the interpreter, not bubblewrap, is what fails
            raise SandboxUnavailable(f"{self.setting}: not even an rlimits-only program runs here "
                                     f"({unrestricted}); the code reward would score every program 0")
        if problem is not None:
            raise SandboxUnavailable(refusal(self.setting, self.mode, problem))
        return False

    @property
    def features(self) -> dict[str, bool]:
        """{feature: whether programs get it} for FEATURES (modes.py)."""
        return {"bubblewrap": self.isolated, "seccomp": self.isolated and self.has_seccomp,
                "cgroups": self.cgroups.available()}

    def describe(self) -> str:
        """Which sandbox runs the programs, in one line: "bubblewrap (namespaces, seccomp,
        cgroups)", or "rlimits only (weaker: ...; chosen by sandbox: rlimits)"."""
        return describe(**self.features, chosen_by=f"{self.setting}: {self.mode}")

    def announce(self, what: str) -> None:
        """Print `[megagrpo] sandbox (<what>): <describe()>` once per machine (local rank 0)."""
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"[megagrpo] sandbox ({what}): {self.describe()}", flush=True)

    # ---- the command line ---------------------------------------------------------------------

    def _rlimit_args(self, long_lived: bool) -> list[str]:
        lim = self.limits
        if not self.prlimit:
            return []
        # a long-lived process sets the CPU limit of each job itself (its own CPU time adds up)
        cpu = "unlimited" if long_lived else str(lim.cpu_s)
        # RLIMIT_NPROC counts every task of the uid. As root each execution has a uid of its own.
        # Otherwise the user's tasks (the trainer's threads too) count against it, and so do the
        # executions that start beside this one: it may start `processes` more than the user runs
        # now for each of SHARED_PROCESS_LIMIT executions. A long-lived process (the code reward's
        # trusted side, which forks per job as the user's task count changes) keeps the user's own
        processes = [f"--nproc={lim.processes}"]
        if not self.as_root and long_lived:
            processes = []
        elif not self.as_root:
            processes = [f"--nproc={tasks_of_uid(os.getuid()) + lim.processes * SHARED_PROCESS_LIMIT}"]
        return [self.prlimit, f"--cpu={cpu}", f"--as={lim.memory_mb * 2**20}",
                f"--fsize={lim.file_size_mb * 2**20}", f"--nofile={lim.open_files}",
                *processes, "--core=0", "--"]

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
        memory_fds = [memory_file("main", main)] + [memory_file(n, s) for n, s in (modules or {}).items()]
        seccomp_fd = seccomp.filter_fd() if self.isolated else None
        label = LONG_LIVED_LABEL if long_lived else EXECUTION_LABEL
        # RLIMIT_NPROC set in bubblewrap's user namespace counts only its tasks (Linux >= 5.14): the
        # execution's own `processes`, whatever runs beside it under the uid (which _rlimit_args bounds)
        nproc = self.limits.processes if self.isolated and (self.as_root or namespaced_nproc()) else 0
        inner = [self.python, "-I", "-B", "-c", BOOT, label, str(started_w), str(memory_fds[0]), str(nproc),
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
            return "bwrap is not installed: no `bwrap` on PATH"
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

