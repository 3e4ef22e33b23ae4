"""The argument parser every gradsync command uses: a bad option is one line on stderr, exit code 2.

argparse prints its whole usage block before the error, which buries the one line that says
what is wrong; here the error names the command and points at its -h instead.
"""

from __future__ import annotations

import argparse
import functools
from typing import NoReturn


def _exit_with_one_line(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    message = " ".join(message.split())  # a type's message may span lines; the error must not
    parser.exit(2, f"{parser.prog}: error: {message} (see {parser.prog} -h)\n")


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser with one-line errors; add_subparsers makes its subcommands CommandParsers too."""

    def error(self, message: str) -> NoReturn:
        _exit_with_one_line(self, message)

    def parse_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def, override]
        # argparse reports a subcommand's unknown options from the top-level parser; the
        # subcommand's own -h is the one that lists what it takes.
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self._chosen_command(namespace).error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace

    def _chosen_command(self, namespace: argparse.Namespace) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and action.dest != argparse.SUPPRESS:
                chosen = action.choices.get(getattr(namespace, action.dest, None))
                if isinstance(chosen, CommandParser):
                    return chosen._chosen_command(namespace)
                if chosen is not None:
                    return chosen
        return self


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give a parser built elsewhere (torchrun's, under `gradsync run`) the same one-line errors."""
    parser.error = functools.partial(_exit_with_one_line, parser)  # type: ignore[method-assign]
    return parser
