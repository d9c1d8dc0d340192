"""megagrpo: large-scale GRPO training on DeepSpeed with a co-located vLLM engine."""
import os

# OpenMP threads that wait for work sleep instead of spinning (libgomp reads this when torch
# loads it, so it is set before anything imports torch; a user's own value wins). Ranks on one
# node share its cores, and a waiting rank's spinning threads take them from the ranks that
# work: a 4-rank tp 2 job on 2 CPU cores took 150 s spinning, 80 s passive, bit-identical
# (docs/cpu-stack.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
