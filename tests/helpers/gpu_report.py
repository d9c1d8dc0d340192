"""bench/gpu_check.sh's runner: the `env` step (what is installed), then the GPU tests
(tests/test_gpu.py) under pytest, with a plugin that writes every result into one JSON,
rewritten after each test, so that a run cut short still leaves what it did.

    python tests/helpers/gpu_report.py --work DIR --out FILE [--budget S] [pytest arguments]

which runs `pytest -m gpu -v -rs --tb=short --noconftest -p no:cacheprovider tests/test_gpu.py`.
The JSON:

    {"created", "host", "work", "environment": the env step's entry, "prepare": its entry,
     "checks": {name: entry, ...}, "summary": {"ok": [...], "failed": [...], "skipped": [...]}}

An entry is the step's own, {"ok": bool, "seconds": float, ...numbers..., "error": str or None},
or for a check that did not run {"ok": false, "seconds": 0.0, "skipped": true, "error": why}.
Without pytest every check says "missing: pytest". Exit code: pytest's (0 when no check
failed), 1 without pytest.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests" / "test_gpu.py"
PYTEST_ARGS = ["-m", "gpu", "-v", "-rs", "--tb=short", "--noconftest", "-p", "no:cacheprovider"]
TEST_NAME = "test_gpu_check"
WRITE_S = 10  # seconds of the budget kept for the last write


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Report:
    """A pytest plugin: each check's entry, taken from its test's reports, into one JSON."""

    def __init__(self, gpu_check, work: Path, out: Path, environment: dict):
        self.gpu_check, self.work, self.out, self.environment = gpu_check, work, out, environment
        self.started = time.time()
        self.entries, self.outcomes = {}, {}  # check name -> entry; -> passed, failed or skipped
        self.not_run_why = "not run: the run ended before it"

    def check_name(self, nodeid: str):
        name = nodeid.rpartition("[")[2].rstrip("]")
        return name if f"::{TEST_NAME}[" in nodeid and name in self.gpu_check.CHECKS else None

    def pytest_collectreport(self, report):
        if report.failed:  # tests/test_gpu.py does not import: no check runs
            self.not_run_why = f"not run: collecting {report.nodeid} failed: {str(report.longrepr)[-1500:]}"
            self.write()

    def pytest_deselected(self, items):
        for name in filter(None, (self.check_name(item.nodeid) for item in items)):
            self.entries[name] = {"ok": False, "seconds": 0.0, "skipped": True, "error": "not run: deselected"}
            self.outcomes[name] = "skipped"

    def pytest_runtest_logreport(self, report):
        name = self.check_name(report.nodeid)
        if name is None or report.when == "teardown" or (report.when == "setup" and report.passed):
            return
        self.entries[name] = entry_of(report)
        self.outcomes[name] = report.outcome
        self.write()

    def pytest_sessionfinish(self, session, exitstatus):
        self.write()

    def not_run(self, why: str) -> None:
        """Every check as not run, for `why`."""
        for name in self.gpu_check.CHECKS:
            self.entries[name] = {"ok": False, "seconds": 0.0, "skipped": True, "error": why}
            self.outcomes[name] = "skipped"
        self.write()

    def prepare(self) -> dict:
        """The prepare step's entry, when this run's tests ran it."""
        part = self.work / "parts" / "prepare.json"
        if part.exists() and part.stat().st_mtime >= self.started:
            return json.loads(part.read_text())
        return {"ok": False, "seconds": 0.0, "skipped": True, "error": "not run: no check ran"}

    def write(self) -> None:
        checks = self.gpu_check.CHECKS
        not_run = {"ok": False, "seconds": 0.0, "error": self.not_run_why}
        result = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(), "work": str(self.work),
                  "environment": self.environment, "prepare": self.prepare(),
                  "checks": {name: self.entries.get(name, not_run) for name in checks},
                  "summary": {"ok": [n for n in checks if self.outcomes.get(n) == "passed"],
                              "failed": [n for n in checks if self.outcomes.get(n, "failed") == "failed"],
                              "skipped": [n for n in checks if self.outcomes.get(n) == "skipped"]}}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        scratch = self.out.with_name(self.out.name + ".partial")
        scratch.write_text(json.dumps(result, indent=1) + "\n")  # the entries are JSON already
        os.replace(scratch, self.out)


def entry_of(report) -> dict:
    """The entry the test recorded, or, where the check did not get to run (skipped, its setup
    failed, pytest-timeout struck), one that says why."""
    entry = dict(report.user_properties).get("gpu_check")
    if entry is not None:
        return {**entry, "skipped": True} if report.skipped else entry
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (file, line, "Skipped: why")
        why = longrepr[2].removeprefix("Skipped: ")
    else:
        crash = getattr(longrepr, "reprcrash", None)
        why = crash.message if crash is not None else str(longrepr)
        if report.when == "setup":  # the prepare step (or another fixture) failed
            why = "not run: " + why.splitlines()[0]
    entry = {"ok": False, "seconds": round(report.duration, 3), "error": why[-2000:]}
    if report.skipped:
        entry["skipped"] = True
    return entry


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--work", required=True, type=Path, help="models, runs and logs")
    p.add_argument("--out", required=True, type=Path, help="the JSON")
    p.add_argument("--budget", type=float, default=None, help="seconds for everything (default: no limit)")
    args, pytest_args = p.parse_known_args(argv)
    deadline = time.time() + args.budget - WRITE_S if args.budget else float("inf")
    gpu_check = load_gpu_check()

    env_limit = max(1.0, min(gpu_check.TIMEOUTS["env"], deadline - time.time()))
    environment = gpu_check.run_isolated("env", args.work, env_limit)
    print(f"gpu_check env: {environment.get('error') or 'ok'}", flush=True)
    report = Report(gpu_check, args.work, args.out, environment)
    try:
        import pytest
    except ImportError as e:
        report.not_run(f"missing: pytest (bench/gpu_check.sh runs the checks as tests; {e})")
        print("gpu_check: missing: pytest", flush=True)
        return 1
    os.environ["GPU_CHECK_WORK"] = str(args.work)
    if args.budget:
        os.environ["GPU_CHECK_DEADLINE"] = str(deadline)
    return int(pytest.main([*PYTEST_ARGS, *pytest_args, str(TESTS)], plugins=[report]))


if __name__ == "__main__":
    raise SystemExit(main())
