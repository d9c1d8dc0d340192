"""Judging a solution against its tests with two interpreters that share nothing.

    trainer (Judge) ──control socket──> trusted test interpreter   (one per worker, kept warm)
        │                                   │ tests, proxies, counting, timing, the report
        │ stdin: the code                   │ socket: plain-data calls and values
        └── stdout/stderr (capped) <─── solution interpreter         (fresh per solution)

Both run in sandboxes of their own (their own uid, pid namespace and cgroup), so the model's
code cannot read, replace or signal anything that decides its score: not the tests, not the
counter, not the clock, not the report, which travels on a socket that only the trusted side
and the trainer hold. The trainer then validates the report (`validate_report`) before it is
turned into a reward. The programs themselves are in `harness/`.
"""
from __future__ import annotations

import math
import selectors
import socket
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from megagrpo.rewards.harness import wire
from megagrpo.sandbox import Sandbox, SandboxProcess, communicate

HARNESS = Path(__file__).parent / "harness"
SOURCES = {name: (HARNESS / f"{name}.py").read_text() for name in ("wire", "trusted", "solution")}
GRACE_S = 2.0  # after the solution is killed, how long the trusted side has to report
CONTROL_FRAME_BYTES = 1 << 20
MAX_FAILURES, FAILURE_CHARS = 3, 300


@dataclass
class Verdict:
    status: str  # "ok", a sandbox status or "invalid_report"
    reason: str
    report: dict | None  # validated; None unless status is "ok"
    wall_s: float


def validate_report(report, n_tests: int) -> tuple[dict | None, str]:
    """(a clean copy of the report, "") when every field is what the trusted side writes, else
    (None, what is wrong). Checked even though the trusted side wrote it: nothing that reaches a
    reward is taken on trust."""
    if not isinstance(report, dict):
        return None, f"the report is a {type(report).__name__}, not an object"
    fields = {"passed": int, "total": int, "calls": int, "seconds": float, "failures": list, "ready": bool}
    for key, kind in fields.items():
        value = report.get(key)
        if kind is float and type(value) is int:
            value = float(value)
        if type(value) is not kind:
            return None, f"report field '{key}' is {type(value).__name__}, not {kind.__name__}"
    passed, total, seconds = report["passed"], report["total"], float(report["seconds"])
    if total != n_tests:
        return None, f"the report counts {total} tests, the row has {n_tests}"
    if not 0 <= passed <= total:
        return None, f"the report says {passed} of {total} tests passed"
    if not math.isfinite(seconds) or seconds < 0:
        return None, f"the report's test time {seconds!r} is not a finite number >= 0"
    if report["calls"] < 0 or not all(type(f) is str for f in report["failures"]):
        return None, "the report's calls or failures are malformed"
    init_error = report.get("init_error")
    clean = {"passed": passed, "total": total, "seconds": seconds, "calls": report["calls"],
             "failures": [f[:FAILURE_CHARS] for f in report["failures"][:MAX_FAILURES]],
             "ready": report["ready"], "init_error": init_error[:FAILURE_CHARS] if type(init_error) is str else ""}
    return clean, ""


class ControlReader:
    """Frames from the trusted side for one job, up to its {"end": true}."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buffer, self.frames, self.ended, self.problem = sock, b"", [], False, ""

    def fileno(self) -> int:
        return self.sock.fileno()

    def feed(self, chunk: bytes) -> bool:
        """Take what was read; True once the job has ended (or the stream has, or broke)."""
        if not chunk:
            self.problem = self.problem or "the test interpreter's channel closed"
            return True
        self.buffer += chunk
        while len(self.buffer) >= 4:
            (length,) = struct.unpack(">I", self.buffer[:4])
            if length > CONTROL_FRAME_BYTES:
                self.problem = f"a control message of {length} bytes"
                return True
            if len(self.buffer) < 4 + length:
                break
            body, self.buffer = self.buffer[4:4 + length], self.buffer[4 + length:]
            try:
                frame = wire.loads(body)
            except wire.FrameError as e:
                self.problem = str(e)
                return True
            if isinstance(frame, dict) and frame.get("end") is True:
                self.ended = True
                return True
            self.frames.append(frame)
        return False

    def wait(self, deadline: float) -> None:
        """Read until the job ends or the deadline passes."""
        with selectors.DefaultSelector() as sel:
            sel.register(self.sock, selectors.EVENT_READ)
            while not (self.ended or self.problem):
                left = deadline - time.perf_counter()
                if left <= 0 or not sel.select(timeout=left):
                    return
                try:
                    chunk = self.sock.recv(65536)
                except OSError:
                    chunk = b""
                if self.feed(chunk):
                    return

    def report(self, n_tests: int) -> tuple[dict | None, str]:
        """The validated report of the job: exactly one, and well-formed."""
        if self.problem or not self.ended:
            return None, self.problem or "the test interpreter did not finish"
        reports = [f["report"] for f in self.frames if isinstance(f, dict) and "report" in f]
        errors = [str(f.get("harness_error"))[:FAILURE_CHARS] for f in self.frames
                  if isinstance(f, dict) and "harness_error" in f]
        if errors:
            return None, f"the test interpreter failed: {errors[0]}"
        if len(reports) != 1 or len(self.frames) != 1:
            return None, f"{len(reports)} reports in {len(self.frames)} messages, not exactly one"
        return validate_report(reports[0], n_tests)


class Judge:
    """Runs solutions against their tests; one per worker thread (it owns one warm trusted
    interpreter; each solution gets a fresh sandbox)."""

    def __init__(self, sandbox: Sandbox, message_bytes: int = 4 * 2**20):
        self.sandbox, self.message_bytes = sandbox, message_bytes
        self.trusted: SandboxProcess | None = None
        self.control: socket.socket | None = None

    def _start_trusted(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.trusted = self.sandbox.start(SOURCES["trusted"], {"wire": SOURCES["wire"]},
                                              args=(theirs.fileno(),), pass_fds=(theirs.fileno(),),
                                              long_lived=True, capture=False)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self.control = ours

    def _stop_trusted(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.trusted is not None:
            self.trusted.stop()
            self.trusted = None

    def _hand_over(self, solution_end: socket.socket, job: dict) -> None:
        """Give the trusted side its end of the solution's socket and the job; restarts it
        once if it has died."""
        for attempt in (1, 2):
            if self.trusted is None or self.trusted.popen.poll() is not None:
                self._stop_trusted()
                self._start_trusted()
            try:
                socket.send_fds(self.control, [b"J"], [solution_end.fileno()])
                wire.send_frame(self.control, job, 1 << 26)
                return
            except OSError:
                self._stop_trusted()
                if attempt == 2:
                    raise

    def judge(self, code: str, tests: list[str]) -> Verdict:
        """Run `code` against `tests`; never raises for what the code does."""
        limits = self.sandbox.limits
        start = time.perf_counter()
        deadline = start + limits.timeout_s
        ours, theirs = socket.socketpair()
        try:
            solution = self.sandbox.start(SOURCES["solution"], {"wire": SOURCES["wire"]},
                                          args=(theirs.fileno(), self.message_bytes), pass_fds=(theirs.fileno(),))
        except OSError as e:
            ours.close()
            return Verdict("sandbox_error", f"could not start the sandbox: {e}", None, time.perf_counter() - start)
        finally:
            theirs.close()
        try:
            self._hand_over(ours, {"tests": tests, "cpu_s": limits.cpu_s, "message_bytes": self.message_bytes})
        except OSError as e:
            solution.stop()
            return Verdict("sandbox_error", f"the test interpreter could not start: {e}", None,
                           time.perf_counter() - start)
        finally:
            ours.close()
        control = ControlReader(self.control)
        stopped, _, err = communicate(solution, code.encode(), deadline, limits.output_bytes, watch=control)
        if stopped is None:  # the solution closed its output; the tests may still be running
            control.wait(deadline)
            stopped = None if control.ended or control.problem else "timeout"
        if stopped in ("timeout", "output_limit"):
            solution.kill()  # the trusted side's calls now fail at once, and it reports
            control.wait(time.perf_counter() + GRACE_S)
        ended_on_its_own = solution.popen.poll() is not None
        report, problem = control.report(len(tests))
        if report is not None and not report["ready"] and stopped in ("watch_done", None):
            # the solution's code failed and its process is on its way out: its last words
            stopped, _, rest = communicate(solution, b"", deadline, limits.output_bytes)
            err += rest
            try:
                solution.popen.wait(timeout=max(0.0, deadline - time.perf_counter()) + 0.5)
                ended_on_its_own = True
            except subprocess.TimeoutExpired:
                stopped = "timeout"
        returncode, oom = solution.stop()
        if not control.ended:
            self._stop_trusted()  # it did not finish its job: start a fresh one next time
        verdict = self._verdict(stopped, ended_on_its_own, returncode, oom, err, solution.started,
                                report, problem, control.ended)
        verdict.wall_s = time.perf_counter() - start
        return verdict

    def _verdict(self, stopped, ended_on_its_own, returncode, oom, err, started, report, problem,
                 job_ended) -> Verdict:
        stderr = err.decode(errors="replace")
        if stopped in ("timeout", "output_limit") or ended_on_its_own:
            status, reason = self.sandbox.classify(stopped if stopped != "watch_done" else None,
                                                   returncode, stderr, started, oom)
            if status != "ok":
                return Verdict(status, reason, None, 0.0)
        if report is None:
            if not job_ended:
                return Verdict("sandbox_error", f"the test interpreter did not report: {problem}", None, 0.0)
            return Verdict("invalid_report", problem, None, 0.0)
        if not report["ready"]:
            why = report["init_error"] or "the solution's process ended before the tests ran"
            return Verdict("error", why, None, 0.0)
        return Verdict("ok", "", report, 0.0)

    def close(self) -> None:
        self._stop_trusted()
