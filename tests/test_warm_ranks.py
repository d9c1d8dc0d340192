"""tests/helpers/warm_ranks.py, the tests' own launch machinery: a rank torchrun starts through the
stand-in is forked from the warm server with the worker's argv, environment, sys.path and stdio,
torchrun sees its exit code, and torchrun's SIGTERM reaches it through the stand-in."""
import pytest
from conftest import run, torchrun

PROGRAM = r"""
import os, sys, time
warm = "megagrpo.train" in sys.modules  # imported before this script's first line: forked warm
rank = int(os.environ["RANK"])
print(f"rank {rank}: warm={warm} argv={sys.argv[1:]} path0={sys.path[0]} extra={os.environ.get('EXTRA')}", flush=True)
if rank == 1:
    sys.exit(3)
time.sleep(120)  # torchrun stops it (SIGTERM) when rank 1 fails
print("rank 0 woke", flush=True)
"""


@pytest.mark.multirank
@pytest.mark.parametrize("warm", [True, False])
def test_a_rank_gets_its_worker_and_torchrun_sees_how_it_ended(tmp_path, warm):
    script = tmp_path / "rank.py"
    script.write_text(PROGRAM)
    proc = run([*torchrun(2, str(script), "a", "--b=c", warm=warm)], timeout=90, check=False,
               env={"EXTRA": "set by the test"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for rank in (0, 1):
        assert (f"rank {rank}: warm={warm} argv=['a', '--b=c'] path0={tmp_path} extra=set by the test") in out, out
    assert "exitcode  : 3" in out, out[-3000:]  # torchrun's report of rank 1
    assert "rank 0 woke" not in out  # torchrun's SIGTERM reached rank 0 within run()'s 90 s
