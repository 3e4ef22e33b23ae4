"""What every gradsync command shares: --version, and a bad option told in one line with exit code 2."""

import argparse

import pytest
from torch.distributed.run import get_args_parser

import gradsync
from gradsync.cli import main
from gradsync.commandline import one_line_errors


def test_version_prints_the_package_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr() == (f"gradsync {gradsync.__version__}\n", "")


@pytest.mark.parametrize(("argv", "prog"), [
    ([], "gradsync"),
    (["nope"], "gradsync"),
    (["--bogus"], "gradsync"),
    (["demo", "--batch-size", "abc"], "gradsync demo"),
    (["demo", "--precision", "fp8"], "gradsync demo"),
    (["demo", "--bogus"], "gradsync demo"),
    (["doctor", "--nproc-per-node", "two"], "gradsync doctor"),
    (["doctor", "--master-port"], "gradsync doctor"),
    (["report"], "gradsync report"),
    (["report", "run", "--bogus"], "gradsync report"),
    (["bench"], "gradsync bench"),
    (["bench", "train", "--steps", "x"], "gradsync bench train"),
    (["bench", "allreduce", "--bogus"], "gradsync bench allreduce"),
])
def test_a_bad_option_is_one_line_naming_the_command_and_exit_code_2(argv, prog, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"{prog}: error: ") and err.endswith(f" (see {prog} -h)\n"), err


def test_the_error_line_says_what_is_wrong(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "train", "--steps", "x"])
    assert capsys.readouterr().err == (
        "gradsync bench train: error: argument --steps: invalid int value: 'x' (see gradsync bench train -h)\n"
    )


def test_a_parser_built_elsewhere_gets_the_same_one_line_errors(capsys):
    torchrun = get_args_parser()
    torchrun.prog = "gradsync run"
    one_line_errors(torchrun)
    with pytest.raises(SystemExit) as exited:
        torchrun.parse_args(["--nnodes"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == "gradsync run: error: argument --nnodes: expected one argument (see gradsync run -h)\n"

    def spans_lines(text):
        raise argparse.ArgumentTypeError(f"{text!r} is wrong:\n  give a number")

    parser = one_line_errors(argparse.ArgumentParser(prog="tool"))
    parser.add_argument("--n", type=spans_lines)
    with pytest.raises(SystemExit):
        parser.parse_args(["--n", "x"])
    assert capsys.readouterr().err == "tool: error: argument --n: 'x' is wrong: give a number (see tool -h)\n"
