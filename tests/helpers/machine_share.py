"""The machine shared by tests/run.sh's two pytest-xdist workers: a test marked `alone`
(pytest.ini) runs with no other test beside it, every other test beside at most one other.

A readers-writer lock (fcntl.flock on two files of a folder both workers see): each test holds
the lock shared; an `alone` test holds it exclusive, kept across the consecutive `alone` tests of
its module (their module fixtures too). The turnstile keeps a waiting `alone` test from being
overtaken by the other worker's next tests."""
import fcntl
import os


class MachineShare:
    def __init__(self, folder: str):
        self.lock = open(os.path.join(folder, "machine.lock"), "a")
        self.turnstile = open(os.path.join(folder, "turnstile.lock"), "a")
        self.held = None  # fcntl.LOCK_SH or LOCK_EX while held

    def hold(self, alone: bool) -> None:
        mode = fcntl.LOCK_EX if alone else fcntl.LOCK_SH
        if self.held == mode:
            return
        self.release()
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.lock, mode)
        finally:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        self.held = mode

    def release(self) -> None:
        if self.held is not None:
            fcntl.flock(self.lock, fcntl.LOCK_UN)
            self.held = None
