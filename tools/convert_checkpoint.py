"""Offline checkpoint conversion: the same as `megagrpo convert` (see megagrpo/checkpoints/convert.py).

    python tools/convert_checkpoint.py inspect runs/x/checkpoints/step_00000040
    python tools/convert_checkpoint.py to-hf runs/x/checkpoints/step_00000040 out/hf --dtype bfloat16
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megagrpo.checkpoints.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
