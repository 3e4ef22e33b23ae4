"""The `gradsync` command line (also `python -m gradsync`)."""

from __future__ import annotations

import argparse
import sys

from gradsync.cli import demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gradsync",
        description="Data-parallel PyTorch training that does not hang, waste the network or lose progress.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_parser(commands)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return args.run(args)
