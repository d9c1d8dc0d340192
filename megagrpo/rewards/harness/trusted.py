"""The trusted test interpreter: runs a row's tests against a solution it never shares memory,
an interpreter or a file descriptor with.

It runs in a sandbox of its own and serves the trainer over its control socket (argv[1]) for
many solutions: per job it receives one end of a fresh socket to the solution's interpreter
(SCM_RIGHTS), then the job frame {"tests", "cpu_s", "message_bytes"}, forks a child that runs
the tests, and ends the job with an {"end": true} frame. The child's namespace holds one proxy
per top-level callable of the solution (names of built-ins excepted, so `len` stays `len`);
a proxy call sends plain-data arguments and gets back a plain-data value, rebuilt here as fresh
built-in objects. The child counts, times (wall time of each call, measured here) and reports:
{"passed", "total", "seconds", "calls", "failures", "ready", "init_error"}.
"""
import builtins
import os
import resource
import socket
import sys
import time

import wire

EXCEPTIONS = {name: value for name, value in vars(builtins).items()
              if isinstance(value, type) and issubclass(value, Exception)}


class SolutionFailed(Exception):
    """The solution's process could not answer: it ended, or it broke the protocol."""


class SolutionRaised(Exception):
    """The solution raised an exception that is not one of Python's built-in ones."""


class Solution:
    """The trusted side of the channel to one solution process."""

    def __init__(self, sock, message_bytes: int):
        self.sock, self.message_bytes = sock, message_bytes
        self.broken = None  # why the channel is unusable, once it is
        self.seconds, self.calls = 0.0, 0

    def _recv(self):
        try:
            frame = wire.recv_frame(self.sock, self.message_bytes)
        except (OSError, wire.FrameError) as e:
            frame, self.broken = None, f"{type(e).__name__}: {e}"
        if frame is None:
            self.broken = self.broken or "the solution process ended"
        return frame

    def hello(self):
        """(callable names, None) once the solution's code has run, else (None, why not)."""
        frame = self._recv()
        if isinstance(frame, dict) and isinstance(frame.get("names"), list) and len(frame["names"]) <= 10000:
            names = [n for n in frame["names"] if type(n) is str and n.isidentifier() and not n.startswith("__")]
            return names, None
        if isinstance(frame, dict) and type(frame.get("init_error")) is str:
            self.broken = "the solution's code raised"
            return None, frame["init_error"][:300]
        self.broken = self.broken or "the solution process sent no list of functions"
        return None, self.broken

    def call(self, name: str, args: tuple, kwargs: dict):
        if self.broken:
            raise SolutionFailed(self.broken)
        try:
            request = {"id": self.calls, "call": wire.encode((name, list(args), kwargs))}
        except wire.NotPlainData as e:
            raise TypeError(f"an argument to {name}() is not plain data ({e})") from None
        self.calls += 1
        start = time.perf_counter()
        try:
            wire.send_frame(self.sock, request, self.message_bytes)
        except (OSError, wire.FrameError) as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise SolutionFailed(self.broken) from None
        reply = self._recv()
        self.seconds += time.perf_counter() - start
        if reply is None:
            raise SolutionFailed(self.broken)
        if not isinstance(reply, dict) or reply.get("id") != request["id"]:
            self.broken = "the solution process answered out of turn"
            raise SolutionFailed(self.broken)
        if "value" in reply:
            try:
                return wire.decode(reply["value"])
            except wire.NotPlainData as e:
                raise SolutionFailed(f"{name}() returned something that is not plain data ({e})") from None
        raised = reply.get("raised")
        if isinstance(raised, list) and len(raised) == 2 and all(type(x) is str for x in raised):
            kind, message = raised[0][:100], raised[1][:300]
            if kind in EXCEPTIONS:
                raise EXCEPTIONS[kind](message)
            raise SolutionRaised(f"{kind}: {message}")
        if type(reply.get("not_plain")) is str:
            raise SolutionFailed(f"{name}() returned a value that is not plain data: {reply['not_plain'][:200]}")
        self.broken = "the solution process sent a malformed answer"
        raise SolutionFailed(self.broken)


class Proxy:
    """Stands for the solution's function `name` in the tests' namespace."""

    def __init__(self, solution: Solution, name: str):
        self._solution, self.__name__ = solution, name

    def __call__(self, *args, **kwargs):
        return self._solution.call(self.__name__, args, kwargs)

    def __repr__(self):
        return f"<solution function {self.__name__}>"


def run_tests(job: dict, sock) -> dict:
    """The report of one job (see the module docstring)."""
    solution = Solution(sock, job["message_bytes"])
    tests = job["tests"]
    names, init_error = solution.hello()
    namespace = {"__name__": "__tests__", "__builtins__": builtins}
    for name in names or ():
        if not hasattr(builtins, name):
            namespace[name] = Proxy(solution, name)
    passed, failures = 0, []
    for test in tests if names is not None else ():
        try:
            exec(compile(test, "test.py", "exec"), namespace)
            passed += 1
        except BaseException as e:  # noqa: BLE001 - a failing test, whatever it raised
            failures.append(f"{type(e).__name__}: {e}"[:300])
    return {"passed": passed, "total": len(tests), "seconds": solution.seconds, "calls": solution.calls,
            "failures": failures[:3], "ready": names is not None, "init_error": init_error}


def serve(control) -> None:
    while True:
        message, fds, _, _ = socket.recv_fds(control, 1, 1)
        if not message:
            return
        job = wire.recv_frame(control, 1 << 26)
        if job is None:
            return
        pid = os.fork()
        if pid == 0:
            try:
                resource.setrlimit(resource.RLIMIT_CPU, (job["cpu_s"], job["cpu_s"]))
                with socket.socket(fileno=fds[0]) as sock:
                    report = run_tests(job, sock)
                wire.send_frame(control, {"report": report}, 1 << 26)
            except BaseException as e:  # noqa: BLE001
                try:
                    wire.send_frame(control, {"harness_error": f"{type(e).__name__}: {e}"[:300]}, 1 << 26)
                except BaseException:  # noqa: BLE001
                    os._exit(1)
            os._exit(0)
        for fd in fds:
            os.close(fd)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            wire.send_frame(control, {"harness_error": f"the test process ended with status {status}"}, 1 << 26)
        wire.send_frame(control, {"end": True}, 1 << 26)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
