"""One-rank training jobs forked from a process that has imported the trainer and vLLM's engine
already (multiprocessing's forkserver with helpers/warm_preload.py preloaded): about 6 s of
imports skipped a job. Each job is a real process of its own, killed for real.
tests/test_checkpoints_resume.py starts the same job many times to kill it, and conftest's
`run` starts every `python -m megagrpo.train` from the repository root this way.

    job = WarmJob(["--config", ..., "key=value"], log_path, {"MEGAGRPO_CRASH_AT": ...})
    job.poll(); job.kill(); job.wait()   # as subprocess.Popen's; returncode -9 after SIGKILL

Measured (2026-12-06, Python 3.11.7, the 2-core test machine shared with other suites; a
one-rank launch that exits at its config check, the three interleaved, 5 each): cold 7.9 s
median (7.5-11.4), WarmJob 16.5 s (14.3-25.0), a warm_ranks.py stand-in 0.48 s (0.43-0.73).
WarmJob starts nothing warm: Python 3.11's forkserver ignores the sys_path it is handed, so its
server cannot import warm_preload (tests/helpers is not on its path) and multiprocessing
swallows the ImportError; each job imports the trainer in the forked child (6.2-7.3 s, measured
inside it). So one mechanism would do: warm_ranks' stand-in for one-rank jobs too, given a
server per import-time environment (a one-rank job's OMP_NUM_THREADS is not torchrun's) and
the rank's pid for kill() (the stand-in's death reaches the rank only through the server).
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import sys

from warm_ranks import python_path

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["warm_preload"])  # before the server starts: its first job


def _job(argv: list[str], log_path: str, env: dict, stderr_path: str | None, whole_env: bool) -> None:
    os.setsid()  # a process group of its own, for the leftovers of a job (run() kills them)
    out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND) if stderr_path else out, 2)
    sys.stdout.reconfigure(line_buffering=True)
    faulthandler.enable()  # SIGABRT prints where it hung, as PYTHONFAULTHANDLER does for a cold one
    if whole_env:  # the job's environment exactly, not the server's with these added
        os.environ.clear()
    from warm_preload import environment_after_imports
    os.environ.update(environment_after_imports(env))
    sys.path[1:1] = [p for p in python_path(env) if p not in sys.path]  # the folders its PYTHONPATH adds
    from megagrpo.process_exit import exit_without_teardown
    from megagrpo.train import main
    exit_without_teardown(main(argv))


class WarmJob:
    """stderr_path: stderr apart (default: with stdout in log_path); whole_env: `env` is the job's
    whole environment (default: added to the forkserver's)."""

    def __init__(self, argv: list[str], log_path, env: dict | None = None, stderr_path=None, whole_env=False):
        self.process = _context.Process(target=_job, args=(argv, str(log_path), env or {},
                                                           stderr_path and str(stderr_path), whole_env))
        self.process.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self):
        return self.process.exitcode

    def poll(self):
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self, timeout: float | None = 600):
        self.process.join(timeout)
        if self.process.exitcode is None:
            self.process.kill()
            raise TimeoutError(f"the job did not end within {timeout} s")
        return self.process.exitcode
