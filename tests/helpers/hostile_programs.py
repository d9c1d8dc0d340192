'''Hostile solutions to one task, `add(a, b)`, each trying to score without solving it.

Every program's own `add` is wrong for every test (or, for the timing case, right but slow),
and whatever it forges says nothing right either (an answer it sends in place of `add`'s is 0,
wrong for every test), so an honest wrong answer's score (syntax only, 0.2 by default) is the
most any of them may get.
Used by tests/test_rewards_code_adversarial.py (each case alone, host checked after it) and by
the 2-rank training run of tests/test_evaluation.py (HostileCode mixes them with honest programs).
'''
TESTS = ["assert add(1, 2) == 3", "assert add(-4, 9) == 5", "assert add(2, 2) == 4"]
WRONG = "\ndef add(a, b):\n    return a - b\n"
CORRECT = "def add(a, b):\n    return a + b\n"
FAKE_REPORT = '{"passed": 3, "total": 3, "seconds": 0.0, "calls": 3, "failures": [], "ready": true}'

_FRAME = ("import json, os, struct\n"
          "def frame(obj):\n"
          "    body = json.dumps(obj).encode()\n"
          "    return struct.pack('>I', len(body)) + body\n")

PROGRAMS = {
    # ---- forging the report -----------------------------------------------------------------
    "print_a_report": f"print({FAKE_REPORT!r})\nprint('deadbeef' * 4 + {FAKE_REPORT!r})" + WRONG,
    "report_frames_on_every_fd": _FRAME + (
        "for fd in range(64):\n"
        f"    for obj in ({{'report': json.loads({FAKE_REPORT!r})}}, {{'end': True}}, {{'names': ['add']}}):\n"
        "        try:\n            os.write(fd, frame(obj))\n        except OSError:\n            pass\n") + WRONG,
    "report_from_atexit": "import atexit, os\n" + _FRAME + (
        "def forge():\n"
        f"    print({FAKE_REPORT!r})\n"
        "    for fd in range(64):\n"
        f"        try:\n            os.write(fd, frame({{'report': json.loads({FAKE_REPORT!r})}}))\n"
        "        except OSError:\n            pass\n"
        "atexit.register(forge)\n") + WRONG,
    "report_from_a_thread_during_the_tests": "import threading, time, os\n" + _FRAME + (
        "def spam():\n"
        "    while True:\n"
        "        for fd in range(3, 16):\n"
        "            try:\n                os.write(fd, frame({'id': 0, 'value': 0, 'passed': 3}))\n"
        "            except OSError:\n                pass\n"
        "        time.sleep(0.001)\n"
        "threading.Thread(target=spam, daemon=True).start()\n") + WRONG,
    "harness_through_frames": (
        "import inspect, sys\n"
        "for info in inspect.stack():\n"
        "    for name in ('tests', 'passed', 'failures', 'report', 'nonce'):\n"
        "        if name in info.frame.f_locals:\n"
        "            value = info.frame.f_locals[name]\n"
        "            if isinstance(value, list):\n                value.clear()\n"
        "f = sys._getframe()\n"
        "while f:\n"
        "    f.f_globals.update({'passed': 99, 'total': 99})\n"
        "    f = f.f_back\n") + WRONG,
    "harness_through_gc": (
        "import gc\n"
        "for o in gc.get_objects():\n"
        "    try:\n"
        "        if isinstance(o, dict) and ('passed' in o or 'tests' in o):\n"
        "            o.update({'passed': 3, 'total': 3, 'tests': []})\n"
        "        if isinstance(o, list) and any('assert' in str(x) for x in o[:5]):\n"
        "            o.clear()\n"
        "    except Exception:\n"
        "        pass\n") + WRONG,
    # ---- replacing the tests or the counting -----------------------------------------------
    "rewrites_the_runner": (
        "import sys\n"
        "wire = sys.modules.get('wire')\n"
        "if wire:\n"
        "    real = wire.send_frame\n"
        "    wire.send_frame = lambda sock, obj, n: real(sock, {**obj, 'passed': 3, 'report': {'passed': 3}}, n)\n"
        "    wire.encode = lambda value, depth=0: {'t': [3]}\n") + WRONG,
    "reads_the_tests_from_the_host": (
        "import os\nFOUND = []\n"
        "for root in ('/proc', '/tmp', '/sandbox', '/'):\n"
        "    try:\n        FOUND += os.listdir(root)\n    except OSError:\n        pass\n"
        "for pid in os.listdir('/proc'):\n"
        "    for leaf in ('cmdline', 'environ'):\n"
        "        try:\n            FOUND.append(open(f'/proc/{pid}/{leaf}', 'rb').read())\n"
        "        except OSError:\n            pass\n"
        "def add(a, b):\n"
        "    if any(b'add(1, 2) == 3' in x for x in FOUND if isinstance(x, bytes)):\n"
        "        return {(1, 2): 3, (-4, 9): 5, (2, 2): 4}[(a, b)]\n"
        "    return a - b\n"),
    "rebinds_builtins_and_libraries": (
        "import builtins, json, sys, time\n"
        "builtins.exec = lambda *a, **k: None\n"
        "builtins.compile = lambda *a, **k: compile\n"
        "builtins.len = lambda x: 0\n"
        "builtins.AssertionError = type('Never', (Exception,), {})\n"
        "json.dumps = lambda *a, **k: " + repr(FAKE_REPORT) + "\n"
        "json.loads = lambda *a, **k: {'passed': 3}\n"
        "time.perf_counter = time.time = time.monotonic = lambda: 0.0\n"
        "class Out:\n"
        "    def write(self, s):\n"
        "        sys.__stdout__.write(" + repr(FAKE_REPORT) + ")\n"
        "    def flush(self):\n        pass\n"
        "sys.stdout = Out()\n") + WRONG,
    "shadows_a_builtin_the_tests_use": "def len(x):\n    return 3\ndef abs(x):\n    return 5\n" + WRONG,
    # ---- values that compare equal to anything ---------------------------------------------
    "custom_eq": "class Any:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
                 "def add(a, b):\n    return Any()\n",
    "int_subclass": "class Int(int):\n    def __eq__(self, other):\n        return True\n"
                    "def add(a, b):\n    return Int(a - b)\n",
    "str_subclass": "class Str(str):\n    def __eq__(self, other):\n        return True\n"
                    "def add(a, b):\n    return Str('x')\n",
    "list_subclass": "class L(list):\n    def __eq__(self, other):\n        return True\n"
                     "def add(a, b):\n    return L()\n",
    "mock_any": "from unittest import mock\ndef add(a, b):\n    return mock.ANY\n",
    "nan_and_generators": "def add(a, b):\n    return float('nan') if a > 0 else (x for x in [3, 5, 4])\n",
    "deeply_nested_value": "def add(a, b):\n    v = 0\n    for _ in range(100000):\n        v = [v]\n    return v\n",
    "huge_value": "def add(a, b):\n    return 'x' * (64 * 2**20)\n",
    "exception_named_like_a_pass": "class AssertionError(Exception):\n    pass\n"
                                   "def add(a, b):\n    raise AssertionError('passed')\n",
    "raises_system_exit_in_a_call": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "exits_in_a_call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    # ---- the channel to the tests ----------------------------------------------------------
    "oversized_and_malformed_frames": "import os, struct\n" + (
        "for fd in range(3, 32):\n"
        "    for junk in (struct.pack('>I', 2**31) + b'x', struct.pack('>I', 5) + b'NaN!!', b'\\xff' * 64):\n"
        "        try:\n            os.write(fd, junk)\n        except OSError:\n            pass\n") + WRONG,
    "forged_values_for_each_call": _FRAME + (
        "import socket, sys, threading\n"
        "fd = int(sys.argv[1])\n"
        "s = socket.socket(fileno=os.dup(fd))\n"
        "def answer():\n"
        "    for i in range(50):\n"
        "        for obj in ({'id': i, 'value': 0}, {'id': i, 'value': {'d': [[1, 2]]}, 'passed': True},\n"
        "                    {'id': i, 'value': float('nan')},\n"
        "                    {'id': i, 'report': json.loads(" + repr(FAKE_REPORT) + ")}):\n"
        "            try:\n                s.sendall(frame(obj))\n            except OSError:\n                return\n"
        "threading.Thread(target=answer, daemon=True).start()\n") + WRONG,
    "fork_holds_the_channel": "import os, time\nif os.fork() == 0:\n    time.sleep(30)\n" + WRONG,
    # ---- timing --------------------------------------------------------------------------------
    "fakes_fast_timing": "import time\n_sleep = time.sleep\n"
                         "time.perf_counter = time.monotonic = time.time = lambda: 0.0\n"
                         "def add(a, b):\n    _sleep(0.1)\n    return a + b\n",
    # ---- killing or signalling ---------------------------------------------------------------
    "kills_everything_it_can": "import os, signal\nfor pid in range(1, 200):\n"
                               "    for sig in (signal.SIGSTOP, signal.SIGKILL):\n"
                               "        try:\n            os.kill(pid, sig)\n"
                               "        except OSError:\n            pass\n" + WRONG,
    "kills_its_process_group_and_parent": "import os, signal\n"
                                          "for target in (lambda: os.kill(os.getppid(), signal.SIGKILL),\n"
                                          "               lambda: os.killpg(0, signal.SIGTERM)):\n"
                                          "    try:\n        target()\n    except OSError:\n        pass\n" + WRONG,
    "fake_bwrap_error": "import sys\nprint('bwrap: Can\\'t mount proc on /newroot/proc: Operation not permitted',"
                        " file=sys.stderr)\n" + WRONG,
    # ---- resources -----------------------------------------------------------------------------
    "writes_large_files_everywhere": "import os\nWROTE = []\n"
                                     "for d in ('/', '/dev', '/dev/shm', '/tmp', '/sandbox', '/usr', '/proc', '.'):\n"
                                     "    try:\n"
                                     "        with open(os.path.join(d, 'big'), 'wb') as f:\n"
                                     "            for _ in range(256):\n                f.write(b'x' * 2**20)\n"
                                     "        WROTE.append(d)\n"
                                     "    except OSError:\n        pass\n" + WRONG,
    "many_processes_each_under_the_limit": "import os, time\n"
                                           "for _ in range(12):\n"
                                           "    if os.fork() == 0:\n"
                                           "        x = b'\\x01' * (150 * 2**20)\n"
                                           "        time.sleep(2)\n        os._exit(0)\n"
                                           "time.sleep(1)\n" + WRONG,
    "prints_a_gigabyte": "import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)\n" + WRONG,
    # ---- the kernel ------------------------------------------------------------------------------
    "nested_user_namespace": "import ctypes, subprocess\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                             "assert libc.unshare(0x10000000) != 0\n"
                             "subprocess.run(['unshare', '-Ur', 'true'], capture_output=True)\n" + WRONG,
    "ptrace_and_friends": "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                          "for pid in range(1, 64):\n    libc.ptrace(16, pid, 0, 0)\n"
                          "for nr in (425, 321, 250, 165, 310):  # io_uring_setup bpf keyctl mount process_vm_readv\n"
                          "    libc.syscall(nr, 0, 0, 0, 0, 0)\n" + WRONG,
}


class HostileCode:
    """A reward for training runs: completions at even positions become the correct program,
    the others hostile ones (by position), all judged by the real code reward."""

    def __init__(self, config=None, fast_only: bool = True, **code_args):
        from megagrpo.rewards.code import CodeReward

        slow = {"many_processes_each_under_the_limit", "fork_holds_the_channel", "fakes_fast_timing",
                "kills_everything_it_can", "deeply_nested_value", "huge_value", "report_from_a_thread_during_the_tests"}
        self.programs = [p for name, p in sorted(PROGRAMS.items()) if not (fast_only and name in slow)]
        self.code = CodeReward(config=config, **code_args)

    def __call__(self, prompts, completions, **fields):
        programs = [CORRECT if i % 2 == 0 else self.programs[(i // 2) % len(self.programs)]
                    for i in range(len(completions))]
        return self.code(prompts, [f"```python\n{p}\n```" for p in programs], tests=[TESTS] * len(programs))

    def close(self):
        self.code.close()
