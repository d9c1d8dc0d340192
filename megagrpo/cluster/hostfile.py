"""Hostfiles (`host slots=N` lines, as the deepspeed runner and OpenMPI read them): parse them
with errors that name the file and line, and probe every host over ssh before any rank starts.

    python -m megagrpo.hostfile check hostfiles/4x8 [--num-nodes 2] [--ssh-port 22]
    python -m megagrpo.hostfile check hostfiles/4x8 --no-probe      # syntax only

launch/train.sh and launch/mpirun.sh run `check` first: a malformed line or a host that ssh
cannot reach stops the launch with a clear message instead of a hang or a half-started job.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

LINE = re.compile(r"^(?P<host>[A-Za-z0-9_.:\-]+)(?:\s+slots=(?P<slots>\d+))?(?:\s+max_slots=\d+)?$")


class HostfileError(ValueError):
    """A malformed hostfile, or hosts that cannot be reached."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    line: int


def parse_hostfile(path: str) -> list[Host]:
    """Hosts in file order. Comments (#) and blank lines are skipped; `slots=` is required (the
    deepspeed runner needs it), must be >= 1, and a host may appear once."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise HostfileError(f"hostfile '{path}' cannot be read: {e.strerror}") from None
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        where = f"{path}:{number}"
        match = LINE.match(text)
        if not match:
            raise HostfileError(f"{where}: malformed line '{raw.strip()}'; expected "
                                "'<hostname> slots=<N>', e.g. 'node01 slots=8'")
        if match["slots"] is None:
            raise HostfileError(f"{where}: '{text}' has no slots=N (the number of ranks, one per "
                                "GPU, to start on that host)")
        slots = int(match["slots"])
        if slots < 1:
            raise HostfileError(f"{where}: slots={slots} must be >= 1")
        name = match["host"]
        if name in seen:
            raise HostfileError(f"{where}: host '{name}' is listed again (first at line "
                                f"{seen[name]}); give it one line with all its slots")
        seen[name] = number
        hosts.append(Host(name, slots, number))
    if not hosts:
        raise HostfileError(f"hostfile '{path}' lists no hosts; add lines like 'node01 slots=8'")
    return hosts


def select(hosts: list[Host], num_nodes: int | None = None, slots_per_node: int | None = None) -> list[Host]:
    """The hosts and slots a launch uses: the first num_nodes hosts, slots_per_node ranks each
    (the deepspeed runner's --num_nodes / --num_gpus)."""
    if num_nodes is not None:
        if num_nodes > len(hosts):
            raise HostfileError(f"NUM_NODES={num_nodes} but the hostfile lists {len(hosts)} hosts")
        hosts = hosts[:num_nodes]
    if slots_per_node is not None:
        for h in hosts:
            if slots_per_node > h.slots:
                raise HostfileError(f"GPUS_PER_NODE={slots_per_node} but host '{h.name}' (line "
                                    f"{h.line}) has slots={h.slots}")
        hosts = [Host(h.name, slots_per_node, h.line) for h in hosts]
    return hosts


def probe(host: str, ssh_port: int | None = None, timeout_s: int = 5) -> str | None:
    """None when `ssh host true` succeeds without a password prompt, else ssh's complaint."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout_s}"]
    if ssh_port:
        cmd += ["-p", str(ssh_port)]
    try:
        proc = subprocess.run(cmd + [host, "true"], capture_output=True, text=True,
                              timeout=timeout_s + 10, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout_s + 10} s"
    except FileNotFoundError:
        return "no ssh client on this machine"
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"ssh exited with {proc.returncode}"


def check_reachable(hosts: list[Host], ssh_port: int | None = None, timeout_s: int = 5) -> None:
    """Probe every host at once; raise naming each one that passwordless ssh cannot reach."""
    with ThreadPoolExecutor(max_workers=min(64, len(hosts))) as pool:
        answers = list(pool.map(lambda h: probe(h.name, ssh_port, timeout_s), hosts))
    bad = [(h, why) for h, why in zip(hosts, answers) if why]
    if bad:
        lines = "\n".join(f"  {h.name} (line {h.line}): {why}" for h, why in bad)
        raise HostfileError(f"{len(bad)} of {len(hosts)} hosts cannot be reached with "
                            f"passwordless ssh (`ssh -o BatchMode=yes {bad[0][0].name} true`):\n"
                            f"{lines}\nNo rank was started. Fix ssh keys/known_hosts or remove "
                            "those hosts from the hostfile.")


def describe(hosts: list[Host]) -> str:
    """`world 16 on 2 nodes: node01 ranks 0-7, node02 ranks 8-15`."""
    parts, rank = [], 0
    for h in hosts:
        last = rank + h.slots - 1
        parts.append(f"{h.name} rank{'s' if h.slots > 1 else ''} "
                     f"{rank}{f'-{last}' if last > rank else ''}")
        rank = last + 1
    return f"world {rank} on {len(hosts)} node{'s' if len(hosts) > 1 else ''}: " + ", ".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megagrpo.hostfile",
                                description="Check a hostfile before a launch.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="parse, then probe every host with passwordless ssh")
    c.add_argument("hostfile")
    c.add_argument("--num-nodes", type=int, default=None, help="only the first N hosts")
    c.add_argument("--slots-per-node", type=int, default=None, help="ranks per host")
    c.add_argument("--ssh-port", type=int, default=None)
    c.add_argument("--timeout", type=int, default=5, help="ssh ConnectTimeout in seconds")
    c.add_argument("--count", action="store_true", help="print only the number of hosts")
    c.add_argument("--no-probe", action="store_true",
                   help="check the syntax only (a one-host file is never probed: it runs locally)")
    args = p.parse_args(argv)
    try:
        hosts = select(parse_hostfile(args.hostfile), args.num_nodes, args.slots_per_node)
        probed = not args.no_probe and len(hosts) > 1  # one host: the launchers start it locally
        if probed:
            check_reachable(hosts, args.ssh_port, args.timeout)
    except HostfileError as e:
        print(f"megagrpo: hostfile error: {e}", file=sys.stderr)
        return 2
    if args.count:
        print(len(hosts))
        return 0
    print(f"megagrpo: {args.hostfile}: {describe(hosts)}"
          + ("; every host answers over ssh" if probed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
