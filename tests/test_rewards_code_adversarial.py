"""The code reward against solutions that try to score without solving the task.

Each hostile program (tests/helpers/hostile_programs.py, one named case each) is judged alone
by the real code reward under bubblewrap: it may score no more than an honest wrong answer,
the reward never raises, and the host is checked after each case (no process, zombie, file in
/tmp, listening socket or cgroup left). Then the pieces that make this hold, each on its own:
the plain-data codec, the trainer's validation of the report (forged reports through a
tampered trusted interpreter, malformed control frames), and the proxies' semantics for honest
solutions (exceptions, containers, keyword arguments, the HumanEval `check` format).
"""
import json
import math
import os
import random
import socket
import struct
import sys
import time

import pytest

from megagrpo.rewards import judge as judge_module
from megagrpo.rewards.code import CodeReward
from megagrpo.rewards.harness import wire
from megagrpo.rewards.judge import ControlReader, validate_report

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))
from hostile_programs import CORRECT, PROGRAMS, TESTS, WRONG  # noqa: E402
from sandbox_host import HostSnapshot  # noqa: E402

# HostSnapshot looks at the whole machine (every sandboxed process, /tmp, listening sockets)
pytestmark = pytest.mark.alone

LIMITS = dict(timeout_s=2.0, cpu_s=2, memory_mb=256, file_size_mb=8, processes=16, output_bytes=64 * 1024)


@pytest.fixture(scope="module")
def reward():
    r = CodeReward(sandbox="strict", workers=2, **LIMITS)
    yield r
    r.close()


def judge(reward, code, tests=TESTS, **fields):
    s = reward(["q"], [f"```python\n{code}\n```"], tests=[list(tests)], **{k: [v] for k, v in fields.items()})
    return s[0], s.reasons[0], {k: v[0] for k, v in s.components.items()}


@pytest.fixture(scope="module")
def honest_wrong(reward):
    value, reason, _ = judge(reward, WRONG)
    assert value == pytest.approx(0.2) and reason.startswith("3 of 3 tests failed"), reason
    return value


def test_a_correct_solution_scores_one(reward):
    assert judge(reward, CORRECT)[:2] == (1.0, "")


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_hostile_program(reward, honest_wrong, name):
    host = HostSnapshot()
    value, reason, components = judge(reward, PROGRAMS[name], time_budget_s=0.05)
    assert math.isfinite(value)
    if name == "fakes_fast_timing":  # right but slow (3 calls of 0.1 s): its clock cannot hide that
        # (0.3 s of sleep against the 2 s timeout: room for a loaded machine's interpreter start)
        assert components["tests"] == 1.0 and components["efficiency"] <= 0.05 / 0.3 + 1e-6, components
        assert value <= 0.2 + 0.6 + 0.2 * 0.05 / 0.3 + 1e-6
    else:
        assert value <= honest_wrong + 1e-9 and reason, (value, reason)
    assert host.changes() == []


def test_after_the_hostile_programs_the_warm_interpreters_still_judge_right(reward):
    s = reward(["q"] * 4, [CORRECT, WRONG, CORRECT, PROGRAMS["custom_eq"]], tests=[TESTS] * 4)
    assert list(s) == pytest.approx([1.0, 0.2, 1.0, 0.2])


# ---- the plain-data codec ------------------------------------------------------------------------

def test_plain_data_round_trips_as_fresh_builtins():
    values = [None, True, 0, -7, 2**200, 1.5, float("inf"), "é\x00", b"\x00\xff", [1, [2]], (1, (2,)),
              {1, "a"}, frozenset({(1, 2)}), {"a": 1, 2: [3], (1, 2): {b"k": None}}, {}, (), []]
    for value in values:
        back = wire.decode(json.loads(json.dumps(wire.encode(value))))
        assert back == value and type(back) is type(value)
    nan = wire.decode(json.loads(json.dumps(wire.encode(float("nan")))))
    assert math.isnan(nan)


def test_what_is_not_plain_data_is_refused():
    class Int(int):
        pass

    for value in [Int(3), object(), len, [1, object()], {1: lambda: 0}, iter([]), range(3), bytearray(b"x")]:
        with pytest.raises(wire.NotPlainData):
            wire.encode(value)
    deep = 0
    for _ in range(wire.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(wire.NotPlainData):
        wire.encode(deep)
    for bad in [{"t": 1}, {"x": []}, {"t": [], "s": []}, {"d": [[1]]}, {"d": [[[1], 2]]}, {"s": [[1]]},
                {"b": "zz"}, {"b": 5}, {"d": 3}, {}]:
        with pytest.raises(wire.NotPlainData):
            wire.decode(bad)


def test_decode_raises_nothing_but_not_plain_data_on_random_input():
    rng = random.Random(13)

    def junk(depth=0):
        pick = rng.randrange(9 if depth < 6 else 5)
        if pick == 0:
            return rng.choice([None, True, 3, -1.5, "s", float("nan")])
        if pick == 1:
            return rng.choice(["t", "s", "f", "b", "d", "x", 1])
        if pick == 2:
            return "".join(rng.choice("0123456789abcdefg") for _ in range(rng.randrange(5)))
        if pick < 5:
            return rng.randrange(-3, 3)
        if pick < 7:
            return [junk(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(["t", "s", "f", "b", "d", "q"]): junk(depth + 1) for _ in range(rng.randrange(1, 3))}

    for _ in range(3000):
        try:
            wire.decode(junk())
        except wire.NotPlainData:
            pass


# ---- the trainer validates every report --------------------------------------------------------

GOOD = {"passed": 2, "total": 3, "seconds": 0.01, "calls": 3, "failures": ["AssertionError: "], "ready": True}


@pytest.mark.parametrize("forged", [
    {**GOOD, "passed": 4}, {**GOOD, "passed": -1}, {**GOOD, "total": 2}, {**GOOD, "passed": True},
    {**GOOD, "seconds": float("nan")}, {**GOOD, "seconds": float("inf")}, {**GOOD, "seconds": -0.5},
    {**GOOD, "seconds": "0"}, {**GOOD, "calls": -1}, {**GOOD, "failures": [1]}, {**GOOD, "failures": "x"},
    {**GOOD, "ready": 1}, {k: v for k, v in GOOD.items() if k != "passed"}, [], "report", None, 3.0,
], ids=lambda f: json.dumps(f)[:60])
def test_forged_reports_are_invalid(forged):
    report, why = validate_report(forged, 3)
    assert report is None and why


def test_a_valid_report_is_cleaned():
    report, why = validate_report({**GOOD, "failures": ["x" * 10_000] * 50, "extra": 1}, 3)
    assert why == "" and len(report["failures"]) == 3 and len(report["failures"][0]) == 300 and "extra" not in report


def _frames(*objects):
    return b"".join(struct.pack(">I", len(body)) + body for body in (json.dumps(o).encode() for o in objects))


@pytest.mark.parametrize("stream,expected", [
    (_frames({"report": GOOD}, {"end": True}), ""),
    (_frames({"report": GOOD}, {"report": GOOD}, {"end": True}), "not exactly one"),
    (_frames({"end": True}), "not exactly one"),
    (_frames({"harness_error": "boom"}, {"end": True}), "failed: boom"),
    (_frames({"report": {**GOOD, "passed": 9}}, {"end": True}), "tests passed"),
    (struct.pack(">I", 2**31) + b"x", "control message of"),
    (struct.pack(">I", 3) + b"{x}" + _frames({"end": True}), "not a JSON message"),
    (_frames({"report": GOOD}), "closed"),
    (b"", "closed"),
])
def test_control_frames_are_checked(stream, expected):
    ours, theirs = socket.socketpair()
    theirs.sendall(stream)
    theirs.close()
    reader = ControlReader(ours)
    reader.wait(deadline=time.perf_counter() + 30)
    report, why = reader.report(3)
    ours.close()
    assert (report is not None) == (expected == "") and expected in why, why


def test_a_forging_trusted_interpreter_scores_zero_and_is_counted(monkeypatch):
    """The trainer side does not take the trusted side's word: a tampered harness that claims
    99 of 3 tests is `invalid_report`, scores 0 and shows in the metrics."""
    forged = judge_module.SOURCES["trusted"].replace('return {"passed": passed,', 'return {"passed": 99,')
    assert forged != judge_module.SOURCES["trusted"]
    monkeypatch.setitem(judge_module.SOURCES, "trusted", forged)
    r = CodeReward(sandbox="strict", workers=1, **LIMITS)
    try:
        s = r(["q"], [CORRECT], tests=[TESTS])
    finally:
        r.close()
    assert list(s) == [0.0] and s.reasons[0].startswith("invalid_report:") and "99 of 3" in s.reasons[0]
    assert s.components["fail/invalid_report"] == [1.0]


# ---- honest solutions still work as in one interpreter ------------------------------------------

def test_proxies_carry_values_exceptions_and_keywords(reward):
    code = ("def echo(x, scale=1):\n    return x if scale == 1 else [x] * scale\n"
            "def fail(kind):\n    raise {'key': KeyError, 'value': ValueError, 'mine': type('Mine', (Exception,), {})}"
            "[kind]('why')\n"
            "def obj():\n    return object()\n")
    tests = ["assert echo((1, 2)) == (1, 2) and type(echo((1,))) is tuple",
             "assert echo({1: b'x', 'k': {2, 3}}) == {1: b'x', 'k': {2, 3}}",
             "assert echo('a', scale=3) == ['a', 'a', 'a']",
             "try:\n    fail('key')\nexcept KeyError:\n    pass",
             "try:\n    fail('value')\nexcept ValueError as e:\n    assert 'why' in str(e)",
             "try:\n    fail('mine')\nexcept Exception as e:\n    assert 'Mine: why' in str(e)",
             "assert echo(lambda: 0) is None",
             "assert obj() is not None"]
    s = reward(["q"], [f"```python\n{code}\n```"], tests=[tests])
    assert s.components["tests"][0] == pytest.approx(6 / 8), s.reasons
    assert "not plain data" in s.reasons[0] or "TypeError" in s.reasons[0]


def test_the_humaneval_check_format(reward):
    check = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
    s = reward(["q"] * 2, [CORRECT, WRONG], tests=[check] * 2, entry_point=["add", "add"])
    assert list(s) == pytest.approx([1.0, 0.2])
