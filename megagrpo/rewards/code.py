"""The code reward: syntax, unit tests judged outside the solution's interpreter, efficiency.

    reward = syntax_weight x [the code compiles]
           + tests_weight x (tests passed / tests)
           + efficiency_weight x min(1, time_budget / time in the solution's calls)  (0 when no test passed)

clamped to [0, syntax_weight + tests_weight + efficiency_weight], and 0, with a reason, when
the code does not compile, its top level fails (an exception, exit, timeout, memory, crash,
output limit), or no valid report comes back. The code is the last ```python (else last ```)
fenced block of the completion, or the whole completion.

Rows carry `tests`: a list of Python snippets (usually `assert` lines), or one string with one
test per line; or, with an `entry_point` field, one string defining `check(candidate)` (the
HumanEval format), run as one test `check(<entry_point>)`. Optionally `time_budget_s`. The
tests run in the trusted interpreter (`judge.py`), where each top-level function of the code is
a proxy that calls into the solution's process and gets plain data back.

`sandbox` is the mode (docs/sandbox.md): `auto` judges under bubblewrap or refuses to build;
`rlimits` accepts the weaker sandbox knowingly. Besides syntax, tests, efficiency and
fail/<status>, the components hold sandbox/<feature> (bubblewrap, seccomp, cgroups: 1 or 0),
from which `megagrpo report` says which sandbox judged the run.
"""
from __future__ import annotations

import ast
import re
import threading

from megagrpo.rewards import Scores
from megagrpo.rewards.judge import Judge, Verdict
from megagrpo.sandbox import FEATURES, STATUSES, Sandbox, SandboxLimits, SandboxPool

_FENCE_PYTHON = r"```(?:python|py|python3)[^\n]*\n(.*?)```"
_FENCE_ANY = r"```[^\n]*\n(.*?)```"
FAILURES = ("syntax_error", "invalid_report") + STATUSES[1:]
MAX_CODE_CHARS = 1 << 20


def extract_code(completion: str) -> str:
    """The last ```python fenced block, else the last fenced block, else the whole text."""
    for pattern in (_FENCE_PYTHON, _FENCE_ANY):
        blocks = re.findall(pattern, completion, re.DOTALL)
        if blocks:
            return blocks[-1]
    return completion


def syntax_ok(code: str) -> tuple[bool, str]:
    """Whether the code compiles (and can be handed to the sandbox), else why not."""
    if len(code) > MAX_CODE_CHARS:
        return False, f"the code is over {MAX_CODE_CHARS} characters"
    try:
        code.encode()
        ast.parse(code)
        compile(code, "solution.py", "exec")
        return True, ""
    except Exception as e:  # noqa: BLE001 - SyntaxError, ValueError (NUL), RecursionError, MemoryError, ...
        return False, f"{type(e).__name__}: {e}"[:300]


def tests_of(tests, entry_point=None) -> list[str]:
    """A row's tests as a list of snippets (see the module docstring)."""
    if tests is None:
        raise ValueError("the code reward needs a 'tests' field (a list of assert snippets) in every row")
    if entry_point:
        return [f"{tests if isinstance(tests, str) else chr(10).join(tests)}\ncheck({entry_point})"]
    if isinstance(tests, str):
        return [line for line in tests.splitlines() if line.strip()]
    return [str(t) for t in tests]


class CodeReward:
    """The built-in reward `code`; built once per process (it owns the sandbox pool and one
    warm trusted interpreter per worker)."""

    def __init__(self, config=None, syntax_weight: float = 0.2, tests_weight: float = 0.6,
                 efficiency_weight: float = 0.2, time_budget_s: float = 1.0, workers: int = 2,
                 batch_budget_s: float = 60.0,
                 sandbox: str = "auto", timeout_s: float = 5.0, cpu_s: int = 5,
                 memory_mb: int = 1024, file_size_mb: int = 16, processes: int = 16,
                 open_files: int = 64, output_bytes: int = 65536, message_bytes: int = 4 * 2**20):
        self.weights = (syntax_weight, tests_weight, efficiency_weight)
        self.time_budget_s, self.batch_budget_s, self.message_bytes = time_budget_s, batch_budget_s, message_bytes
        limits = SandboxLimits(timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb,
                               file_size_mb=file_size_mb, open_files=open_files,
                               processes=processes, output_bytes=output_bytes)
        self.sandbox = Sandbox(limits, mode=sandbox)  # refuses, naming the way out, where `sandbox` cannot run
        self.sandbox.announce("code reward")
        self.pool = SandboxPool(self.sandbox, workers)
        self._local, self._judges, self._lock = threading.local(), [], threading.Lock()

    def _judge(self, code: str, tests: list[str]) -> Verdict:
        judge = getattr(self._local, "judge", None)
        if judge is None:
            judge = self._local.judge = Judge(self.sandbox, self.message_bytes)
            with self._lock:
                self._judges.append(judge)
        return judge.judge(code, tests)

    def __call__(self, prompts, completions, tests=None, time_budget_s=None, entry_point=None, **_) -> Scores:
        n = len(completions)
        if n and tests is None:
            tests_of(None)
        w_syntax, w_tests, w_eff = self.weights
        totals, reasons, status = [0.0] * n, [""] * n, ["ok"] * n
        comp = {"syntax": [0.0] * n, "tests": [0.0] * n, "efficiency": [0.0] * n}
        jobs, where = [], []
        for i, completion in enumerate(completions):
            code = extract_code(completion if isinstance(completion, str) else str(completion))
            ok, why = syntax_ok(code)
            if not ok:
                status[i], reasons[i] = "syntax_error", why
                continue
            comp["syntax"][i] = 1.0
            jobs.append((code, tests_of(tests[i], entry_point[i] if entry_point is not None else None)))
            where.append(i)
        verdicts = self.pool.map(
            self._judge, jobs, self.batch_budget_s,
            skipped=lambda: Verdict("timeout", f"not run: the batch's time budget of {self.batch_budget_s:g} s "
                                    "was spent before its turn", None, 0.0),
            failed=lambda e: Verdict("sandbox_error", f"{type(e).__name__}: {e}"[:300], None, 0.0))
        for i, verdict in zip(where, verdicts):
            if verdict.status != "ok":
                status[i], reasons[i] = verdict.status, verdict.reason
                continue
            report = verdict.report
            fraction = report["passed"] / report["total"] if report["total"] else 0.0
            budget = float(time_budget_s[i]) if time_budget_s is not None and time_budget_s[i] is not None \
                else self.time_budget_s
            efficiency = min(1.0, budget / max(report["seconds"], 1e-9)) if report["passed"] else 0.0
            comp["tests"][i], comp["efficiency"][i] = fraction, efficiency
            totals[i] = min(max(w_syntax + w_tests * fraction + w_eff * efficiency, 0.0), sum(self.weights))
            if report["failures"]:
                reasons[i] = f"{report['total'] - report['passed']} of {report['total']} tests failed: " \
                             f"{report['failures'][0]}"
        for s in FAILURES:
            comp[f"fail/{s}"] = [1.0 if st == s else 0.0 for st in status]
        features = self.sandbox.features  # which sandbox judged these, for `megagrpo report`
        for feature in FEATURES:
            comp[f"sandbox/{feature}"] = [float(features[feature])] * n
        return Scores(totals, components=comp, reasons=[f"{st}: {r}" if st != "ok" else r
                                                        for st, r in zip(status, reasons)])

    def close(self) -> None:
        self.pool.close()
        for judge in self._judges:
            judge.close()
        self.sandbox.close()
