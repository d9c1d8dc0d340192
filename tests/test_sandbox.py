"""The code sandbox against adversarial programs, through the code reward.

Every program does its mischief at top level and checks its own success; its unit test passes
only if the mischief worked (the secret was read, the connection made, ...). A contained
program therefore scores 0 with a reason, and the host-side evidence (files, listener, this
process, leftover processes) is checked as well.

No test asserts on wall time (a loaded 2-core machine stretches any bound): a timeout shows as
status "timeout" with its reason, a kill as the program's missing result; bench/ has timings.
"""
import errno
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from megagrpo.rewards.code import CodeReward, extract_code
from megagrpo.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from megagrpo.sandbox.process import EXECUTION_LABEL

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))
from sandbox_host import sandbox_processes, sandbox_processes_after_cleanup  # noqa: E402

# its checks look at the whole machine (every sandboxed process, free space in /tmp)
pytestmark = pytest.mark.alone

TIMEOUT_S = 1.5
LIMITS = dict(timeout_s=TIMEOUT_S, cpu_s=2, memory_mb=256, file_size_mb=8, processes=16,
              output_bytes=64 * 1024)


@pytest.fixture(scope="module")
def reward():
    r = CodeReward(sandbox="strict", workers=4, **LIMITS)
    yield r
    r.close()


@pytest.fixture(scope="module")
def sandbox():
    sb = Sandbox(SandboxLimits(**LIMITS), mode="strict")
    yield sb
    sb.close()


def run_json(sandbox, code):
    """What a program that prints one JSON value printed (it must succeed)."""
    result = sandbox.run(code)
    assert result.ok, result
    return json.loads(result.stdout)


def score(reward, code, tests=("assert True",)):
    s = reward(["q"], [f"```python\n{code}\n```"], tests=[list(tests)])
    return s[0], s.reasons[0], {k: v[0] for k, v in s.components.items()}


def assert_contained(value, reason, components, statuses):
    assert value == 0.0, (value, reason)
    assert any(reason.startswith(f"{s}:") for s in statuses), reason
    assert sum(components[f"fail/{s}"] for s in statuses) == 1.0
    # the trainer side is intact and the sandbox left nothing running
    assert sandbox_processes_after_cleanup() == []


def said_started(pid: int, python: str) -> bool:
    """Whether `pid` is a sandboxed interpreter past BOOT's "started" byte (BOOT closes that
    pipe, whose fd number follows the label on its command line, right after writing it;
    bubblewrap, whose command line holds the label too, is not the interpreter)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if argv[0] != os.fsencode(python) or EXECUTION_LABEL.encode() not in argv:
            return False
        started_fd = argv[argv.index(EXECUTION_LABEL.encode()) + 1].decode()
        return os.path.isdir(f"/proc/{pid}/fd") and not os.path.exists(f"/proc/{pid}/fd/{started_fd}")
    except (OSError, IndexError):
        return False


def test_the_leak_check_sees_a_running_sandbox():
    """The leak check is not vacuous, as root (uids) or not (command lines): it finds an
    execution while it runs, and killing what it found ends that execution (killed, not timed
    out: the sleep would outlast the 120 s timeout), after which nothing is left."""
    sb = Sandbox(SandboxLimits(**{**LIMITS, "timeout_s": 120}), mode="strict")
    results = []
    runner = threading.Thread(target=lambda: results.append(sb.run("import time\ntime.sleep(600)")))
    runner.start()
    try:
        found = []
        # bubblewrap, its pid namespace's init, python; killed before python has said "started",
        # the execution would be a sandbox_error, not the program's crash
        while not (len(found) >= 3 and any(said_started(pid, sb.python) for pid, _ in found)) and runner.is_alive():
            found = sandbox_processes()
            time.sleep(0.02)
        assert found, f"the leak check did not see the running sandbox: {results}"
        for pid, _ in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        runner.join()
    assert results[0].status == "crash" and "SIGKILL" in results[0].reason, results[0]
    assert sandbox_processes_after_cleanup() == []


def test_a_trivial_program_passes(reward):
    value, reason, comp = score(reward, "def add(a, b):\n    return a + b",
                                ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"])
    assert (value, reason) == (1.0, "") and comp["tests"] == 1.0 and comp["efficiency"] == 1.0


def test_infinite_loop(reward):
    value, reason, comp = score(reward, "while True:\n    pass")
    assert_contained(value, reason, comp, ["timeout"])


def test_fork_bomb(reward):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    value, reason, comp = score(reward, code)
    assert_contained(value, reason, comp, ["timeout"])
    # the process limit held inside, and the next program starts normally
    assert score(reward, "def one():\n    return 1", ["assert one() == 1"])[0] == 1.0


def test_fork_bomb_without_retry_hits_the_process_limit(reward):
    value, reason, comp = score(reward, "import os\nwhile True:\n    os.fork()")
    # status "error", not "timeout": fork was refused by RLIMIT_NPROC and the program died of
    # it. (Which traceback line ends up in the reason varies: forked children print too.)
    assert_contained(value, reason, comp, ["error"])


def test_a_fork_bomb_leaves_the_execution_beside_it_its_processes():
    """An honest program that has started, then forks after a fork bomb began beside it, gets
    every process of its limit. Without root both run under one uid; the process limit is set in
    each execution's user namespace, which counts only that execution's tasks (before, the bomb
    filled the uid's limit and the honest execution could not fork, or bwrap could not start:
    `test_all_at_once_in_the_pool` failed so in CI)."""
    sb = Sandbox(SandboxLimits(**{**LIMITS, "timeout_s": 30}), mode="strict")
    # bubblewrap outside and its init, python: three tasks of the execution's cgroup and limit
    children = sb.limits.processes - 3
    honest = ("import os, time\ntime.sleep(3)\nforked = 0\n"
              f"for _ in range({children}):\n"
              "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
              "    if pid == 0:\n        time.sleep(2)\n        os._exit(0)\n    forked += 1\n"
              "for _ in range(forked):\n    os.wait()\nprint(forked)")
    bomb = ("import os, time\nend = time.time() + 8\nwhile time.time() < end:\n    try:\n"
            "        os.fork()\n    except OSError:\n        pass")
    results = {}
    honest_run = threading.Thread(target=lambda: results.update(honest=sb.run(honest)))
    honest_run.start()
    try:
        while not any(said_started(pid, sb.python) for pid, _ in sandbox_processes()):
            assert honest_run.is_alive(), f"the honest program ended before the bomb began: {results}"
            time.sleep(0.05)
        results["bomb"] = sb.run(bomb)
    finally:
        honest_run.join()
        sb.close()
    assert results["honest"].ok and results["honest"].stdout.split() == [str(children)], results["honest"]
    # it ends on its own, or on the CPU limit of one of its processes (SIGKILL at the hard limit)
    assert results["bomb"].status in ("ok", "timeout", "crash"), results["bomb"]
    assert sandbox_processes_after_cleanup() == []


def test_allocating_50_gb(reward):
    value, reason, comp = score(reward, "x = bytearray(50 * 2**30)\nSIZE = len(x)",
                                ["assert SIZE == 50 * 2**30"])
    assert_contained(value, reason, comp, ["memory"])
    assert "MemoryError" in reason


@pytest.mark.parametrize("code", [
    "f = open('/tmp/fill', 'wb')\nwhile True:\n    f.write(b'x' * 2**20)",
    "i = 0\nwhile True:\n    open(f'/tmp/f{i}', 'wb').write(b'x' * 2**20)\n    i += 1",
    "i = 0\nwhile True:\n    open(f'fill{i}', 'wb').write(b'x' * 2**20)\n    i += 1",
])
def test_filling_the_disk(reward, code):
    free_before = os.statvfs("/tmp").f_bavail * os.statvfs("/tmp").f_frsize
    value, reason, comp = score(reward, code)
    assert_contained(value, reason, comp, ["error"])
    assert "File too large" in reason or "No space left" in reason, reason
    free_after = os.statvfs("/tmp").f_bavail * os.statvfs("/tmp").f_frsize
    assert free_before - free_after < 64 * 2**20


def test_reading_ssh_keys(reward, tmp_path, monkeypatch):
    secret = "megagrpo-test-private-key-7f3a"
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "id_rsa").write_text(secret)
    monkeypatch.setenv("HOME", str(tmp_path))  # the trainer's home holds the key
    for code in ["import os\nKEY = open(os.path.expanduser('~/.ssh/id_rsa')).read()",
                 f"KEY = open('{tmp_path}/.ssh/id_rsa').read()",
                 "import os\nKEY = str(os.listdir('/root/.ssh'))"]:
        value, reason, comp = score(reward, code, [f"assert '{secret}' in KEY or 'id_' in KEY"])
        assert_contained(value, reason, comp, ["error"])
        assert "FileNotFoundError" in reason or "PermissionError" in reason, reason


def test_reading_etc_shadow(reward):
    value, reason, comp = score(reward, "S = open('/etc/shadow').read()", ["assert S.startswith('root:')"])
    assert_contained(value, reason, comp, ["error"])
    assert "FileNotFoundError" in reason or "PermissionError" in reason


def test_reading_the_trainers_environment(reward, monkeypatch):
    secret = "megagrpo-env-secret-91c2"
    monkeypatch.setenv("MEGAGRPO_TEST_SECRET", secret)
    code = ("import os, glob\n"
            "FOUND = [os.environ.get('MEGAGRPO_TEST_SECRET', '')]\n"
            "for path in glob.glob('/proc/*/environ'):\n"
            "    try:\n"
            "        FOUND.append(open(path, errors='replace').read())\n"
            "    except OSError:\n"
            "        pass\n"
            f"assert any('{secret}' in f for f in FOUND), 'no secret visible'\n")
    value, reason, comp = score(reward, code, [f"assert any('{secret}' in f for f in FOUND)"])
    assert_contained(value, reason, comp, ["error"])
    assert "no secret visible" in reason


def test_socket_to_localhost(reward):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "s.sendall(b'leak')\nCONNECTED = True")
    value, reason, comp = score(reward, code, ["assert CONNECTED"])
    assert_contained(value, reason, comp, ["error"])
    assert "Error" in reason
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing ever connected
    listener.close()


def test_killing_the_parent(reward):
    code = (f"import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
            f"os.kill({os.getpid()}, signal.SIGKILL)\nos.kill({os.getppid()}, signal.SIGKILL)\nDONE = 1")
    value, reason, comp = score(reward, code, ["assert DONE"])
    assert_contained(value, reason, comp, ["error"])
    assert "ProcessLookupError" in reason
    os.kill(os.getpid(), 0)  # this process and its parent (root's `su` for an unprivileged run) are alive
    assert os.path.isdir(f"/proc/{os.getppid()}")


def test_printing_1_gb(reward):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    value, reason, comp = score(reward, "import sys\nchunk = 'x' * 2**20\nfor _ in range(1024):\n"
                                        "    sys.stdout.write(chunk)\nDONE = 1", ["assert DONE"])
    # stopped at the cap (not timed out, not run to the end), and the output was not kept here
    assert_contained(value, reason, comp, ["output_limit"])
    assert reason == f"output_limit: output over {LIMITS['output_bytes']} bytes", reason
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200 * 1024  # KiB


def test_deleting_files_outside_tmp(reward, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for code in [f"import os\nos.remove('{victim}')\nGONE = 1",
                 "import os\nos.remove('/sandbox/main.py')\nGONE = 1",
                 "import os\nos.remove('/usr/bin/python3')\nGONE = 1"]:
        value, reason, comp = score(reward, code, ["assert GONE"])
        assert_contained(value, reason, comp, ["error"])
    assert victim.read_text() == "keep me"
    assert os.path.exists("/usr/bin/python3")


def test_sleeping_past_the_timeout(reward):
    value, reason, comp = score(reward, "import time\ntime.sleep(60)\nDONE = 1", ["assert DONE"])
    # killed by the wall clock before the sleep ended: no result line, DONE never set
    assert_contained(value, reason, comp, ["timeout"])
    assert reason == f"timeout: wall-clock timeout after {TIMEOUT_S:g} s", reason


def test_segfault_via_ctypes(reward):
    value, reason, comp = score(reward, "import ctypes\nctypes.string_at(0)\nDONE = 1", ["assert DONE"])
    assert_contained(value, reason, comp, ["crash"])
    assert "SIGSEGV" in reason


def test_all_at_once_in_the_pool(reward):
    """The adversarial set concurrently (4 workers on 2 cores) with honest programs: each
    honest program still gets its full score, each hostile one 0 with the status of its fault
    (or the timeout, for a short one the loaded machine had not finished starting by then)."""
    hostile = ["while True:\n    pass", "import os\nwhile True:\n    try:\n        os.fork()\n"
               "    except OSError:\n        pass", "x = bytearray(50 * 2**30)",
               "import time\ntime.sleep(60)", "import ctypes\nctypes.string_at(0)",
               "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)"]
    honest = "def f(x):\n    return 2 * x"
    completions = [f"```python\n{c}\n```" for c in hostile] + [honest] * 4
    tests = [["assert True"]] * len(hostile) + [["assert f(2) == 4"]] * 4
    s = reward(["q"] * len(completions), completions, tests=tests)
    assert list(s[:len(hostile)]) == [0.0] * len(hostile)
    assert list(s[len(hostile):]) == [1.0] * 4
    assert all(r for r in s.reasons[:len(hostile)])
    # the loop, the fork bomb and the sleeper can only end on the wall clock; the others end
    # on their own fault unless, on a loaded machine, the wall clock ends them first
    allowed = [{"timeout"}, {"timeout"}, {"memory", "timeout"}, {"timeout"}, {"crash", "timeout"},
               {"output_limit", "timeout"}]
    for i, statuses in enumerate(allowed):
        status = s.reasons[i].split(":", 1)[0]
        assert status in statuses and s.components[f"fail/{status}"][i] == 1.0, (i, s.reasons[i])
    assert sandbox_processes_after_cleanup() == []


def test_early_exit_scores_zero(reward):
    """sys.exit(0) or os._exit(0) at the top of the code: the tests never ran, an error."""
    for code, why in (("import sys\nsys.exit(0)", "SystemExit: 0"),
                      ("import os\nos._exit(0)", "the solution process ended")):
        value, reason, comp = score(reward, code, ["assert False"])
        assert value == 0.0 and reason.startswith("error:") and why in reason, reason
        assert comp["fail/error"] == 1.0


def test_code_reward_values_by_hand(reward):
    completions = [
        "Here:\n```python\ndef sq(x):\n    return x * x\n```\nand a usage example.",  # all pass
        "```python\ndef sq(x):\n    return x + x\n```",  # 1 of 3 (sq(2) == 4)
        "def sq(x) return x",  # syntax error
        "```\ndef sq(x):\n    return x ** 2\n```",  # untagged fence
    ]
    tests = [["assert sq(2) == 4", "assert sq(3) == 9", "assert sq(-1) == 1"]] * 4
    s = reward(["q"] * 4, completions, tests=tests)
    assert list(s) == pytest.approx([1.0, 0.2 + 0.6 / 3 + 0.2, 0.0, 1.0])
    assert s.components["syntax"] == [1.0, 1.0, 0.0, 1.0]
    assert s.components["tests"] == pytest.approx([1.0, 1 / 3, 0.0, 1.0])
    assert s.reasons[1].startswith("2 of 3 tests failed") and s.reasons[2].startswith("syntax_error:")
    # efficiency: tests slower than the row's budget earn budget / time; the test sleeps 0.2 s,
    # so time >= 0.2 s and efficiency <= 0.05 / 0.2 (how far below depends on the machine's load)
    slow = "```python\nimport time\ndef sq(x):\n    time.sleep(0.2)\n    return x * x\n```"
    s = reward(["q"], [slow], tests=[["assert sq(3) == 9"]], time_budget_s=[0.05])
    eff = s.components["efficiency"][0]
    assert 0.0 < eff <= 0.25 + 1e-9
    assert s[0] == pytest.approx(0.2 + 0.6 + 0.2 * eff)
    assert extract_code("no fences") == "no fences"


def test_rlimits_only_mode_warns_and_still_limits():
    with pytest.warns(RuntimeWarning, match="bubblewrap is not in use"):
        sb = Sandbox(SandboxLimits(**LIMITS), mode="rlimits")
    assert not sb.isolated
    assert sb.run("print(6 * 7)").stdout.strip() == "42"
    assert sb.run("x = bytearray(50 * 2**30)").status == "memory"
    assert sb.run("import time\ntime.sleep(60)").status == "timeout"
    assert sb.run("import os\nprint(sorted(os.environ))").stdout.strip() == "['HOME', 'LANG', 'PATH']"


def test_strict_mode_refuses_without_bubblewrap(tmp_path, monkeypatch):
    for tool in ("setpriv", "prlimit", "kill"):  # the rest of the sandbox's tools stay
        os.symlink(shutil.which(tool), tmp_path / tool)
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on PATH
    with pytest.raises(SandboxUnavailable, match="sandbox: strict, but bubblewrap cannot run"):
        Sandbox(SandboxLimits(**LIMITS), mode="strict")
    # auto no longer falls back to rlimits only: it refuses too, naming what is missing
    # (tests/test_sandbox_modes.py has the whole message, and rlimits chosen knowingly)
    with pytest.raises(SandboxUnavailable, match="bwrap is not installed"):
        Sandbox(SandboxLimits(**LIMITS), mode="auto")


def test_root_without_setpriv_refuses(tmp_path, monkeypatch):
    """As root, setpriv drops each execution to its own uid: without it nothing runs."""
    if os.geteuid() != 0:
        pytest.skip("only root drops to sandbox uids")
    for tool in ("bwrap", "prlimit", "kill"):
        os.symlink(shutil.which(tool), tmp_path / tool)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="needs `setpriv`"):
        Sandbox(SandboxLimits(**LIMITS), mode="auto")


def test_bubblewrap_isolation_facts():
    """What the program sees: its own pid namespace, no network, a scrubbed environment, a
    read-only system, no home."""
    sb = Sandbox(SandboxLimits(**LIMITS), mode="strict")
    code = ("import os, socket, json\n"
            "out = {'pid': os.getpid(), 'env': sorted(os.environ), 'root': sorted(os.listdir('/')),\n"
            "       'uid_inside': os.getuid(), 'ifaces': [n for _, n in socket.if_nameindex()]}\n"
            "try:\n    open('/usr/x', 'w')\nexcept OSError as e:\n    out['usr'] = e.errno\n"
            "print(json.dumps(out))")
    import json
    r = sb.run(code)
    assert r.ok, r.reason
    facts = json.loads(r.stdout)
    assert facts["pid"] <= 3 and set(facts["env"]) <= {"HOME", "LANG", "PATH", "PWD"}
    assert set(facts["root"]) <= {"usr", "bin", "lib", "lib64", "sbin", "proc", "dev", "tmp"}
    assert facts["ifaces"] == ["lo"] and facts["usr"] in (errno.EROFS, errno.EACCES)
    assert signal.getsignal(signal.SIGCHLD) is not None  # this process's handlers are untouched


def test_stdin_is_fed_without_blocking_and_rlimits_mode_cleans_up():
    sb = Sandbox(SandboxLimits(**LIMITS), mode="strict")
    big = "x" * (4 * 2**20)
    r = sb.run("import sys\nprint(len(sys.stdin.read()))", stdin=big)
    assert r.ok and r.stdout.strip() == str(len(big))
    # a program that never reads 4 MB of stdin does not block the writer: the wall clock ends it
    r = sb.run("import time\ntime.sleep(60)", stdin=big)
    assert r.status == "timeout" and r.reason == f"wall-clock timeout after {TIMEOUT_S:g} s", r
    with pytest.warns(RuntimeWarning):
        loose = Sandbox(SandboxLimits(**LIMITS), mode="rlimits")
    # a forked child that leaves the process group and outlives the program is killed too
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
            "else:\n    print('parent done')")
    r = loose.run(code)
    assert "parent done" in r.stdout, r
    left = sandbox_processes_after_cleanup()
    if left and os.geteuid() != 0:
        for pid, _ in left:  # the escaped child: end it here, so that no later check counts it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.skip(f"not root (uid {os.geteuid()}): rlimits mode kills a child that left the "
                    "process group through the execution's own uid (kill -KILL -1 as that uid), "
                    f"and only root runs executions under uids of their own; left running: {left}")
    assert left == []


def test_batch_time_budget_bounds_a_batch_of_hostile_programs():
    """6 sleepers, 2 workers, a 1 s timeout each, a 1.9 s batch budget: 4 run (two rounds), 2
    are not run. The second round starts once the first is killed, 1 s in plus the time to
    reap it (well inside the budget); the third cannot start before 2 s (each round runs its
    sleepers to their timeout), past the budget, however loaded the machine."""
    reward = CodeReward(sandbox="strict", workers=2, batch_budget_s=1.9, **{**LIMITS, "timeout_s": 1.0})
    try:
        s = reward(["q"] * 6, ["import time\ntime.sleep(60)"] * 6, tests=[["assert True"]] * 6)
    finally:
        reward.close()
    assert list(s) == [0.0] * 6 and s.components["fail/timeout"] == [1.0] * 6
    assert sum("wall-clock" in r for r in s.reasons) == 4
    assert sum("time budget" in r for r in s.reasons) == 2
    # in submission order: the first four ran (and were killed), the last two never started
    assert ["wall-clock" in r for r in s.reasons] == [True] * 4 + [False] * 2, s.reasons


# ---- what issue 13 closed: the root, /dev, syscalls, namespaces, memory, zombies, uids, status

def test_root_and_dev_are_read_only_and_tmp_is_capped(sandbox):
    """Only /tmp is writable, and only up to its size cap (file_size_mb); /dev holds three
    devices and the fd links."""
    code = ("import errno, json, os\nout = {'dev': sorted(os.listdir('/dev'))}\n"
            "for path in ('/x', '/dev/x', '/dev/shm/x', '/proc/x', '/usr/x'):\n"
            "    try:\n        open(path, 'wb').write(b'x')\n        out[path] = 'written'\n"
            "    except OSError as e:\n        out[path] = errno.errorcode[e.errno]\n"
            "written = 0\n"
            "try:\n"
            "    for i in range(64):\n"
            "        with open(f'/tmp/f{i}', 'wb') as f:\n            f.write(b'x' * 2**20)\n"
            "        written += 2**20\n"
            "except OSError as e:\n    out['tmp'] = errno.errorcode[e.errno]\n"
            "out['tmp_bytes'] = written\nprint(json.dumps(out))")
    facts = run_json(sandbox, code)
    assert facts["dev"] == ["fd", "null", "stderr", "stdin", "stdout", "urandom", "zero"]
    for path in ("/x", "/dev/x", "/dev/shm/x", "/usr/x"):
        assert facts[path] in ("EROFS", "ENOENT", "EACCES"), (path, facts)
    assert facts["/proc/x"] != "written"
    assert facts["tmp"] == "ENOSPC" and facts["tmp_bytes"] <= LIMITS["file_size_mb"] * 2**20, facts


def test_seccomp_refuses_what_no_test_needs(sandbox):
    """ptrace, io_uring, mount, keyctl, bpf, unshare, setns and process_vm_readv fail with
    EPERM; getpid still works."""
    code = ("import ctypes, errno, json\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.syscall.restype = ctypes.c_long\nout = {}\n"
            "for name, nr in [('ptrace', 101), ('io_uring_setup', 425), ('mount', 165), ('keyctl', 250),\n"
            "                 ('bpf', 321), ('unshare', 272), ('setns', 308), ('process_vm_readv', 310),\n"
            "                 ('getpid', 39)]:\n"
            "    ctypes.set_errno(0)\n"
            "    ret = libc.syscall(nr, 0, 0, 0, 0, 0)\n"
            "    out[name] = errno.errorcode.get(ctypes.get_errno(), 'ok') if ret == -1 else 'ok'\n"
            "print(json.dumps(out))")
    facts = run_json(sandbox, code)
    assert facts.pop("getpid") == "ok"
    assert facts == {name: "EPERM" for name in facts}, facts


def test_no_nested_user_namespaces(sandbox):
    """clone(CLONE_NEWUSER) is refused (bwrap --disable-userns), as is `unshare -U`."""
    code = ("import ctypes, errno, os, subprocess\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.syscall.restype = ctypes.c_long\n"
            "pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)  # clone(CLONE_NEWUSER | SIGCHLD)\n"
            "if pid == 0:\n    os._exit(0)\n"
            "print(pid, errno.errorcode.get(ctypes.get_errno()))\n"
            "print(subprocess.run(['unshare', '-Ur', 'true'], capture_output=True).returncode)")
    result = sandbox.run(code)
    assert result.ok, result
    clone, unshare = result.stdout.split("\n")[:2]
    assert clone.split()[0] == "-1" and clone.split()[1] in ("ENOSPC", "EPERM", "EUSERS"), clone
    assert unshare != "0"


def test_memory_is_limited_for_the_execution_as_a_whole():
    """Six children of 150 MB each stay under the per-process limit (256 MB) but not under the
    execution's: the kernel kills them inside the execution's cgroup (where the machine allows
    one; else the process limit is FALLBACK_PROCESSES). A longer timeout: the kernel takes its
    time to reclaim on a loaded machine."""
    sandbox = Sandbox(SandboxLimits(**{**LIMITS, "timeout_s": 10}), mode="strict")
    if sandbox.cgroups.problem:
        assert sandbox.limits.processes <= 4
        pytest.skip(f"no cgroup here ({sandbox.cgroups.problem}); the process limit is lowered instead")
    code = ("import os, time\npids = []\nfor _ in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
            "        x = b'\\x01' * (150 * 2**20)\n        time.sleep(1)\n        os._exit(0)\n"
            "    pids.append(pid)\nprint([os.waitpid(p, 0)[1] for p in pids])")
    result = sandbox.run(code)
    assert result.ok, result
    statuses = json.loads(result.stdout)
    assert signal.SIGKILL in statuses, statuses
    # three children of 100 MB (each far under its address-space limit): the execution ends as "memory"
    code = ("import os, sys, time\npids = []\nfor _ in range(3):\n    pid = os.fork()\n    if pid == 0:\n"
            "        y = b'\\x02' * (100 * 2**20)\n        time.sleep(1)\n        os._exit(0)\n    pids.append(pid)\n"
            "sys.exit(1 if any(os.waitpid(p, 0)[1] for p in pids) else 0)")
    result = sandbox.run(code)
    sandbox.close()
    assert result.status == "memory" and "cgroup" in result.reason, result
    assert sandbox_processes_after_cleanup() == []


def _zombies_of(parents: set[int]) -> list[str]:
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) in parents:
            found.append(name)
    return found


def test_an_execution_that_ends_by_itself_leaves_no_zombie(sandbox):
    """bubblewrap does not reap its pid namespace's init when the program ends by itself; the
    init comes to this process (a child subreaper), which reaps it: right after each run no
    zombie is left, neither ours nor the machine init's."""
    before = set(_zombies_of({1, os.getpid()}))
    for code in ("print(1)", "import sys\nsys.exit(3)", "import os\nos.fork()"):
        sandbox.run(code)
        assert set(_zombies_of({1, os.getpid()})) - before == set()


def test_killed_executions_leave_no_zombie(sandbox):
    """Timed-out sandboxes are killed through their pid namespace's init, which bubblewrap
    reaps: nothing is left to a machine init that does not reap (the check counts zombies)."""
    for code in ("import time\ntime.sleep(60)", "import os, time\nos.fork()\nos.fork()\ntime.sleep(60)"):
        assert sandbox.run(code).status == "timeout"
    assert sandbox_processes_after_cleanup() == []


def test_uid_blocks_never_collide(sandbox):
    """Each Sandbox holds a block of uids of its own (a lock file per block): a second one in
    this process, and one in another process at the same time, get other blocks."""
    if os.geteuid() != 0:
        pytest.skip("only root runs executions under uids of their own")
    other = Sandbox(SandboxLimits(**LIMITS), mode="strict")
    code = ("from megagrpo.sandbox import Sandbox\nimport sys\n"
            "print(Sandbox(mode='strict').uid_base)\nsys.stdout.flush()\nsys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        child_base = int(child.stdout.readline())
    finally:
        child.communicate("")
    other.close()
    assert len({sandbox.uid_base, other.uid_base, child_base}) == 3


def test_printed_bwrap_lines_do_not_change_the_status(sandbox):
    code = "import sys\nprint('bwrap: Can\\'t create file at /tmp: No space left', file=sys.stderr)\nsys.exit(1)"
    result = sandbox.run(code)
    assert result.status == "error" and "bwrap:" in result.reason, result


def test_a_private_tmpdir_does_not_stop_the_sandbox(tmp_path, monkeypatch):
    """Programs reach the sandbox in memory files, so a 0700 TMPDIR of root's is no obstacle."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr("tempfile.tempdir", None)
    sb = Sandbox(SandboxLimits(**LIMITS), mode="strict")
    assert sb.run("print('ok')").stdout == "ok\n"
    sb.close()


def test_a_sandbox_that_cannot_run_anything_says_so_at_once(tmp_path):
    """No interpreter that runs: `auto` refuses at once (the interpreter, not bubblewrap, is
    named as the problem), instead of scoring every correct program 0."""
    with pytest.raises(SandboxUnavailable, match="would score every program 0"):
        Sandbox(SandboxLimits(**LIMITS), mode="auto", python="/bin/false")
    with pytest.warns(RuntimeWarning, match="bubblewrap is not in use"):  # rlimits still warns first
        with pytest.raises(Exception, match="would score every program 0"):
            Sandbox(SandboxLimits(**LIMITS), mode="rlimits", python="/bin/false")
