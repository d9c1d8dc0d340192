"""Ending a megagrpo process without the interpreter's teardown.

A process that has imported torch, transformers, DeepSpeed and vLLM holds millions of Python
objects. At exit the interpreter runs full garbage collections over all of them and clears
every module: about 1.6 s of CPU after the imports alone, 3-4 s after a vLLM engine ran, per
rank (docs/benchmarks.md, "The end of a job"). The operating system frees that memory anyway.
exit_without_teardown(code) does what an exit must and skips the rest:
- threading's exit callbacks and the wait for non-daemon threads (as the interpreter does);
- the atexit hooks: vLLM's engine shutdown, logging's, multiprocessing's;
- MPI_Finalize under mpirun (mpi4py's own hook is one of the skipped ones);
- flushed streams, then the C library's exit, whose destructors remove vLLM-CPU's
  shared-memory segments.
Only for `__main__` blocks and console scripts: it never returns.
run_rank(work, rank) runs a rank's work and, when it fails, ends the rank at once.
This module imports nothing of megagrpo (layer 0 of tests/test_package.py::LAYERS).
"""
from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import traceback
from typing import NoReturn


def exit_without_teardown(code: int | None) -> NoReturn:
    """Exit with `code` (None: 0) as sys.exit would, less the interpreter's teardown."""
    # the interpreter's own first step: threading's exit callbacks (they stop idle
    # concurrent.futures workers, which would otherwise be waited for forever), then a join of
    # every non-daemon thread; then its atexit hooks
    threading._shutdown()
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")  # under mpirun (DeepSpeed's MPI discovery imports it)
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()  # mpi4py's own hook is one the teardown runs; mpirun fails a rank that skips it
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be written to it
            pass
    ctypes.CDLL(None).exit(int(code or 0))
    raise SystemExit(code)  # not reached: exit() does not return


def run_rank(work, rank: int, expected: tuple = ()):
    """A rank's work (returns what it returns); a failure is printed naming the rank (with its
    traceback unless one of `expected`, errors whose message says it all) and ends the process at once:
    other ranks may wait in a collective, and the launcher stops them when it sees this one
    exit, instead of everyone hanging until the process-group timeout."""
    try:
        return work()
    except Exception as e:  # noqa: BLE001 - every failure must end this rank now
        if not isinstance(e, expected):
            traceback.print_exc()
        print(f"megagrpo: error on rank {rank}: {e or type(e).__name__}", file=sys.stderr, flush=True)
        os._exit(1)
