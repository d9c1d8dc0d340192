"""The readers-writer lock of tests/run.sh's two workers (tests/helpers/machine_share.py), held
by real processes: an `alone` test waits for the test beside it, and a test asked for after the
`alone` one waits for it too (the turnstile), so an `alone` test cannot be starved."""
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))
from machine_share import MachineShare  # noqa: E402


def _hold(folder, alone, wait_s, hold_s, events, name):
    time.sleep(wait_s)
    share = MachineShare(folder)
    share.hold(alone)
    events.put((name, "start", time.monotonic()))
    time.sleep(hold_s)
    events.put((name, "end", time.monotonic()))
    share.release()


def test_an_alone_test_waits_for_the_one_beside_it_and_is_not_overtaken(tmp_path):
    events = multiprocessing.Queue()
    # a test that shares (1 s); an alone one asked for at 0.2 s; another sharing one at 0.4 s
    plan = [("shared", False, 0.0, 1.0), ("alone", True, 0.2, 0.5), ("shared later", False, 0.4, 0.1)]
    workers = [multiprocessing.Process(target=_hold, args=(str(tmp_path), alone, wait, hold, events, name))
               for name, alone, wait, hold in plan]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    times = {(name, what): at for name, what, at in (events.get(timeout=5) for _ in range(6))}
    assert times["shared", "end"] <= times["alone", "start"], times
    assert times["alone", "end"] <= times["shared later", "start"], times


def test_two_shared_tests_run_side_by_side(tmp_path):
    events = multiprocessing.Queue()
    plan = [("first", 0.0, 1.0), ("second", 0.2, 0.1)]
    workers = [multiprocessing.Process(target=_hold, args=(str(tmp_path), False, wait, hold, events, name))
               for name, wait, hold in plan]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    times = {(name, what): at for name, what, at in (events.get(timeout=5) for _ in range(4))}
    assert times["second", "start"] < times["first", "end"], times
