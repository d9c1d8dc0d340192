"""`python -m megagrpo.hostfile check HOSTFILE ...`: the launch scripts' hostfile check (see
megagrpo/cluster/hostfile.py)."""
import sys

from megagrpo.cluster.hostfile import main

if __name__ == "__main__":
    sys.exit(main())
