"""Many sandboxed programs in parallel, with a time budget per batch: a batch of hostile
programs costs about budget_s + timeout_s, and a job that raises is a result, not a stop."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from megagrpo.sandbox.command import ExecResult, Sandbox


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
