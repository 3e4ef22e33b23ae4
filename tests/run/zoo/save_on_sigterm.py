"""Stands in for a trainer that saves when it is stopped: each rank handles SIGTERM, says it is ready
(a file in --marker-dir), then works until stopped; on SIGTERM it "saves" for 1 s, writes
saved-rank<RANK> and exits 0. Plain torchrun forwards the SIGTERM it gets to the workers."""

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--marker-dir", required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    markers = Path(args.marker_dir)

    def save_and_exit(signum, frame):
        time.sleep(1)  # zoo: save
        (markers / f"saved-rank{rank}").write_text(signal.Signals(signum).name)
        sys.exit(0)

    signal.signal(signal.SIGTERM, save_and_exit)
    (markers / f"ready-rank{rank}").touch()
    while True:
        time.sleep(0.1)  # zoo: work


if __name__ == "__main__":
    main()
