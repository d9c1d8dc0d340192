"""Run model-written code outside the trainer: one process per execution, under bubblewrap.

Each execution is a fresh process tree:

    [as root: setuid to an unused uid] setpriv --pdeathsig KILL -- prlimit <rlimits> --
        bwrap <namespaces, mounts> -- python3 -I -B /sandbox/main.py

- bubblewrap (Debian `bubblewrap`): new user, pid, net, ipc, uts (and cgroup) namespaces; the
  system's /usr read-only, the program read-only at /sandbox/main.py, an empty size-capped
  tmpfs at /tmp (also the working directory and $HOME), a private /proc and a minimal /dev;
  no /home, /root, /etc, /work or anything else of the host; the environment cleared
  (PATH, HOME, LANG only); a new session (no terminal); killed with its parent.
- rlimits (prlimit): CPU seconds, address space, file size, open files, processes, no core
  files. As root each execution runs under a uid of its own that no account uses, so that the
  process limit applies (the kernel does not count processes against root's limit), counts
  only that execution's processes (a fork bomb's dying processes cannot starve the next
  execution), and root-only files stay closed.
- a wall-clock timeout and an output cap, enforced from here: past either the whole sandbox is
  killed (its pid namespace dies with it); if the trainer dies, so does the sandbox
  (parent-death signal).

Where bubblewrap is missing or cannot create namespaces, `mode="auto"` falls back to rlimits
only (a scrubbed environment and a fresh working directory, no isolation of the file system or
network) with a loud warning; `mode="strict"` refuses to start. Failures of the sandboxed
program are results, never exceptions: a status from a fixed set and a reason.
"""
from __future__ import annotations

import os
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
from dataclasses import dataclass

# Every execution ends in exactly one of these (fixed, so ranks can reduce counts of them).
STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "crash", "sandbox_error")
MODES = ("auto", "strict", "rlimits")
SANDBOX_UID_BASE = 2_000_000  # per-execution uids: base + (pid % 1000) * 1000 + (n % 1000)


class SandboxUnavailable(RuntimeError):
    """mode="strict" and bubblewrap cannot run here."""


@dataclass
class SandboxLimits:
    timeout_s: float = 5.0
    """Wall-clock limit of one execution (sleeping or blocked programs included)."""
    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = 1024
    """Address space (RLIMIT_AS) of each process of the program."""
    file_size_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE); also the size of its tmpfs."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    processes: int = 16
    """Processes of the sandbox user (RLIMIT_NPROC)."""
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


class Sandbox:
    """Runs one program per call, isolated as described in the module docstring."""

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
        self._count, self._count_lock = 0, threading.Lock()
        self.isolated = False
        if mode != "rlimits":
            problem = self._probe_bwrap()
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

    # ---- the command line ---------------------------------------------------------------------

    def _rlimit_args(self) -> list[str]:
        lim = self.limits
        if not self.prlimit:
            return []
        return [self.prlimit, f"--cpu={lim.cpu_s}", f"--as={lim.memory_mb * 2**20}",
                f"--fsize={lim.file_size_mb * 2**20}", f"--nofile={lim.open_files}",
                f"--nproc={lim.processes}", "--core=0", "--"]

    def _bwrap_args(self, program_path: str) -> list[str]:
        args = [self.bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
                "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session",
                "--clearenv", "--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            if os.path.islink(f"/{link}"):
                args += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
            elif os.path.isdir(f"/{link}"):
                args += ["--ro-bind", f"/{link}", f"/{link}"]
        prefix = os.path.dirname(os.path.dirname(self.python))
        if not self.python.startswith("/usr/"):  # an interpreter outside /usr: its prefix, read-only
            args += ["--ro-bind", prefix, prefix]
        args += ["--proc", "/proc", "--dev", "/dev",
                 "--size", str(self.limits.file_size_mb * 2**20), "--tmpfs", "/tmp",
                 "--ro-bind", program_path, "/sandbox/main.py", "--chdir", "/tmp",
                 "--setenv", "HOME", "/tmp", "--setenv", "PATH", "/usr/bin:/bin",
                 "--setenv", "LANG", "C.UTF-8", "--"]
        return args

    def _command(self, program_path: str) -> list[str]:
        inner = [self.python, "-I", "-B", "/sandbox/main.py" if self.isolated else program_path]
        # killed if the thread that started it dies (a crashed trainer leaves no sandbox behind)
        outer = [self.setpriv, "--pdeathsig", "KILL", "--"] if self.setpriv else []
        if self.isolated:
            return outer + self._rlimit_args() + self._bwrap_args(program_path) + inner
        return outer + self._rlimit_args() + inner

    def _probe_bwrap(self) -> str | None:
        """None when bubblewrap runs a trivial program here, else why not."""
        if not self.bwrap:
            return "bwrap is not installed"
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write("print('ok')\n")
        os.chmod(f.name, 0o644)
        try:
            proc = subprocess.run(self._rlimit_args() + self._bwrap_args(f.name) +
                                  [self.python, "-I", "-B", "/sandbox/main.py"],
                                  capture_output=True, text=True, timeout=30,
                                  **self._user_kwargs(self._next_uid()))
        except (OSError, subprocess.SubprocessError) as e:
            return f"{type(e).__name__}: {e}"
        finally:
            os.unlink(f.name)
        if proc.returncode != 0 or proc.stdout.strip() != "ok":
            return f"exit {proc.returncode}: {_last_line(proc.stderr)}"
        return None

    def _next_uid(self) -> int | None:
        """A uid of its own for the next execution (as root), else None (run as ourselves)."""
        if not self.as_root:
            return None
        with self._count_lock:
            self._count += 1
            return SANDBOX_UID_BASE + (os.getpid() % 1000) * 1000 + self._count % 1000

    @staticmethod
    def _user_kwargs(uid: int | None) -> dict:
        return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}

    # ---- one execution ------------------------------------------------------------------------

    def run(self, code: str, stdin: str = "") -> ExecResult:
        """Run `code` as a Python program with `stdin`; never raises for what the program does."""
        start = time.perf_counter()
        workdir = tempfile.mkdtemp(prefix="megagrpo-sandbox-")
        try:
            os.chmod(workdir, 0o755)
            program = os.path.join(workdir, "main.py")
            with open(program, "w") as f:
                f.write(code)
            os.chmod(program, 0o644)
            cwd, uid = workdir, self._next_uid()
            if not self.isolated:  # rlimits only: a fresh directory the program may write
                cwd = os.path.join(workdir, "tmp")
                os.mkdir(cwd)
                if uid is not None:
                    os.chown(cwd, uid, uid)
            env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8"}
            try:
                proc = subprocess.Popen(self._command(program), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                                        env=env, start_new_session=True, **self._user_kwargs(uid))
            except OSError as e:
                return ExecResult("sandbox_error", f"could not start the sandbox: {e}", None, "", "",
                                  time.perf_counter() - start)
            try:
                return self._supervise(proc, stdin.encode(), start)
            finally:
                if not self.isolated and uid is not None:
                    self._kill_uid(uid)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _kill_uid(self, uid: int) -> None:
        """rlimits only: what the program forked may have left its process group; every
        process of the execution's own uid is killed (`kill -KILL -1` run as that uid)."""
        if self.kill:
            subprocess.run([self.kill, "-KILL", "-1"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, **self._user_kwargs(uid))

    def _supervise(self, proc: subprocess.Popen, stdin: bytes, start: float) -> ExecResult:
        """Feed stdin, collect capped output, enforce the wall clock; always reaps the process."""
        lim = self.limits
        deadline = start + lim.timeout_s
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        out = {out_fd: bytearray(), err_fd: bytearray()}
        stopped = None
        pending = memoryview(stdin[: 16 * 2**20])
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            sel.register(proc.stderr, selectors.EVENT_READ)
            if pending:  # fed as the program reads it: a program that never reads cannot block us
                os.set_blocking(proc.stdin.fileno(), False)
                sel.register(proc.stdin, selectors.EVENT_WRITE)
            else:
                proc.stdin.close()
            while sel.get_map():
                left = deadline - time.perf_counter()
                if left <= 0:
                    stopped = "timeout"
                    break
                for key, _ in sel.select(timeout=min(left, 0.5)):
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
                    if len(buf) > lim.output_bytes:
                        stopped = "output_limit"
                        break
                if stopped:
                    break
        if stopped:
            self._kill(proc)
        try:
            returncode = proc.wait(timeout=max(0.0, deadline - time.perf_counter()) + 0.5)
        except subprocess.TimeoutExpired:
            stopped = stopped or "timeout"
            self._kill(proc)
            returncode = proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()
        wall = time.perf_counter() - start
        stdout = out[out_fd][: lim.output_bytes].decode(errors="replace")
        stderr = out[err_fd][: lim.output_bytes].decode(errors="replace")
        status, reason = self._classify(stopped, returncode, stderr)
        return ExecResult(status, reason, returncode, stdout, stderr, wall)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        """SIGKILL the process group (prlimit/bwrap; bwrap's pid namespace dies with it)."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.kill()
        except ProcessLookupError:
            pass

    def _classify(self, stopped, returncode, stderr) -> tuple[str, str]:
        lim = self.limits
        if stopped == "timeout":
            return "timeout", f"wall-clock timeout after {lim.timeout_s:g} s"
        if stopped == "output_limit":
            return "output_limit", f"output over {lim.output_bytes} bytes"
        if returncode == 0:
            return "ok", ""
        last = _last_line(stderr)
        if last.startswith("bwrap:"):
            return "sandbox_error", last
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


class SandboxPool:
    """Runs many programs in parallel, up to `workers` sandboxes at once."""

    def __init__(self, sandbox: Sandbox, workers: int = 2):
        self.sandbox = sandbox
        self.workers = max(1, workers)
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="megagrpo-sandbox")

    def run_many(self, jobs: list[tuple[str, str]], budget_s: float | None = None) -> list[ExecResult]:
        """[(code, stdin)] -> [ExecResult] in the same order. A failure of the machinery itself
        (not of the program) becomes a sandbox_error result, never an exception. With
        `budget_s`, a job that has not started when the batch has run that long is not run
        (status timeout), so that a batch of hostile programs costs about budget_s + timeout_s,
        not len(jobs) / workers x timeout_s."""
        deadline = time.perf_counter() + budget_s if budget_s else None

        def run(code, stdin):
            if deadline is not None and time.perf_counter() > deadline:
                return ExecResult("timeout", f"not run: the batch's time budget of {budget_s:g} s "
                                  "was spent before its turn", None, "", "", 0.0)
            return self.sandbox.run(code, stdin)

        futures = [self._executor.submit(run, code, stdin) for code, stdin in jobs]
        results = []
        for future in futures:
            try:
                results.append(future.result())
            except Exception as e:  # noqa: BLE001 - a broken sandbox must not stop training
                results.append(ExecResult("sandbox_error", f"{type(e).__name__}: {e}", None, "", "", 0.0))
        return results

    def close(self) -> None:
        self._executor.shutdown(wait=True)
