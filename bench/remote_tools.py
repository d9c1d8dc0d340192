"""A stand-in for a remote API, for bench/async_rollout.py: the agentic task's `python` tool
answered after a fixed wait (BENCH_TOOL_WAIT_S, default 0.2 s) that uses no CPU, as a call to
a service elsewhere would. It evaluates only `print(A * B)` (the products the task asks for);
anything else gets an error message, as a failed call would."""
import os
import re
import time


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it prints (or its error).

    Args:
        code: the program; print the result
    """
    time.sleep(float(os.environ.get("BENCH_TOOL_WAIT_S", "0.2")))
    match = re.fullmatch(r"\s*print\(\s*(\d+)\s*\*\s*(\d+)\s*\)\s*", code)
    if match is None:
        return "error: this stand-in runs print(A * B) only"
    return str(int(match.group(1)) * int(match.group(2)))
