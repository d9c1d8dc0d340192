"""The `megagrpo` console script.

    megagrpo train --config X.yaml key.sub=value ...   (same as python -m megagrpo.train)
    megagrpo validate --config X.yaml key.sub=value ... (check the config, build nothing)
    megagrpo plan --config X.yaml --world-size N ...    (layout and memory per rank)
    megagrpo eval --model PATH --data FILE [--config X.yaml] [key.sub=value ...]
    megagrpo convert inspect CKPT | to-hf CKPT OUT | to-adapter CKPT OUT | adapter-to-hf ADAPTER OUT
    megagrpo report RUN_DIR                             (HTML page and PNGs of a run)
    megagrpo rate RUN_DIR [--against OTHER] [--pairwise] (people score held-out samples, blind)
    megagrpo doctor RUN_DIR [doctor.key=value ...]      (what the run doctor finds in a run's curves)
    megagrpo config --markdown                          (the configuration reference page)
"""
from __future__ import annotations

import argparse
import sys

from megagrpo.process_exit import exit_without_teardown

USAGE = """usage: megagrpo <command> [options]

commands:
  train      run GRPO training (see `megagrpo train --help`)
  validate   check a config and its overrides without building anything
  plan       print the layout (dp/tp/pp per rank) and the model-state bytes per rank
  eval       evaluate a model on a held-out file (rewards, pass@k, BLEU, ROUGE, perplexity)
  convert    inspect a checkpoint, export it as an HF folder or a LoRA adapter (`megagrpo convert --help`)
  report     render a run's metrics, held-out results and samples as one HTML page with PNGs
  rate       serve a local page where people score held-out samples 1-5, blind; aggregates into the report
  doctor     read a run's curves (finished or running): each finding's step, likely cause and fix
  config     print the configuration reference (docs/configuration.md) with --markdown
"""


def validate_command(argv) -> int:
    from megagrpo.config.loading import to_dict
    from megagrpo.config.schema import ConfigError
    from megagrpo.validation import load_config

    p = argparse.ArgumentParser(prog="megagrpo validate",
                                description="Check a config (and overrides); print the result.")
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"megagrpo: config error: {e}", file=sys.stderr)
        return 2
    import yaml
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return 0


def plan_command(argv) -> int:
    import os

    from megagrpo.config.schema import ConfigError
    from megagrpo.memory_fit import longest_row, memory_verdict, node_memory_bytes
    from megagrpo.planning import format_plan, make_plan
    from megagrpo.validation import load_config

    p = argparse.ArgumentParser(prog="megagrpo plan",
                                description="Print the layout and the memory each rank will hold at its peak; "
                                            "with --check-memory, exit 3 when that does not fit a node.")
    p.add_argument("--config", required=True)
    p.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                   help="ranks in the job (default: $WORLD_SIZE or 1)")
    p.add_argument("--hostfile", help="take the world size from a hostfile's slots (launch/*.sh)")
    p.add_argument("--num-nodes", type=int, help="with --hostfile: only its first N hosts")
    p.add_argument("--slots-per-node", type=int, help="with --hostfile: ranks per host")
    p.add_argument("--ranks-per-node", type=int,
                   help="ranks sharing one node's RAM (default: the hostfile's most slots, else the world size)")
    p.add_argument("--node-memory-gib", type=float,
                   help="memory of one node (CPU) or GPU (CUDA) (default: this machine's MemTotal, or "
                        "its first GPU's memory)")
    p.add_argument("--check-memory", action="store_true",
                   help="exit 3, with the switches that would help, when the peak does not fit")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    nodes, ranks_per_node = None, args.ranks_per_node
    if args.hostfile:
        from megagrpo.cluster.hostfile import HostfileError, describe, parse_hostfile, select
        try:
            hosts = select(parse_hostfile(args.hostfile), args.num_nodes, args.slots_per_node)
        except HostfileError as e:
            print(f"megagrpo: hostfile error: {e}", file=sys.stderr)
            return 2
        args.world_size, nodes = sum(h.slots for h in hosts), describe(hosts)
        ranks_per_node = ranks_per_node or max(h.slots for h in hosts)
    os.environ["WORLD_SIZE"] = str(args.world_size)  # validation checks the layout against it
    try:
        cfg = load_config(args.config, args.overrides, planning=True)
        plan = make_plan(cfg, args.world_size)
    except ConfigError as e:
        print(f"megagrpo: config error: {e}", file=sys.stderr)
        return 2
    if nodes:
        print(nodes)
    print(format_plan(plan))
    node_bytes, what = node_memory_bytes()
    if args.node_memory_gib:
        node_bytes = int(args.node_memory_gib * 2**30)
    ranks_per_node = min(ranks_per_node or args.world_size, args.world_size)
    verdict = memory_verdict(plan, cfg, ranks_per_node, node_bytes, what)
    if verdict and args.check_memory:
        print(f"megagrpo: the planned peak memory per rank {verdict}. (MEMORY_CHECK=0 skips this check in "
              "launch/*.sh; how the peak is counted: docs/parallelism.md, \"Memory per rank\".)", file=sys.stderr)
        return 3
    print(f"memory: {verdict or 'fits'}")
    split = f", each rank holding 1/{plan.sp} of it (sequence parallelism)" if plan.sp > 1 else ""
    print(f"longest sequence that trains in this memory: {longest_row(cfg, plan, ranks_per_node, node_bytes, what)} "
          f"tokens, alone in its micro-batch{split}")
    return 0


def config_reference(argv) -> int:
    p = argparse.ArgumentParser(prog="megagrpo config",
                                description="Print the configuration reference generated from the schema.")
    p.add_argument("--markdown", action="store_true", required=True,
                   help="as Markdown (docs/configuration.md is this output)")
    p.parse_args(argv)
    from megagrpo.config.docs import markdown
    print(markdown(), end="")
    return 0


def _train():
    from megagrpo.train import main
    return main


def _evaluate():
    from megagrpo.evaluation import main
    return main


def _report():
    from megagrpo.report import main
    return main


def _doctor():
    from megagrpo.doctor import main
    return main


def _rate():
    from megagrpo.rating.command import main
    return main


def _convert():
    from megagrpo.checkpoints.convert import main
    return main


# command -> a function returning its main(argv) (heavy modules are imported only when used)
COMMANDS = {"train": _train, "validate": lambda: validate_command, "plan": lambda: plan_command,
            "config": lambda: config_reference, "eval": _evaluate, "convert": _convert,
            "report": _report, "doctor": _doctor, "rate": _rate}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in COMMANDS:
        return COMMANDS[command]()(rest)
    print(f"megagrpo: unknown command '{command}'\n{USAGE}", file=sys.stderr)
    return 2


def run() -> None:
    """The `megagrpo` console script: main(), then exit without the interpreter's teardown
    (train and eval hold a vLLM engine; seconds of garbage collection: megagrpo/process_exit.py)."""
    exit_without_teardown(main())


if __name__ == "__main__":
    run()
