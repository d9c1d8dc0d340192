"""Launching the way clusters do, with the real daemons on this machine: `deepspeed --hostfile`
over pdsh and sshd (two "nodes": localhost and 127.0.0.1), SLURM (munged, slurmctld, slurmd;
sbatch, srun, requeue), OpenMPI's mpirun; a rank killed mid-step; hostfile and nodelist tools;
the dry-run of every shipped real-job config. The fixtures start each daemon on free ports with
files under pytest's tmp dir (tests/helpers/daemons.py), and stop it at the end (checked)."""
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, free_port, run, tiny_overrides

sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
import daemons  # noqa: E402
import hostfile_from_slurm as hfs  # noqa: E402
from runs import assert_same_run, series  # noqa: E402

from megagrpo.cluster.hostfile import HostfileError, parse_hostfile  # noqa: E402

# a short GRPO run: transformers rollout (vLLM is not the point here), 2 steps, no eval/export
SHORT = {"rollout.engine": "hf", "grpo.max_steps": 2, "grpo.per_device_train_batch_size": 16,
         "data.eval_file": "", "checkpoint.save_hf_at_end": "false"}


def overrides(tiny, out, **extra):
    return tiny_overrides(tiny, out, **{**SHORT, **extra})


def newest_checkpoint(out) -> int:
    """The step of the newest complete checkpoint under out/checkpoints (0: none)."""
    steps = [int(m.group(1)) for path in glob.glob(str(out / "checkpoints" / "step_*" / "COMPLETE"))
             if (m := re.fullmatch(r"step_(\d{8})", os.path.basename(os.path.dirname(path))))]
    return max(steps, default=0)


def job_processes(marker):
    """pids of every process whose command line names `marker` (a run's output_dir)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


# ---- nodelists and hostfiles (no daemons) ----------------------------------------------------

def test_nodelist_expansion_and_slots():
    assert hfs.expand_nodelist("gpu[01-03,07],cpu5") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]
    assert hfs.expand_nodelist("n[1-2]-ib,x") == ["n1-ib", "n2-ib", "x"]
    assert hfs.expand_nodelist("n[8-11]") == ["n8", "n9", "n10", "n11"]
    assert hfs.expand_nodelist("n[008-010]") == ["n008", "n009", "n010"]
    assert hfs.expand_nodelist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    assert hfs.expand_nodelist("a,b,a") == ["a", "b"]
    for bad in ("n[1-3", "n[3-1]", "n[a-b]", "n[1-2]]"):
        with pytest.raises(hfs.NodelistError):
            hfs.expand_nodelist(bad)
    assert hfs.expand_counts("8(x3),4") == [8, 8, 8, 4]
    assert hfs.slots_per_node(2, env={"SLURM_GPUS_ON_NODE": "8"}) == [8, 8]
    assert hfs.slots_per_node(2, env={"SLURM_GPUS_PER_NODE": "h100:4"}) == [4, 4]
    assert hfs.slots_per_node(2, env={"SLURM_GPUS_PER_NODE": "0", "SLURM_NTASKS_PER_NODE": "2"}) == [2, 2]
    assert hfs.slots_per_node(3, env={"SLURM_TASKS_PER_NODE": "2(x2),1"}) == [2, 2, 1]
    assert hfs.slots_per_node(2, slots=3, env={"SLURM_GPUS_ON_NODE": "8"}) == [3, 3]
    with pytest.raises(hfs.NodelistError, match="slots per node unknown"):
        hfs.slots_per_node(2, env={})
    proc = run([sys.executable, "tools/hostfile_from_slurm.py", "--slots", "8"],
               env={"SLURM_JOB_NODELIST": "gpu[01-03,07],cpu5"})
    assert proc.stdout.splitlines() == [f"{h} slots=8" for h in ("gpu01", "gpu02", "gpu03", "gpu07", "cpu5")]


def test_nodelist_matches_scontrol(tmp_path):
    """Our expansion equals SLURM's own `scontrol show hostnames` wherever scontrol accepts
    the form (it needs a slurm.conf to start, no daemon)."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\n"
                    "PartitionName=p Nodes=localhost\n")
    for nodelist in ("gpu[01-03,07],cpu5", "n[8-11]", "n[008-010],m", "rack[1-2]-n[01-02]", "a[1-2]b[3-4]"):
        proc = run(["scontrol", "show", "hostnames", nodelist], env={"SLURM_CONF": str(conf)})
        assert hfs.expand_nodelist(nodelist) == proc.stdout.split(), nodelist


def test_hostfile_parse_errors_name_file_and_line(tmp_path):
    good = tmp_path / "good"
    good.write_text("# comment\nnode01 slots=8   # inline\n\nnode02 slots=8 max_slots=8\n")
    assert [(h.name, h.slots, h.line) for h in parse_hostfile(str(good))] == [("node01", 8, 2), ("node02", 8, 4)]
    for text, message in [("node01 slots=8\nnode02 slot=8\n", ":2: malformed line 'node02 slot=8'"),
                          ("node01\n", ":1: 'node01' has no slots=N"),
                          ("node01 slots=0\n", ":1: slots=0 must be >= 1"),
                          ("a slots=1\nb slots=1\na slots=2\n", ":3: host 'a' is listed again (first at line 1)"),
                          ("# nothing\n", "lists no hosts")]:
        path = tmp_path / "bad"
        path.write_text(text)
        with pytest.raises(HostfileError) as e:
            parse_hostfile(str(path))
        assert message in str(e.value) and str(path) in str(e.value)


@pytest.mark.multirank
def test_malformed_hostfile_stops_launch_before_any_rank(tiny, tmp_path):
    bad = tmp_path / "hosts"
    bad.write_text("localhost slots=1\n127.0.0.1 slots=one\n")
    proc = run(["bash", "launch/train.sh", *overrides(tiny, tmp_path / "run")], check=False,
               env={"HOSTFILE": str(bad)})
    assert proc.returncode == 2
    assert f"{bad}:2: malformed line '127.0.0.1 slots=one'" in proc.stderr
    # stopped before any rank: nothing launched, no rank wrote its output folder
    assert "launching" not in proc.stdout and not (tmp_path / "run").exists()


@pytest.mark.multirank
def test_shipped_job_configs_validate_and_dry_run(tiny, tmp_path, monkeypatch):
    """The real-job configs pass validation as shipped (hub model names are not fetched to
    validate), and the dry-run of train.sh and of the sbatch script (outside a job, SLURM's
    variables set by hand) prints the world, the layout and the command. The plan reads only
    the model's config.json: a local folder holds the architecture (the published Qwen2.5
    numbers), so nothing is downloaded; the data files point at the tiny task."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import Qwen2Config

    from megagrpo.validation import load_config
    arch = {"0.5b": (896, 4864, 24, 14, 2, 151936, True, 494.03),
            "7b": (3584, 18944, 28, 28, 4, 152064, False, 7615.62),
            "32b": (5120, 27648, 64, 40, 8, 152064, False, 32763.88),
            "72b": (8192, 29568, 80, 64, 8, 152064, False, 72706.20)}
    jobs = [("configs/qwen2.5_0.5b_1gpu.yaml", "0.5b", "hostfiles/single_node", {"GPUS_PER_NODE": "1"}, 1),
            ("configs/qwen2.5_7b_1x8.yaml", "7b", "hostfiles/single_node", {}, 8),
            ("configs/qwen2.5_7b_lora_1x8.yaml", "7b", "hostfiles/single_node", {}, 8),
            ("configs/qwen2.5_32b_4x8.yaml", "32b", "hostfiles/4x8", {}, 32),
            ("configs/qwen2.5_72b_4x8.yaml", "72b", "hostfiles/4x8", {}, 32)]
    data = [f"data.train_file={tiny['data']}/train.jsonl", f"data.eval_file={tiny['data']}/eval.jsonl"]
    commands = []
    monkeypatch.chdir(ROOT)  # configs name their DeepSpeed JSON relative to the repository
    for config, name, hostfile, env, world in jobs:
        cfg = load_config(config, data)  # as shipped: model.name_or_path is a hub name
        assert cfg.model.name_or_path.startswith("Qwen/") and cfg.model.dtype == "bfloat16"
        hidden, inter, layers, heads, kv, vocab, tied, _ = arch[name]
        Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                    tie_word_embeddings=tied).save_pretrained(tmp_path / name)
        commands.append((["bash", "launch/train.sh", "--dry-run", f"model.name_or_path={tmp_path / name}", *data],
                         {"HOSTFILE": hostfile, "CONFIG": config, **env}))
    # the 4 x 8 job as SLURM starts it (srun)
    commands.append((["bash", "launch/slurm.sbatch", f"model.name_or_path={tmp_path / '32b'}", *data],
                     {"SLURM_JOB_NODELIST": "gpu[01-04]", "SLURM_NTASKS": "32", "SLURM_JOB_ID": "77",
                      "SLURM_GPUS_ON_NODE": "8", "DRY_RUN": "1", "CONFIG": "configs/qwen2.5_32b_4x8.yaml",
                      "HOSTFILE": str(tmp_path / "slurm_hosts")}))
    with ThreadPoolExecutor(2) as pool:
        outputs = list(pool.map(lambda c: run(c[0], env=c[1]).stdout, commands))
    for (config, name, hostfile, _, world), out in zip(jobs, outputs):
        assert f"world {world} = dp {world} x tp 1" in out, out
        assert f"model: {arch[name][-1]:.2f}M parameters" in out
        if world == 32:  # one vLLM engine per node, sharded over its 8 GPUs
            assert "world 32 = dp 32 x tp 1 x pp 1, vLLM tp 8" in out and "rollout_weights" in out
        assert f"command: deepspeed --hostfile {hostfile}" in out and f"--config {config}" in out
        assert "megagrpo: launching" not in out
        if "lora" in config:  # r 32 on every linear layer: 32 x (in + out) x 7 per layer, 28 layers
            assert "LoRA adapters: 80.74M trained parameters" in out and "\n  reference             0.00 MiB" in out
    out = outputs[-1]
    assert "world 32 on 4 nodes: gpu01 ranks 0-7, gpu02 ranks 8-15" in out
    assert "world 32 = dp 32 x tp 1" in out and "command: srun --kill-on-bad-exit=1" in out
    assert "master gpu01:20077" in out


# ---- sshd + pdsh: two "nodes" on this machine ------------------------------------------------

@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A real sshd on 127.0.0.1 and an `ssh` configured for it first on PATH (helpers/daemons.py)."""
    with daemons.sshd(tmp_path_factory.mktemp("sshd")) as env:
        yield env


@pytest.fixture(scope="module")
def single_node(tiny, tmp_path_factory):
    """The reference run's folder: 2 ranks on one node through launch/train.sh (the runner
    starts both ranks locally, no ssh)."""
    out = tmp_path_factory.mktemp("single") / "run"
    proc = run(["bash", "launch/train.sh", *overrides(tiny, out)],
               env={"HOSTFILE": "hostfiles/localhost_2", "MASTER_PORT": str(free_port())})
    assert "--no_ssh_check" in proc.stdout and "world 2 = dp 2" in proc.stdout
    assert [s for s, _ in series(out, "train/loss")] == [1, 2]
    return out


@pytest.mark.multirank
@pytest.mark.daemons
def test_pdsh_two_nodes_over_sshd_equal_single_node(tiny, tmp_path, sshd, single_node):
    out = tmp_path / "run"
    proc = run(["bash", "launch/train.sh", *overrides(tiny, out)],
               env={**sshd, "HOSTFILE": "hostfiles/localhost_pair", "MASTER_PORT": str(free_port())})
    log = proc.stdout + proc.stderr
    assert "every host answers over ssh" in log and "cmd = pdsh -S" in log
    # each node's launcher and rank ran in its own ssh session and logged through pdsh
    assert "localhost: " in log and "127.0.0.1: " in log
    assert "node_rank=0" in log and "node_rank=1" in log
    assert "localhost: [megagrpo] world 2 = dp 2" in log and "done: 2 steps" in log
    # the same run to a few ulp, not bit for bit: on a loaded machine (another worker's test beside
    # it) the one-node run's sampled log-probs came out once in 3 suites, and once in 3 runs beside
    # 8 busy loops, a few ulp off (-0.31756294 against -0.31756282, 4 ulp; the trainer's entropy
    # equal to the last digit), which moves the loss by about as much. 1e-6 relative is some 8 ulp
    # of a float32 loss; a parameter 1e-7 off is a thousandth of a step's update (lr 1e-4)
    assert_same_run(out, single_node, loss_rtol=1e-6, grad_norm_rtol=1e-6, param_atol=1e-7,
                    checkpoint="step_00000002")


@pytest.mark.multirank
@pytest.mark.daemons
def test_unreachable_host_stops_launch_before_any_rank(tiny, tmp_path, sshd):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=1\nno-such-host.invalid slots=1\n")
    proc = run(["bash", "launch/train.sh", *overrides(tiny, tmp_path / "run")], check=False,
               env={**sshd, "HOSTFILE": str(hosts)})
    assert proc.returncode == 2
    assert "1 of 2 hosts cannot be reached" in proc.stderr
    assert "no-such-host.invalid (line 2)" in proc.stderr and "localhost (line" not in proc.stderr
    # stopped before any rank: nothing launched, no rank wrote its output folder
    assert "launching" not in proc.stdout and not (tmp_path / "run").exists()


@pytest.mark.multirank
@pytest.mark.daemons
def test_memory_check_stops_launch_before_any_rank(tiny, tmp_path, sshd):
    """A node too small for the planned peak (NODE_MEMORY_GIB): exit 3 with the switches that
    would help, before any rank starts; MEMORY_CHECK=0 is named as the way around it."""
    proc = run(["bash", "launch/train.sh", *overrides(tiny, tmp_path / "run")], check=False,
               env={**sshd, "HOSTFILE": "hostfiles/localhost_pair", "NODE_MEMORY_GIB": "0.5"})
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "the planned peak memory per rank does not fit: 1 rank(s) x " in proc.stderr
    assert "of the 512.00 MiB RAM of this node" in proc.stderr and "MEMORY_CHECK=0" in proc.stderr
    assert "grpo.kl_coef=0" in proc.stderr
    assert "launching" not in proc.stdout and not (tmp_path / "run").exists()


@pytest.mark.multirank
@pytest.mark.daemons
def test_rank_killed_mid_step_ends_the_job_promptly(tiny, tmp_path, sshd):
    """SIGKILL the rank on the second "node" after its first checkpoint: the launcher exits
    non-zero by itself, the job trains no further (no checkpoint completes after the kill but
    the one the dead rank had already finished its part of), the log ends with the dead rank's
    exit, and no process of the job is left on the machine (ranks, per-node launchers, pdsh,
    ssh sessions). Timings are not asserted (bench/ measures them): the waits below only bound
    a hang."""
    out = tmp_path / "run"
    cmd = ["bash", "launch/train.sh", *overrides(tiny, out, **{"grpo.max_steps": 200, "checkpoint.save_steps": 1})]
    env = {**os.environ, **sshd, "PYTHONPATH": ROOT, "HOSTFILE": "hostfiles/localhost_pair",
           "MASTER_PORT": str(free_port())}
    log = open(tmp_path / "log", "w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 480
        while not glob.glob(str(out / "checkpoints" / "step_00000001" / "COMPLETE")):
            assert proc.poll() is None and time.monotonic() < deadline, open(tmp_path / "log").read()[-3000:]
            time.sleep(0.2)
        victims = []
        for pid in job_processes(f"output_dir={out}"):
            try:
                cmdline = open(f"/proc/{pid}/cmdline").read().split("\0")
                environ = open(f"/proc/{pid}/environ").read().split("\0")
            except OSError:
                continue
            if cmdline[1:4] == ["-u", "-m", "megagrpo.train"] and "RANK=1" in environ:
                victims.append(pid)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        # read after the kill: from now on a save completes only if the dead rank had already
        # passed its last collective, which only the save in progress can have
        saved_at_kill = newest_checkpoint(out)
        try:
            rc = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            raise AssertionError("the launcher did not end the job after its rank died:\n"
                                 + open(tmp_path / "log").read()[-3000:]) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = open(tmp_path / "log").read()
    assert rc != 0, (rc, text[-3000:])
    # the job ended because of the kill: it did not finish, nor train on past it
    assert not re.search(r"done: \d+ steps", text), text[-3000:]
    final = newest_checkpoint(out)
    assert 1 <= saved_at_kill <= final <= saved_at_kill + 1, (saved_at_kill, final, text[-3000:])
    # the summary at the end of the log names the dead rank's exit (SIGKILL: -9)
    summary = text.split("megagrpo: the job failed")[-1]
    ranks, explanation = summary.split("megagrpo: a rank was killed by SIGKILL, most likely by the kernel's "
                                       "out-of-memory killer")
    assert "rank exits with return code = -9" in ranks.strip().splitlines()[-1], summary
    assert "dmesg -T" in explanation and "megagrpo plan" in explanation
    # no process of the job is left; the last ones may still be exiting (the wait bounds a leak)
    deadline = time.monotonic() + 60
    while job_processes(f"output_dir={out}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job_processes(f"output_dir={out}") == []
    assert glob.glob(str(out / "checkpoints" / "step_*" / "COMPLETE"))  # what was saved stays


# ---- SLURM: a one-node cluster ----------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """munged, slurmctld and slurmd: a one-node cluster with 2 CPUs (helpers/daemons.py)."""
    with daemons.slurm_cluster(tmp_path_factory.mktemp("slurm"), cpus=2) as env:
        yield env


def job_state(job, env):
    out = run(["scontrol", "show", "job", job], env=env).stdout
    fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
    return fields["JobState"], int(fields.get("Restarts", 0))


@pytest.mark.multirank
@pytest.mark.daemons
def test_slurm_sbatch_runs_and_a_requeued_job_resumes(tiny, tmp_path, slurm):
    """sbatch --wait of launch/slurm.sbatch (srun starts 2 ranks); then a second job on the
    same output_dir (the deepspeed runner this time) resumes at step 2, is requeued with
    `scontrol requeue` after its step-3 checkpoint, and its second attempt resumes there."""
    out = tmp_path / "run"
    resources = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", "--time=10"]
    first = run(["sbatch", "--wait", *resources, f"--output={tmp_path}/first-%j.out",
                 f"--export=ALL,MASTER_PORT={free_port()}", "launch/slurm.sbatch",
                 *overrides(tiny, out, **{"logging.progress_bar": "true"})],
                env=slurm, timeout=300)
    job1 = first.stdout.split()[-1]
    log1 = open(tmp_path / f"first-{job1}.out").read()
    assert f"megagrpo: job {job1} attempt 1 on localhost (srun" in log1
    assert "world 2 = dp 2" in log1 and "done: 2 steps" in log1, log1[-3000:]
    # the job's log is not a terminal: one compact progress line per logged step, no bar
    assert "\r" not in log1 and "GRPO:" not in log1
    progress = [line for line in log1.splitlines() if line.startswith("[megagrpo] step ")]
    assert [line.split()[2] for line in progress] == ["1/2", "2/2"], progress
    assert all(" reward " in line and " kl " in line and " tokens/s " in line and " eta " in line for line in progress)
    assert (out / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    assert job_state(job1, slurm) == ("COMPLETED", 0)

    second = run(["sbatch", "--parsable", *resources, f"--output={tmp_path}/second-%j.out",
                  f"--export=ALL,MASTER_PORT={free_port()},LAUNCHER=deepspeed", "launch/slurm.sbatch",
                  *overrides(tiny, out, **{"grpo.max_steps": 6, "checkpoint.save_steps": 1})], env=slurm)
    job2 = second.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 480  # bounds a hang only; no timing is asserted
    while not (out / "checkpoints" / "step_00000003" / "COMPLETE").is_file():
        assert time.monotonic() < deadline and job_state(job2, slurm)[0] in ("PENDING", "RUNNING"), \
            open(glob.glob(f"{tmp_path}/second-*.out")[0]).read()[-3000:]
        time.sleep(0.2)
    assert job_state(job2, slurm)[0] == "RUNNING"  # still running: the requeue interrupts it
    # SLURM holds a requeued job back for the credential lifetime (cred_expire: 10 s in this
    # cluster's slurm.conf, 120 s by default); started sooner (StartTime=now), slurmd refuses it
    # ("Job credential revoked") and the job fails
    run(["scontrol", "requeue", job2], env=slurm)
    deadline = time.monotonic() + 480  # bounds a hang only
    while job_state(job2, slurm)[0] not in ("COMPLETED", "FAILED", "CANCELLED"):
        assert time.monotonic() < deadline, open(tmp_path / f"second-{job2}.out").read()[-3000:]
        time.sleep(1)
    log2 = open(tmp_path / f"second-{job2}.out").read()
    assert job_state(job2, slurm) == ("COMPLETED", 1), log2[-3000:]
    attempts = log2.split(f"megagrpo: job {job2} attempt 2")
    assert len(attempts) == 2, log2[-3000:]
    assert "(deepspeed, master localhost:" in attempts[0]
    assert "DUE TO JOB REQUEUE" in attempts[0]
    assert "resumed from" in attempts[0] and "at step 2" in attempts[0]
    resumed_at = int(attempts[1].split("resumed from")[1].split("at step ")[1].split()[0])
    assert resumed_at >= 3  # not restarted: the second attempt continues from the last checkpoint
    assert "done: 6 steps" in attempts[1]
    state = json.load(open(out / "checkpoints" / "step_00000006" / "trainer_state.json"))
    assert state["step"] == 6 and state["sampler"]["position"] == 6


# ---- OpenMPI ---------------------------------------------------------------------------------

@pytest.mark.multirank
@pytest.mark.daemons
def test_mpirun_two_ranks(tiny, tmp_path, single_node):
    """mpirun starts 2 ranks; they find rank, world size and rank 0 through mpi4py (DeepSpeed's
    MPI discovery), on the MASTER_PORT the script passes."""
    out = tmp_path / "run"
    port = free_port()
    proc = run(["bash", "launch/mpirun.sh", *overrides(tiny, out)],
               env={"HOSTFILE": "hostfiles/localhost_2", "MASTER_PORT": str(port)})
    assert "mpirun -np 2 --hostfile hostfiles/localhost_2" in proc.stdout
    assert "world 2 = dp 2" in proc.stdout and "done: 2 steps" in proc.stdout
    assert (out / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    # same samples and updates; torch's CPU thread count differs from the deepspeed launcher's,
    # so the sums round differently, and Adam divides by sqrt(v): an element whose gradient is
    # near zero moves by a share of the learning rate on rounding alone (measured: 2.1e-6, one
    # element of 480k above 1e-6). 1e-5 is 5% of one step at lr 2e-4; a lost or doubled update
    # would show in the gradient norm and every element
    assert_same_run(out, single_node, loss_rtol=1e-5, loss_atol=1e-6, grad_norm_rtol=1e-5, param_atol=1e-5,
                    checkpoint="step_00000002")
