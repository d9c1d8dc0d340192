"""Write a deepspeed/OpenMPI hostfile (`host slots=N`) for the nodes of a SLURM job.

    python tools/hostfile_from_slurm.py --out $HOSTFILE                 # inside a job
    python tools/hostfile_from_slurm.py --nodelist 'gpu[01-03,07],cpu5' --slots 8

Nodes come from --nodelist or $SLURM_JOB_NODELIST, expanded here as `scontrol show
hostnames` does (`gpu[01-03,07],cpu5` -> gpu01 gpu02 gpu03 gpu07 cpu5; padding kept; several
bracket groups multiply: `r[1-2]n[1-2]` -> r1n1 r1n2 r2n1 r2n2), plus a suffix after a bracket
(`n[1-2]-ib` -> n1-ib n2-ib, which scontrol 22.05 refuses). Slots per node, first found of:
--slots, $SLURM_GPUS_ON_NODE, $SLURM_GPUS_PER_NODE (`8` or `a100:8`), $SLURM_NTASKS_PER_NODE,
$SLURM_TASKS_PER_NODE (`8(x3),4`: per node). Standard library only (runs before any venv).
"""
from __future__ import annotations

import argparse
import os
import re
import sys


class NodelistError(ValueError):
    pass


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise NodelistError(f"nested brackets in nodelist '{text}'")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise NodelistError(f"unbalanced ']' in nodelist '{text}'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise NodelistError(f"unbalanced '[' in nodelist '{text}'")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range(body: str, item: str) -> list[str]:
    values = []
    for piece in body.split(","):
        piece = piece.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", piece)
        if not match:
            raise NodelistError(f"bad range '{piece}' in '{item}'; expected N or N-M")
        lo, hi = match.group(1), match.group(2) or match.group(1)
        if int(hi) < int(lo):
            raise NodelistError(f"range '{piece}' in '{item}' runs backwards")
        width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
        values += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return values


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact nodelist -> host names, in order, duplicates dropped."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        names = [""]
        for literal, body in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            choices = _expand_range(body, item) if body else [""]
            names = [n + literal + c for n in names for c in choices]
        hosts += names
    seen = set()
    return [h for h in hosts if h and not (h in seen or seen.add(h))]


def expand_counts(spec: str) -> list[int]:
    """SLURM's per-node counts (`8(x3),4`) -> [8, 8, 8, 4]."""
    counts = []
    for piece in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", piece)
        if not match:
            raise NodelistError(f"bad per-node count '{piece}' in '{spec}'; expected N or N(xM)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slots_per_node(num_nodes: int, slots: int | None = None, env=os.environ) -> list[int]:
    """Ranks to start on each node (one per GPU), from --slots or the job's variables."""
    if slots is not None:
        return [slots] * num_nodes
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = env.get(key, "").strip()
        if value:
            match = re.fullmatch(r"(?:[\w-]+:)?(\d+)", value)
            if match and int(match.group(1)) > 0:  # 0: a CPU job (--gpus-per-node=0)
                return [int(match.group(1))] * num_nodes
    if env.get("SLURM_NTASKS_PER_NODE", "").strip():
        return [int(env["SLURM_NTASKS_PER_NODE"])] * num_nodes
    if env.get("SLURM_TASKS_PER_NODE", "").strip():
        counts = expand_counts(env["SLURM_TASKS_PER_NODE"])
        if len(counts) != num_nodes:
            raise NodelistError(f"SLURM_TASKS_PER_NODE={env['SLURM_TASKS_PER_NODE']} gives "
                                f"{len(counts)} counts for {num_nodes} nodes")
        return counts
    raise NodelistError("slots per node unknown: pass --slots N (GPUs per node), or request "
                        "GPUs (--gpus-per-node) or tasks (--ntasks-per-node) in the job")


def hostfile_text(hosts: list[str], slots: list[int]) -> str:
    return "".join(f"{h} slots={n}\n" for h, n in zip(hosts, slots))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodelist", default=os.environ.get("SLURM_JOB_NODELIST"),
                   help="compact nodelist (default: $SLURM_JOB_NODELIST)")
    p.add_argument("--slots", type=int, default=None, help="ranks (GPUs) per node")
    p.add_argument("--out", default="-", help="hostfile to write ('-': stdout)")
    args = p.parse_args(argv)
    try:
        if not args.nodelist:
            raise NodelistError("no nodelist: run inside a SLURM job or pass --nodelist")
        hosts = expand_nodelist(args.nodelist)
        text = hostfile_text(hosts, slots_per_node(len(hosts), args.slots))
    except NodelistError as e:
        print(f"hostfile_from_slurm: {e}", file=sys.stderr)
        return 2
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
