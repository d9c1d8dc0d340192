"""The code sandbox against adversarial programs, through the code reward.

Every program does its mischief at top level and checks its own success; its unit test passes
only if the mischief worked (the secret was read, the connection made, ...). A contained
program therefore scores 0 with a reason, and the host-side evidence (files, listener, this
process, leftover processes) is checked as well.
"""
import os
import resource
import signal
import socket
import time
import warnings

import pytest

from megagrpo.rewards.code import CodeReward, extract_code
from megagrpo.rewards.sandbox import SANDBOX_UID_BASE, Sandbox, SandboxLimits, SandboxUnavailable

TIMEOUT_S = 1.5
LIMITS = dict(timeout_s=TIMEOUT_S, cpu_s=2, memory_mb=256, file_size_mb=8, processes=16,
              output_bytes=64 * 1024)


@pytest.fixture(scope="module")
def reward():
    r = CodeReward(sandbox="strict", workers=4, **LIMITS)
    yield r
    r.close()


def sandbox_processes() -> list[int]:
    """Live (not zombie) processes running under a sandbox uid. bwrap's pid-namespace init
    is reparented to the machine's init when the sandbox ends and stays a zombie until that
    init reaps it; a zombie holds no memory, files or CPU."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid >= SANDBOX_UID_BASE:
                    state = open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        pids.append(int(name))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return pids


def score(reward, code, tests=("assert True",)):
    s = reward(["q"], [f"```python\n{code}\n```"], tests=[list(tests)])
    return s[0], s.reasons[0], {k: v[0] for k, v in s.components.items()}


def assert_contained(value, reason, components, statuses):
    assert value == 0.0, (value, reason)
    assert any(reason.startswith(f"{s}:") for s in statuses), reason
    assert sum(components[f"fail/{s}"] for s in statuses) == 1.0
    # the trainer side is intact and the sandbox left nothing running
    deadline = time.time() + 3
    while sandbox_processes() and time.time() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []


def test_a_trivial_program_passes(reward):
    value, reason, comp = score(reward, "def add(a, b):\n    return a + b",
                                ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"])
    assert (value, reason) == (1.0, "") and comp["tests"] == 1.0 and comp["efficiency"] == 1.0


def test_infinite_loop(reward):
    start = time.perf_counter()
    value, reason, comp = score(reward, "while True:\n    pass")
    assert time.perf_counter() - start < TIMEOUT_S + 2
    assert_contained(value, reason, comp, ["timeout"])


def test_fork_bomb(reward):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    start = time.perf_counter()
    value, reason, comp = score(reward, code)
    assert time.perf_counter() - start < TIMEOUT_S + 2
    assert_contained(value, reason, comp, ["timeout"])
    # the process limit held inside, and the next program starts normally
    assert score(reward, "X = 1", ["assert X == 1"])[0] == 1.0


def test_fork_bomb_without_retry_hits_the_process_limit(reward):
    value, reason, comp = score(reward, "import os\nwhile True:\n    os.fork()")
    # status "error", not "timeout": fork was refused by RLIMIT_NPROC and the program died of
    # it. (Which traceback line ends up in the reason varies: forked children print too.)
    assert_contained(value, reason, comp, ["error"])


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
    os.kill(os.getpid(), 0)  # this process and its parent are alive
    os.kill(os.getppid(), 0)


def test_printing_1_gb(reward):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    value, reason, comp = score(reward, "import sys\nchunk = 'x' * 2**20\nfor _ in range(1024):\n"
                                        "    sys.stdout.write(chunk)\nDONE = 1", ["assert DONE"])
    assert_contained(value, reason, comp, ["output_limit"])
    assert time.perf_counter() - start < TIMEOUT_S + 2
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
    start = time.perf_counter()
    value, reason, comp = score(reward, "import time\ntime.sleep(60)\nDONE = 1", ["assert DONE"])
    assert time.perf_counter() - start < TIMEOUT_S + 2
    assert_contained(value, reason, comp, ["timeout"])
    assert "wall-clock" in reason


def test_segfault_via_ctypes(reward):
    value, reason, comp = score(reward, "import ctypes\nctypes.string_at(0)\nDONE = 1", ["assert DONE"])
    assert_contained(value, reason, comp, ["crash"])
    assert "SIGSEGV" in reason


def test_all_at_once_in_the_pool(reward):
    """The adversarial set concurrently (4 workers on 2 cores) with honest programs: each
    honest program still gets its full score, each hostile one 0, within about one timeout."""
    hostile = ["while True:\n    pass", "import os\nwhile True:\n    try:\n        os.fork()\n"
               "    except OSError:\n        pass", "x = bytearray(50 * 2**30)",
               "import time\ntime.sleep(60)", "import ctypes\nctypes.string_at(0)",
               "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)"]
    honest = "def f(x):\n    return 2 * x"
    completions = [f"```python\n{c}\n```" for c in hostile] + [honest] * 4
    tests = [["assert True"]] * len(hostile) + [["assert f(2) == 4"]] * 4
    start = time.perf_counter()
    s = reward(["q"] * len(completions), completions, tests=tests)
    assert time.perf_counter() - start < 2 * TIMEOUT_S + 3
    assert list(s[:len(hostile)]) == [0.0] * len(hostile)
    assert list(s[len(hostile):]) == [1.0] * 4
    assert all(r for r in s.reasons[:len(hostile)])


def test_faked_result_lines_and_early_exit_score_zero(reward):
    fake = 'print(\'{"passed": 9, "total": 9, "seconds": 0.0, "failures": []}\')\nimport os\nos._exit(0)'
    value, reason, _ = score(reward, fake, ["assert False"])
    assert value == 0.0 and reason.startswith("no_result:")
    value, reason, _ = score(reward, "import sys\nsys.exit(0)", ["assert False"])
    assert value == 0.0 and reason.startswith("error:") or reason.startswith("no_result:")


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
    # efficiency: tests slower than the row's budget earn budget / time
    slow = "```python\nimport time\ndef sq(x):\n    time.sleep(0.2)\n    return x * x\n```"
    s = reward(["q"], [slow], tests=[["assert sq(3) == 9"]], time_budget_s=[0.05])
    eff = s.components["efficiency"][0]
    assert 0.15 < eff < 0.25 + 1e-9
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
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on PATH
    with pytest.raises(SandboxUnavailable, match="sandbox: strict, but bubblewrap cannot run"):
        Sandbox(SandboxLimits(**LIMITS), mode="strict")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sb = Sandbox(SandboxLimits(**LIMITS), mode="auto")
    assert not sb.isolated and any("bwrap is not installed" in str(w.message) for w in caught)


def test_bubblewrap_isolation_facts():
    """What the program sees: its own pid namespace, no network, a scrubbed environment, a
    read-only system, no home."""
    sb = Sandbox(SandboxLimits(**LIMITS), mode="strict")
    code = ("import os, socket, json\n"
            "out = {'pid': os.getpid(), 'env': sorted(os.environ), 'root': sorted(os.listdir('/')),\n"
            "       'uid_inside': os.getuid(), 'ifaces': [n for _, n in socket.if_nameindex()]}\n"
            "try:\n    open('/usr/x', 'w')\nexcept OSError as e:\n    out['usr'] = e.errno\n"
            "print(json.dumps(out))")
    import errno
    import json
    r = sb.run(code)
    assert r.ok, r.reason
    facts = json.loads(r.stdout)
    assert facts["pid"] <= 3 and set(facts["env"]) <= {"HOME", "LANG", "PATH", "PWD"}
    assert set(facts["root"]) <= {"usr", "bin", "lib", "lib64", "sbin", "proc", "dev", "tmp", "sandbox"}
    assert facts["ifaces"] == ["lo"] and facts["usr"] in (errno.EROFS, errno.EACCES)
    assert signal.getsignal(signal.SIGCHLD) is not None  # this process's handlers are untouched


def test_stdin_is_fed_without_blocking_and_rlimits_mode_cleans_up():
    sb = Sandbox(SandboxLimits(**LIMITS), mode="strict")
    big = "x" * (4 * 2**20)
    r = sb.run("import sys\nprint(len(sys.stdin.read()))", stdin=big)
    assert r.ok and r.stdout.strip() == str(len(big))
    start = time.perf_counter()  # a program that never reads 4 MB of stdin still times out on time
    r = sb.run("import time\ntime.sleep(60)", stdin=big)
    assert r.status == "timeout" and time.perf_counter() - start < TIMEOUT_S + 2
    with pytest.warns(RuntimeWarning):
        loose = Sandbox(SandboxLimits(**LIMITS), mode="rlimits")
    # a forked child that leaves the process group and outlives the program is killed too
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
            "else:\n    print('parent done')")
    r = loose.run(code)
    assert "parent done" in r.stdout
    if os.geteuid() == 0:
        deadline = time.time() + 3
        while sandbox_processes() and time.time() < deadline:
            time.sleep(0.05)
        assert sandbox_processes() == []


def test_batch_time_budget_bounds_a_batch_of_hostile_programs():
    """6 sleepers, 2 workers, 0.8 s each, a 1 s batch budget: 4 run (two rounds), 2 are not run."""
    reward = CodeReward(sandbox="strict", workers=2, batch_budget_s=1.0, **{**LIMITS, "timeout_s": 0.8})
    start = time.perf_counter()
    s = reward(["q"] * 6, ["import time\ntime.sleep(60)"] * 6, tests=[["assert True"]] * 6)
    elapsed = time.perf_counter() - start
    reward.close()
    assert list(s) == [0.0] * 6 and s.components["fail/timeout"] == [1.0] * 6
    assert sum("wall-clock" in r for r in s.reasons) == 4
    assert sum("time budget" in r for r in s.reasons) == 2
    assert elapsed < 0.8 * 3
