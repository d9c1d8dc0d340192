"""megagrpo: large-scale GRPO training on DeepSpeed with a co-located vLLM engine."""
import os


def _ranks_on_this_node() -> int:
    """How many ranks the launcher started on this node (torchrun, the deepspeed runner, mpirun,
    srun); 1 for a lone process. Unknown under a multi-rank launch: taken as shared."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    world = os.environ.get("WORLD_SIZE", "1")
    return int(world) if world.isdigit() else 1


# With several ranks on a node, OpenMP threads that wait for work sleep instead of spinning
# (libgomp reads this when torch loads it, so it is set before anything imports torch; a user's
# own value wins). The ranks share the node's cores, and a waiting rank's spinning threads take
# them from the ranks that work: a 4-rank tp 2 job on 2 CPU cores took 150 s spinning, 80 s
# passive, bit-identical. A lone process keeps libgomp's spinning default, which is faster when
# nothing else wants its cores: 7.2 s a step against 7.8-8.3 s passive (docs/cpu-stack.md).
if _ranks_on_this_node() > 1:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
