"""Headless Chromium (Debian's) for the tests that look at a page: a screenshot, and the page's
console lines (an exception thrown by the page shows up there)."""
import subprocess

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0"]


def screenshot(page, tmp_path, name, height=3000):
    """Chromium's screenshot of file `page` (1200 x height): (process, PNG path, console lines)."""
    shot = tmp_path / f"{name}.png"
    proc = subprocess.run(["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / name}",
                           f"--window-size=1200,{height}", f"--screenshot={shot}", f"file://{page}"],
                          capture_output=True, text=True, timeout=120)
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return proc, shot, console
