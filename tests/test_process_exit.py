"""megagrpo/process_exit.py: a process ended without the interpreter's teardown still runs its
atexit hooks, waits for its non-daemon threads (and stops idle thread-pool workers), flushes
what it printed and exits with its code. (The trainer's tp=2 runs in test_policy_parallel.py
check that vLLM-CPU's shared-memory segments are still removed.)"""
import subprocess
import sys

from conftest import ROOT

PROGRAM = r"""
import atexit, concurrent.futures, sys, threading, time
from megagrpo.process_exit import exit_without_teardown
atexit.register(lambda: print("atexit hook ran", flush=True))
pool = concurrent.futures.ThreadPoolExecutor(1)  # its idle worker must be stopped, not waited for
pool.submit(lambda: None).result()
def late():
    time.sleep(0.3)
    print("thread finished", flush=True)
threading.Thread(target=late).start()
sys.stdout.write("unflushed line\n")
sys.stderr.write("unflushed error\n")
exit_without_teardown(int(sys.argv[1]) if sys.argv[1] != "none" else None)
print("not reached")
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROGRAM, code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})


def test_exit_runs_the_hooks_waits_for_threads_and_keeps_the_code():
    for code, expected in (("3", 3), ("0", 0), ("none", 0)):
        proc = _run(code)
        assert proc.returncode == expected, (code, proc.returncode, proc.stderr)
        assert proc.stdout.splitlines() == ["unflushed line", "thread finished", "atexit hook ran"], proc.stdout
        assert proc.stderr == "unflushed error\n"
