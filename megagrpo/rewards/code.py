"""The code reward: syntax, unit tests in the sandbox, efficiency.

    reward = syntax_weight x [the code compiles]
           + tests_weight x (tests passed / tests)
           + efficiency_weight x min(1, time_budget / test time)   (0 when no test passed)

and 0, with a reason, when the code does not compile or its execution fails in the sandbox
(timeout, memory, crash, output limit, an exception at top level, no result). The code is the
last ```python (else last ```) fenced block of the completion, or the whole completion.
Rows carry `tests`: a list of Python snippets (usually `assert` lines), or one string with one
test per line, run in the namespace of the completion's code; optionally `time_budget_s`.
"""
from __future__ import annotations

import ast
import json
import re
import secrets

from megagrpo.rewards import Scores
from megagrpo.rewards.sandbox import STATUSES, Sandbox, SandboxLimits, SandboxPool

_FENCE_PYTHON = r"```(?:python|py|python3)[^\n]*\n(.*?)```"
_FENCE_ANY = r"```[^\n]*\n(.*?)```"

# Runs inside the sandbox. The payload (code, tests, a nonce) comes on stdin and is read before
# the completion's code runs; the result line carries the nonce, so output the program prints
# cannot pass for it. An exception at top level of the code ends the program (status "error").
HARNESS = r'''
import json, sys, time
def _megagrpo_harness():
    payload = json.loads(sys.stdin.read())
    nonce, tests = payload["nonce"], payload["tests"]
    namespace = {"__name__": "__solution__"}
    exec(compile(payload["code"], "solution.py", "exec"), namespace)
    passed, failures, start = 0, [], time.perf_counter()
    for test in tests:
        try:
            exec(compile(test, "test.py", "exec"), namespace)
            passed += 1
        except BaseException as e:
            failures.append(f"{type(e).__name__}: {e}"[:200])
    seconds = time.perf_counter() - start
    sys.stdout.flush()
    sys.stdout.write("\n" + nonce + json.dumps({"passed": passed, "total": len(tests),
                                                  "seconds": seconds, "failures": failures[:3]}) + "\n")
    sys.stdout.flush()
_megagrpo_harness()
'''


def extract_code(completion: str) -> str:
    """The last ```python fenced block, else the last fenced block, else the whole text."""
    for pattern in (_FENCE_PYTHON, _FENCE_ANY):
        blocks = re.findall(pattern, completion, re.DOTALL)
        if blocks:
            return blocks[-1]
    return completion


def syntax_ok(code: str) -> tuple[bool, str]:
    try:
        ast.parse(code)
        compile(code, "solution.py", "exec")
        return True, ""
    except (SyntaxError, ValueError) as e:
        return False, f"{type(e).__name__}: {e}"[:300]


def _tests_of(row) -> list[str]:
    if row is None:
        raise ValueError("the code reward needs a 'tests' field (a list of assert snippets) in every row")
    if isinstance(row, str):
        return [line for line in row.splitlines() if line.strip()]
    return [str(t) for t in row]


def parse_result(stdout: str, nonce: str):
    """The harness's result (dict) from the last line carrying the nonce, else None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(nonce):
            try:
                return json.loads(line[len(nonce):])
            except json.JSONDecodeError:
                return None
    return None


class CodeReward:
    """The built-in reward `code`; built once per process (it owns the sandbox pool)."""

    def __init__(self, config=None, syntax_weight: float = 0.2, tests_weight: float = 0.6,
                 efficiency_weight: float = 0.2, time_budget_s: float = 1.0, workers: int = 2,
                 batch_budget_s: float = 60.0,
                 sandbox: str = "auto", timeout_s: float = 5.0, cpu_s: int = 5,
                 memory_mb: int = 1024, file_size_mb: int = 16, processes: int = 16,
                 open_files: int = 64, output_bytes: int = 65536):
        self.weights = (syntax_weight, tests_weight, efficiency_weight)
        self.time_budget_s, self.batch_budget_s = time_budget_s, batch_budget_s
        limits = SandboxLimits(timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb,
                               file_size_mb=file_size_mb, open_files=open_files,
                               processes=processes, output_bytes=output_bytes)
        self.pool = SandboxPool(Sandbox(limits, mode=sandbox), workers)

    def __call__(self, prompts, completions, tests=None, time_budget_s=None, **_) -> Scores:
        n = len(completions)
        if n and tests is None:
            _tests_of(None)
        w_syntax, w_tests, w_eff = self.weights
        totals, reasons = [0.0] * n, [""] * n
        comp = {"syntax": [0.0] * n, "tests": [0.0] * n, "efficiency": [0.0] * n}
        status = ["ok"] * n
        jobs, where, nonces = [], [], []
        for i, completion in enumerate(completions):
            code = extract_code(completion)
            ok, why = syntax_ok(code)
            if not ok:
                status[i], reasons[i] = "syntax_error", why
                continue
            comp["syntax"][i] = 1.0
            nonce = secrets.token_hex(16)
            jobs.append((HARNESS, json.dumps({"nonce": nonce, "code": code, "tests": _tests_of(tests[i])})))
            where.append(i)
            nonces.append(nonce)
        for i, nonce, result in zip(where, nonces, self.pool.run_many(jobs, self.batch_budget_s)):
            if not result.ok:
                status[i], reasons[i] = result.status, result.reason
                continue
            report = parse_result(result.stdout, nonce)
            if report is None:
                status[i], reasons[i] = "no_result", "the program ended before the tests reported"
                continue
            fraction = report["passed"] / report["total"] if report["total"] else 0.0
            budget = float(time_budget_s[i]) if time_budget_s is not None and time_budget_s[i] is not None \
                else self.time_budget_s
            efficiency = min(1.0, budget / max(report["seconds"], 1e-9)) if report["passed"] else 0.0
            comp["tests"][i], comp["efficiency"][i] = fraction, efficiency
            totals[i] = w_syntax + w_tests * fraction + w_eff * efficiency
            if report["failures"]:
                reasons[i] = f"{report['total'] - report['passed']} of {report['total']} tests failed: " \
                             f"{report['failures'][0]}"
        for s in ("syntax_error", "no_result") + STATUSES[1:]:
            comp[f"fail/{s}"] = [1.0 if st == s else 0.0 for st in status]
        return Scores(totals, components=comp, reasons=[f"{st}: {r}" if st != "ok" else r
                                                        for st, r in zip(status, reasons)])

    def close(self) -> None:
        self.pool.close()
