"""The `gradsync` command line (also `python -m gradsync`)."""

from __future__ import annotations

import sys

from gradsync.version import __version__
from gradsync.cli import bench, demo, doctor, report, status
from gradsync.commandline import CommandParser
from gradsync.doctor import script as script_check
from gradsync.run import launcher


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(
        prog="gradsync",
        description="Data-parallel PyTorch training that does not hang, waste the network or lose progress.",
    )
    parser.add_argument("--version", action="version", version=f"gradsync {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_parser(commands)
    bench.add_parser(commands)
    doctor.add_parser(commands)
    report.add_parser(commands)
    status.add_parser(commands)
    commands.add_parser(
        "run",
        add_help=False,
        help="torchrun with a diagnosis of every hang and crash (gradsync run -h for its options)",
    )
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        # torchrun's own parser takes the rest (its options, then the script and its arguments).
        return launcher.main(argv[1:], probe=script_check)
    args = parser.parse_args(argv)
    return args.run(args)
