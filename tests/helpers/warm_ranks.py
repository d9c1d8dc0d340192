"""Ranks that start warm: the worker torchrun starts is a stand-in (this file, standard library
only) that asks a server which has imported the trainer and vLLM already to fork the rank. The
rank is a real process of its own with the worker's argv, environment, working directory and
stdio; the stand-in forwards the signals it gets (SIGTERM from torchrun, SIGABRT from a test's
timeout) and exits as the rank did, so torchrun sees the rank's exit code or signal. A stand-in
that dies (SIGKILL) takes its rank with it. Each rank skips about 6 s of imports (megagrpo.train
3 s, vLLM's engine 3 s, on one core): 12 s of CPU a 2-rank launch, 24 s a 4-rank one.

    conftest.torchrun(2, "-m", "megagrpo.train", ...)   # warm by default: the stand-in runs
    python tests/helpers/warm_ranks.py --serve SOCKET   # the server (started by conftest once)

A rank starts cold (the stand-in execs Python as torchrun would have) when no server is set
(MEGAGRPO_TEST_WARM_RANKS) or when its environment differs from the server's in a variable
read while the server imported (OpenMP's, the allocator's); its PYTHONPATH may add folders.

Measured against cold and warm_jobs.py (see there): 0.48 s a one-rank launch that exits at its
config check, against 7.9 s cold; warm_jobs' forkserver preloads nothing on Python 3.11, so this
is the one mechanism that starts warm.
"""
import array
import json
import os
import select
import signal
import socket
import struct
import sys
import time

SOCKET_VAR = "MEGAGRPO_TEST_WARM_RANKS"
IMPORT_TIME_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "OMP_PROC_BIND", "KMP_AFFINITY", "MKL_NUM_THREADS",
                    "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONHASHSEED", "DS_ACCELERATOR")
"""Read when the server imported (libgomp reads OpenMP's settings when torch loads it): a rank
whose value differs starts cold."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGABRT, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


def _send(sock, message: dict, fds=()) -> None:
    data = json.dumps(message).encode()
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([struct.pack("!I", len(data)) + data], ancillary)


def _receive(sock, with_fds=False):
    """One message (and the fds sent with it); None at end of stream."""
    fds = array.array("i")
    head, ancillary, _, _ = sock.recvmsg(4, socket.CMSG_LEN(16 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    if len(head) < 4:
        return (None, list(fds)) if with_fds else None
    size, body = struct.unpack("!I", head)[0], b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return (None, list(fds)) if with_fds else None
        body += chunk
    message = json.loads(body)
    return (message, list(fds)) if with_fds else message


# --- the stand-in (torchrun's worker) ---------------------------------------------------------

def _cold(target: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-u", *target])


def stand_in(target: list[str]) -> None:
    path = os.environ.get(SOCKET_VAR)
    if not path:
        _cold(target)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.time() + 180  # the first launch waits for the server's imports
    while True:
        try:
            sock.connect(path)
            break
        except FileNotFoundError:  # the server has not finished its imports
            if time.time() > deadline:
                print(f"warm_ranks: no server at {path} after 180 s; starting cold", file=sys.stderr, flush=True)
                _cold(target)
            time.sleep(0.2)
        except OSError as e:  # it is gone
            print(f"warm_ranks: the server at {path} does not answer ({e}); starting cold", file=sys.stderr,
                  flush=True)
            _cold(target)
    _send(sock, {"argv": target, "env": dict(os.environ), "cwd": os.getcwd()}, fds=(0, 1, 2))
    reply = _receive(sock)
    if reply is None or "cold" in reply:
        sock.close()
        _cold(target)
    pid = reply["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda number, frame: os.kill(pid, number))
    status = (_receive(sock) or {}).get("status")
    if status is None:
        os._exit(1)
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    os._exit(os.waitstatus_to_exitcode(status))


# --- the server ---------------------------------------------------------------------------------

def _rank(argv: list[str], env: dict, cwd: str) -> None:
    """In the forked child: become the rank and run its target as Python would have."""
    import random
    import runpy

    os.setsid()  # a group of its own, for what it leaves behind
    for sig in range(1, signal.NSIG):
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    from warm_preload import environment_after_imports

    os.environ.clear()
    os.environ.update(environment_after_imports(env))
    os.chdir(cwd)
    sys.path[0] = cwd if argv[0] == "-m" else os.path.dirname(os.path.abspath(argv[0]))  # as Python sets it
    sys.path[1:1] = [p for p in python_path(env) if p not in sys.path]  # the folders its PYTHONPATH adds
    random.seed()  # a cold process's state, not the server's
    sys.stdout.reconfigure(write_through=True)
    sys.stderr.reconfigure(write_through=True)
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    from megagrpo.process_exit import exit_without_teardown
    exit_without_teardown(code)


def python_path(env: dict) -> list[str]:
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _cold_because(env: dict, server_env: dict) -> str | None:
    """Why a rank with this environment cannot start from the server's imports (None: it can)."""
    changed = next((k for k in IMPORT_TIME_VARS if env.get(k) != server_env.get(k)), None)
    if changed:
        return f"{changed} differs"
    missing = set(python_path(server_env)) - set(python_path(env))
    return f"PYTHONPATH lacks {sorted(missing)}" if missing else None


def serve(path: str) -> None:
    from warm_preload import BEFORE, PRELOAD

    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # connectable once the imports are done
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    ranks: dict = {}  # pid -> its stand-in's connection (None once the stand-in is gone)
    print(f"warm_ranks: serving at {path} ({', '.join(PRELOAD)} imported)", flush=True)
    while os.getppid() == parent:
        watched = [conn for conn in ranks.values() if conn is not None]
        ready, _, _ = select.select([listener, wake_r, *watched], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        for pid, conn in list(ranks.items()):  # a stand-in gone (it sends nothing else): its rank goes too
            if conn in ready and _gone(conn):
                conn.close()
                ranks[pid] = None
                _kill_group(pid)
        _reap(ranks)
        if listener in ready:
            _fork_rank(listener, ranks, BEFORE, (wake_r, wake_w))
    for pid in ranks:
        _kill_group(pid)


def _gone(conn) -> bool:
    try:
        return conn.recv(1) == b""
    except OSError:
        return True


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(ranks: dict) -> None:
    """Tell each ended rank's stand-in how it ended."""
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = ranks.pop(pid, None)
        if conn is not None:
            try:
                _send(conn, {"status": status})
            except OSError:
                pass
            conn.close()


def _fork_rank(listener, ranks: dict, before: dict, wake_fds) -> None:
    conn, _ = listener.accept()
    request, fds = _receive(conn, with_fds=True)
    mismatch = request and _cold_because(request["env"], before)
    if request is None or len(fds) != 3 or mismatch:
        if request is not None:
            _send(conn, {"cold": mismatch or "no stdio"})
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        for sock in (listener, conn, *(c for c in ranks.values() if c is not None)):
            sock.close()
        for fd in wake_fds:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        _rank(request["argv"], request["env"], request["cwd"])
    for fd in fds:
        os.close(fd)
    ranks[pid] = conn
    _send(conn, {"pid": pid})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        stand_in(sys.argv[1:])
