"""One-rank training jobs forked from a process that has imported the trainer already
(multiprocessing's forkserver with `megagrpo.train` preloaded), for tests that start the same job
many times to kill it (tests/test_checkpoints_resume.py): a job is ready in about 2 s instead of
6.5 s, 4 of which are imports. Each job is a real process of its own, killed for real.

    job = WarmJob(["--config", ..., "key=value"], log_path, {"MEGAGRPO_CRASH_AT": ...})
    job.poll(); job.kill(); job.wait()   # as subprocess.Popen's; returncode -9 after SIGKILL
"""
from __future__ import annotations

import multiprocessing
import os
import sys

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["megagrpo.train"])  # before the server starts: its first job


def _job(argv: list[str], log_path: str, env: dict) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout.reconfigure(line_buffering=True)
    os.environ.update(env)
    from megagrpo.process_exit import exit_without_teardown
    from megagrpo.train import main
    exit_without_teardown(main(argv))


class WarmJob:
    def __init__(self, argv: list[str], log_path, env: dict | None = None):
        self.process = _context.Process(target=_job, args=(argv, str(log_path), env or {}))
        self.process.start()

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
