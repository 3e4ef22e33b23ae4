"""Bad launches are stopped at the door: one line, exit code 2, no worker started, no run folder."""

from __future__ import annotations

import pytest

from gradsync.cli import main
from gradsync.errors import ConfigError


@pytest.fixture
def in_empty_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('trained')\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise SystemExit('importing the package runs its code')\n")
    (tmp_path / "pkg" / "train.py").write_text("print('trained')\n")
    return tmp_path


@pytest.mark.parametrize("argv, says", [
    (["missing.py"], "missing.py: no such file"),
    (["scripts"], "scripts is a folder, not a script"),
    (["-m", "no_such_module"], "no module named 'no_such_module'"),
    (["-m", "pkg.no_such_module"], "no module named 'pkg.no_such_module'"),
    (["--nproc-per-node", "0", "train.py"], "--nproc-per-node 0: start at least 1 worker"),
    (["--nproc-per-node", "-1", "train.py"], "--nproc-per-node -1: start at least 1 worker"),
    (["--nproc-per-node", "abc", "train.py"], "--nproc-per-node abc: give the number of worker processes"),
    (["--nnodes", "abc", "train.py"], "--nnodes abc: give a number of hosts"),
    (["--nnodes", "4:1", "train.py"], "--nnodes 4:1: the range needs 1 <= MIN <= MAX"),
    (["--max-restarts", "-1", "train.py"], "--max-restarts -1: give 0"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "10.0.0.1", "train.py"], "--node-rank 2: with --nnodes 2"),
    (["--no-python", "train.py"], "--no-python"),
    (["--max-restarts", "abc", "train.py"], "invalid int value: 'abc'"),
    (["--doctor-checks", "same_file", "train.py"], "--doctor-checks same_file: it selects checks of the script check"),
    (["--doctor-steps", "3", "--doctor-checks", "same_file,nope", "train.py"],
     "--doctor-checks nope: no such check; choose among identical_batches, "),
    (["--doctor-steps", "3", "--doctor-checks", ",", "train.py"], "--doctor-checks ',': name at least one check"),
])
def test_a_bad_launch_is_one_line_and_exit_code_2(in_empty_folder, capsys, argv, says):
    code = _exit_code(lambda: main(["run", *argv]))
    err = capsys.readouterr().err
    assert code == 2 and says in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (in_empty_folder / "gradsync_runs").exists(), "no run folder is left behind"


def test_the_checks_doctor_checks_names_reach_the_options(in_empty_folder):
    from gradsync.doctor import script as script_check
    from gradsync.run import launcher

    def options(*argv):
        return launcher._options(launcher.build_parser(script_check).parse_args([*argv, "train.py"]), script_check)

    chosen = options("--doctor-steps", "3", "--doctor-checks", "same_file,identical_batches")
    assert chosen.doctor_checks == ["identical_batches", "same_file"]  # the registry's order
    assert chosen.script_probe == "gradsync.doctor.script"  # the workers import the checks by this name
    assert options("--doctor-steps", "3").doctor_checks is None  # every check
    assert options().script_probe is None  # a plain run carries no probe


def test_good_targets_pass_the_door_without_importing_anything(in_empty_folder):
    from gradsync.run.launcher import check_target

    check_target("train.py", as_module=False)
    check_target("pkg.train", as_module=True)  # found without running pkg/__init__.py
    check_target("json.tool", as_module=True)
    with pytest.raises(ConfigError, match="'json' is a package without a __main__ module"):
        check_target("json", as_module=True)  # as `python -m json` fails
    (in_empty_folder / "app").mkdir()
    (in_empty_folder / "app" / "__main__.py").write_text("")
    check_target("app", as_module=False)  # python runs a folder's __main__.py


def test_a_bad_demo_option_is_one_line(in_empty_folder, capsys):
    for argv, says in ((["--batch-size", "0"], "--batch-size: 0: give at least 1"),
                       (["--epochs", "-2"], "--epochs: -2: give at least 1"),
                       (["--resume", "auto"], "--resume, --overwrite and --checkpoint-every need --checkpoint-dir")):
        code = _exit_code(lambda: main(["demo", *argv]))
        err = capsys.readouterr().err
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert not (in_empty_folder / "gradsync_runs").exists()


def test_the_demo_refuses_a_checkpoint_folder_of_an_earlier_run(in_empty_folder, capsys):
    step = in_empty_folder / "ckpt" / "step-000000030"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    code = _exit_code(lambda: main(["demo", "--checkpoint-dir", "ckpt"]))
    err = capsys.readouterr().err
    assert code == 2 and "already holds checkpoints of an earlier run (newest: step 30)" in err
    assert "--resume auto" in err and "--overwrite" in err
    assert not (in_empty_folder / "gradsync_runs").exists()


def _exit_code(call) -> int:
    try:
        return call()
    except SystemExit as exiting:
        return exiting.code


def test_help_does_not_offer_the_refused_options(capsys):
    assert _exit_code(lambda: main(["run", "--help"])) == 0
    help_text = capsys.readouterr().out
    assert "--stall-timeout" in help_text and "--nproc-per-node" in help_text
    assert "--no-python" not in help_text and "--run-path" not in help_text
