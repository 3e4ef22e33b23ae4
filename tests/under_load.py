"""Run a command (the whole suite, for `make test-under-load`) beside processes that keep every core busy.

CI runs on the developer's own machine, which is not always idle: a test that passes only on a
quiet machine fails some day. This gives the suite a machine that is never quiet: one spinning
process per core (by default), at normal priority, for as long as the command runs. The spinners
are pure-Python loops, so they compete for the CPU the way another job's Python would; each
checks that its parent is alive, so none outlives an interrupted run.

    python tests/under_load.py [--busy N] -- COMMAND...

Exits with the command's status and says how much CPU the spinners actually took.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import psutil

# Checks its parent every ~million iterations (a few tens of milliseconds) and exits once orphaned.
SPINNER = """
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(1_000_000):
        pass
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="spinning processes (default: one per core)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    spinners = [subprocess.Popen([sys.executable, "-c", SPINNER]) for _ in range(args.busy)]
    started = time.monotonic()
    try:
        code = subprocess.call(command)
    finally:
        wall = time.monotonic() - started
        used = []
        for spinner in spinners:
            try:
                times = psutil.Process(spinner.pid).cpu_times()
                used.append(times.user + times.system)
            except psutil.Error:
                used.append(float("nan"))
            spinner.kill()
            spinner.wait()
    shares = ", ".join(f"{cpu / wall:.0%}" for cpu in used)
    print(f"under load: {' '.join(command)} exited {code} after {wall:.0f} s beside {len(spinners)} busy "
          f"processes, which had {shares} of a core each", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
