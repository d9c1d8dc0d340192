"""Which sandbox runs model-written code, and saying so (docs/sandbox.md, Modes).

Without bubblewrap on PATH, `sandbox: auto` (the default) refuses to build the code reward and
the python tool, naming what is missing and both ways out, as an error the trainer prints in
one line; `rlimits`, chosen knowingly, runs, warns, and says so in one log line; the code
reward's sandbox/<feature> components give `megagrpo report` its one line. Real bubblewrap,
real programs: PATH is a folder holding only the sandbox's other tools.
"""
import json
import os
import shutil

import pytest

from megagrpo.config.schema import Config, ConfigError, RewardFunctionConfig, ToolConfig
from megagrpo.report import main as report_main
from megagrpo.report import sandbox_lines
from megagrpo.rewards import RewardError, build_reward_functions
from megagrpo.rewards.code import CodeReward
from megagrpo.rollout.tools import PythonTool, Toolset
from megagrpo.run_logs import read_series
from megagrpo.sandbox import Sandbox, SandboxLimits, SandboxUnavailable

LIMITS = dict(timeout_s=3.0, cpu_s=2, memory_mb=256, file_size_mb=8, processes=16)
SOLUTION = "```python\ndef sq(x):\n    return x * x\n```"


@pytest.fixture
def no_bwrap(tmp_path, monkeypatch):
    """PATH with the sandbox's other tools and no `bwrap` (a machine where
    launch/install_system.sh has not run)."""
    for tool in ("setpriv", "prlimit", "kill"):
        os.symlink(shutil.which(tool), tmp_path / tool)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shutil.which("bwrap") is None


def assert_names_what_is_missing_and_both_ways_out(message: str, setting: str):
    assert "\n" not in message, message  # one line on the trainer's console
    assert f"{setting}: auto, but bubblewrap cannot run here (bwrap is not installed: no `bwrap` on PATH)" in message
    assert "install bubblewrap and allow unprivileged user namespaces" in message
    assert f"set {setting}: rlimits to accept rlimits only" in message


def test_auto_refuses_to_build_the_code_reward_without_bubblewrap(no_bwrap, capsys):
    with pytest.raises(RewardError) as refused:  # the default mode, as a new user's config has it
        build_reward_functions([RewardFunctionConfig(name="code", args=LIMITS)])
    message = str(refused.value)
    assert message.startswith("reward 'code' could not be built: SandboxUnavailable: "), message
    assert_names_what_is_missing_and_both_ways_out(message, "sandbox")
    assert "[megagrpo] sandbox" not in capsys.readouterr().out  # nothing was built


def test_auto_refuses_to_build_the_python_tool_without_bubblewrap(no_bwrap):
    cfg = Config()
    cfg.rollout.max_turns, cfg.rollout.tools = 2, [ToolConfig(name="python")]
    with pytest.raises(SandboxUnavailable) as refused:
        Toolset(cfg)
    assert isinstance(refused.value, ConfigError)  # train.main prints it as one line, no traceback
    assert_names_what_is_missing_and_both_ways_out(str(refused.value), "rollout.tools python args.mode")


def test_rlimits_runs_without_bubblewrap_and_says_so(no_bwrap, capsys):
    with pytest.warns(RuntimeWarning, match="bubblewrap is not in use"):
        reward = CodeReward(sandbox="rlimits", workers=1, **LIMITS)
    try:
        log = capsys.readouterr().out
        line = ("[megagrpo] sandbox (code reward): rlimits only (weaker: the code can read the host's files "
                "and reach its network; chosen by sandbox: rlimits)")
        assert log.splitlines() == [line], log
        s = reward(["q"], [SOLUTION], tests=[["assert sq(3) == 9", "assert sq(-2) == 4"]])
        assert s.components["tests"] == [1.0] and s.components["syntax"] == [1.0], s.reasons
        assert {k: v for k, v in s.components.items() if k.startswith("sandbox/")} == {
            "sandbox/bubblewrap": [0.0], "sandbox/seccomp": [0.0],
            "sandbox/cgroups": [1.0 if reward.sandbox.cgroups.available() else 0.0]}
    finally:
        reward.close()
    with pytest.warns(RuntimeWarning, match="bubblewrap is not in use"):
        tool = PythonTool({"mode": "rlimits", **LIMITS}, workers=1)
    try:
        assert capsys.readouterr().out.startswith("[megagrpo] sandbox (python tool): rlimits only (weaker")
        assert tool({"code": "print(6 * 7)"}) == "42\n"
    finally:
        tool.close()


def test_with_bubblewrap_auto_isolates_and_says_so(capsys):
    sandbox = Sandbox(SandboxLimits(**LIMITS), mode="auto")
    try:
        assert sandbox.isolated and sandbox.run("print('ok')").stdout == "ok\n"
        sandbox.announce("code reward")
        line = capsys.readouterr().out.strip()
        assert line.startswith("[megagrpo] sandbox (code reward): bubblewrap (namespaces, seccomp"), line
        if sandbox.cgroups.available():
            assert line == "[megagrpo] sandbox (code reward): bubblewrap (namespaces, seccomp, cgroups)"
    finally:
        sandbox.close()


def test_the_report_says_which_sandbox_judged_the_run(tmp_path, capsys):
    def write_run(rows):
        run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return run

    key = "train/rewards/code/sandbox/"
    isolated = write_run([{"step": s, key + "bubblewrap": 1.0, key + "seccomp": 1.0,
                           key + "cgroups": 1.0} for s in (1, 2)])
    assert report_main([str(isolated)]) == 0
    line = "Sandbox of the code reward: bubblewrap (namespaces, seccomp, cgroups)"
    assert capsys.readouterr().out.splitlines()[0] == line
    assert line in (isolated / "report" / "report.html").read_text()

    loose = write_run([{"step": 1, key + "bubblewrap": 0.0, key + "seccomp": 0.0, key + "cgroups": 1.0}])
    assert sandbox_lines(read_series(str(loose))) == [
        "Sandbox of the code reward: rlimits only (weaker: the code can read the host's files and reach its network)"]
    # a run resumed on a machine without cgroups: the share of the completions that had them
    mixed = write_run([{"step": s, key + "bubblewrap": 1.0, key + "seccomp": 1.0, key + "cgroups": c}
                       for s, c in ((1, 1.0), (2, 0.0))])
    assert sandbox_lines(read_series(str(mixed))) == [
        "Sandbox of the code reward: bubblewrap (namespaces, seccomp, cgroups for 50% of the completions)"]
    assert sandbox_lines(read_series(str(write_run([{"step": 1, "train/reward": 0.1}])))) == []


def test_the_process_limit_without_root_leaves_room_above_the_users_own_tasks():
    """Without root RLIMIT_NPROC counts every task of the user (this process's threads too): an
    execution's limit is the user's task count plus room for the executions beside it, and a
    long-lived one keeps the user's limit. As root each execution's uid has the plain limit."""
    import threading

    from megagrpo.sandbox import command
    from megagrpo.sandbox.process import tasks_of_uid

    assert tasks_of_uid(os.getuid()) >= threading.active_count()
    sandbox = Sandbox(SandboxLimits(**LIMITS), mode="rlimits")
    for as_root in (True, False):
        sandbox.as_root = as_root
        limits = [arg for arg in sandbox._rlimit_args(long_lived=False) if arg.startswith("--nproc=")]
        lived = [arg for arg in sandbox._rlimit_args(long_lived=True) if arg.startswith("--nproc=")]
        processes = sandbox.limits.processes
        if as_root:
            assert limits == lived == [f"--nproc={processes}"]
        else:
            assert lived == [] and int(limits[0].split("=")[1]) >= processes * command.SHARED_PROCESS_LIMIT + 1
